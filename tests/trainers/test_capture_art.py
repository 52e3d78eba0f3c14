"""ART's token reading against our replies (openpipe-art 0.5.23): the official openai SDK on one session, with the
extra body ART's trainable model sends (`Model._default_chat_completion_extra_body`: `return_token_ids`,
`return_tokens_as_token_ids`, `nvext.extra_fields`, `chat_template_kwargs`) and `logprobs`, each reply run through
ART's own code:

- plain: `art.model._attach_response_art_metadata` (what ART's client proxy runs on every non-streamed reply: Dynamo's
  fields, then vLLM's top-level `prompt_token_ids` copied onto the choice, the choice's token count checked against
  `usage.completion_tokens`), then `preprocessing.vllm_tokens.choice_vllm_token_metadata` (the prompt and completion
  ids ART trains on) and `preprocessing.tokenize._choice_logprobs` (their logprobs, one per completion id or an
  error);
- streamed: `art.openai.consume_sync_chat_completion_stream` (ART's own stream assembly: the prompt ids from any
  chunk, `token_ids` and logprobs joined across chunks), then the same two readers.

ART 0.5.23 needs Python 3.12 (`art/trajectories` uses 3.12 syntax) and its package __init__ pulls in litellm, weave
and polars; this venv is 3.11. So its modules are loaded from the installed package without running `art/__init__`:
`art.openai` and `art.preprocessing.{vllm_tokens,dynamo_tokens,policy_spans}` import as they are, and the two
functions whose modules cannot import on 3.11 (`model.py`, `preprocessing/tokenize.py`) are compiled from their
installed source text, unchanged, with the names they use bound to ART's own modules.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Literal, Optional

import openai
import pytest
from capture_episode import SYSTEM, TOOLS, Call, CallIds, assert_recovered, run_episode, session_base
from openai.types.chat.chat_completion import Choice
from sample_checks import LORA

from support.server import new_session
from support.stack import Stack

# ART's trainable-model defaults (art/model.py, Model._default_chat_completion_extra_body)
ART_EXTRA_BODY = {"return_token_ids": True, "return_tokens_as_token_ids": True,
                  "nvext": {"extra_fields": ["engine_data"]}, "chat_template_kwargs": {"preserve_thinking": True}}


def _art_root() -> Path:
    if "art" in sys.modules:  # the bare package _art_modules put there
        return Path(next(iter(sys.modules["art"].__path__)))
    spec = importlib.util.find_spec("art")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0])


def _art_modules() -> dict[str, types.ModuleType]:
    """ART's reply-reading modules, imported from the installed package with `art` and `art.preprocessing` as bare
    packages (their __init__ files not run)."""
    root = _art_root()
    for name, path in (("art", root), ("art.preprocessing", root / "preprocessing")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    names = ("art.preprocessing.vllm_tokens", "art.preprocessing.dynamo_tokens", "art.preprocessing.policy_spans",
             "art.openai")
    return {n.rsplit(".", 1)[-1]: importlib.import_module(n) for n in names}


def _art_function(relative: str, name: str, namespace: dict[str, Any], future_annotations: bool) -> Any:
    """One top-level function of an ART source file, compiled from the installed text as it is."""
    path = _art_root() / relative
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    flags = __future__.annotations.compiler_flag if future_annotations else 0
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True),
         namespace)
    return namespace[name]


class Art:
    """The ART functions the test calls."""

    def __init__(self) -> None:
        mods = _art_modules()
        vllm, dynamo, spans = mods["vllm_tokens"], mods["dynamo_tokens"], mods["policy_spans"]
        self.consume_stream = mods["openai"].consume_sync_chat_completion_stream
        self.token_metadata = vllm.choice_vllm_token_metadata
        self.completion_tokens = vllm.choice_completion_tokens
        names = {**{n: getattr(vllm, n) for n in dir(vllm)}, **{n: getattr(spans, n) for n in dir(spans)},
                 "attach_dynamo_token_metadata": dynamo.attach_dynamo_token_metadata,
                 "Any": Any, "Literal": Literal, "Optional": Optional}
        self.attach = _art_function("model.py", "_attach_response_art_metadata", names, future_annotations=False)
        self.choice_logprobs = _art_function(
            "preprocessing/tokenize.py", "_choice_logprobs",
            {"Any": Any, "Choice": Choice, "choice_completion_logprobs": dynamo.choice_completion_logprobs,
             "has_completion_logprobs": dynamo.has_completion_logprobs}, future_annotations=True)

    def read(self, choice: Choice) -> CallIds:
        """What ART trains on from one choice: its prompt and completion ids, and their logprobs."""
        metadata = self.token_metadata(choice)
        assert metadata is not None, "ART found no vLLM token ids on the choice"
        prompt, completion = metadata
        logprobs, _ = self.choice_logprobs(choice, token_count=len(completion), allow_training_without_logprobs=False)
        return CallIds(prompt, completion, logprobs)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_art_reads_the_sessions_ids(trainer_stack: Stack, stream: bool) -> None:
    art = Art()
    read: list[CallIds] = []

    def call_for(sid: str) -> Call:
        sdk = openai.OpenAI(base_url=session_base(trainer_stack.server, sid), api_key="x", max_retries=0)

        def call(messages: list[dict[str, Any]]) -> dict[str, Any]:
            kwargs: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS, "logprobs": True,
                                      "extra_body": ART_EXTRA_BODY}
            if stream:
                completion = art.consume_stream(sdk.chat.completions.create(stream=True, **kwargs))
            else:
                completion = sdk.chat.completions.create(**kwargs)
                art.attach(completion, None, "none", "m")
            (choice,) = completion.choices
            read.append(art.read(choice))
            if not stream:  # the token count ART books for the choice: the reply's usage, checked against the ids
                assert art.completion_tokens(choice) == len(read[-1].completion)
            return choice.message.model_dump(exclude_none=True)

        return call

    stored = run_episode(trainer_stack.server, call_for)
    assert_recovered(stored, read)


def test_art_requires_policy_spans_and_reads_the_adapter_revision_off_a_lora_turn(trainer_stack: Stack) -> None:
    """ART's "require" policy tracking (its immutable step-LoRA mode): a turn of a session pinned to the sim's adapter
    carries complete spans naming its revision; a base-model turn carries none, which ART refuses."""
    art = Art()
    spans = _art_modules()["policy_spans"]

    def first_reply(metadata: dict[str, Any] | None) -> Any:
        sdk = openai.OpenAI(base_url=session_base(trainer_stack.server, new_session(trainer_stack.server, metadata)),
                            api_key="x", max_retries=0)
        return sdk.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "fix it"}],
                                           logprobs=True, extra_body=ART_EXTRA_BODY)

    lora = first_reply({"lora_adapter": LORA})
    art.attach(lora, None, "require", "m")  # ART's own checks: both lists present, each a complete partition
    (choice,) = lora.choices
    prompt, completion = art.token_metadata(choice)
    (span,) = spans.choice_policy_token_spans(choice)
    assert (span.start_token, span.end_token) == (0, len(completion)) == (0, art.completion_tokens(choice))
    assert (span.lora_slot, span.policy_version, span.update_seq) == (LORA, 0, 0)
    (prompt_span,) = spans.choice_prompt_policy_token_spans(choice)
    assert (prompt_span.start_token, prompt_span.end_token) == (1, len(prompt))

    base = first_reply(None)
    with pytest.raises(RuntimeError, match="requires prompt_policy_token_spans"):
        art.attach(base, None, "require", "m")


def test_art_requires_policy_spans_of_a_streamed_lora_turn_too(trainer_stack: Stack) -> None:
    """The same on a streamed turn, through ART's own stream assembly in its "require" mode (the flag its client
    sets on the stream): the spans on the finishing chunk make both lists complete for the joined reply's ids; a
    base-model stream carries none, which ART refuses."""
    art = Art()
    spans = _art_modules()["policy_spans"]

    def streamed(metadata: dict[str, Any] | None) -> Any:
        sdk = openai.OpenAI(base_url=session_base(trainer_stack.server, new_session(trainer_stack.server, metadata)),
                            api_key="x", max_retries=0)
        stream = sdk.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "fix it"}],
                                             logprobs=True, stream=True, extra_body=ART_EXTRA_BODY)
        stream._art_require_policy_spans = True  # what ART's client sets in its "require" mode
        return art.consume_stream(stream)

    (choice,) = streamed({"lora_adapter": LORA}).choices
    prompt, completion = art.token_metadata(choice)
    (span,) = spans.choice_policy_token_spans(choice)
    assert (span.start_token, span.end_token) == (0, len(completion))
    assert (span.lora_slot, span.policy_version, span.update_seq) == (LORA, 0, 0)
    (prompt_span,) = spans.choice_prompt_policy_token_spans(choice)
    assert (prompt_span.start_token, prompt_span.end_token) == (1, len(prompt))
    with pytest.raises(Exception, match="omitted prompt or completion policy spans"):
        streamed(None)
