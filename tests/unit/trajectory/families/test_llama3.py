"""Llama 3.1 against oracles we did not write: Meta's tokenizer, the `renderers` package's Llama-3 renderer and
SGLang 0.5.23's `llama3` tool-call detector.

- Tokenizer: the ranks the builder takes from quicktok-v1 are Meta's `tokenizer.model` (sha256), and our Hugging Face
  tokenizer encodes like Meta's reference tokenizer (tiktoken with Meta's split pattern over those ranks).
- Template: our rendered ids == `renderers`' `Llama3Renderer` (Meta's Llama 3.2 template, which for custom tools
  writes what 3.1's does: the two differ only with built-in tools), multi-turn with tools in the first user message
  or in the system block, tool results, later system messages; and every TITO prompt == its `bridge_to_next_turn`.
- Parser: our parse == SGLang's `llama3` detector on hypothesis replies (text, then calls after `<|python_tag|>`, or
  calls alone, `;`-separated, nested JSON and unicode).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.sglang_real import import_sglang_schema
from support.tito import ARGUMENT_NAME, CALL_NAME, NESTED_JSON, WORD, Reply, call_item, generate
from trajectory import LinearTrajectory, ModelFamily

renderers = pytest.importorskip("renderers")
tiktoken = pytest.importorskip("tiktoken")
from renderers.configs import Llama3RendererConfig  # noqa: E402
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

from scripts.build_tokenizers import LLAMA3_PATTERN  # noqa: E402

SETTINGS = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def family(families: dict[str, ModelFamily]) -> ModelFamily:
    return families["llama-3.1"]


@pytest.fixture(scope="module")
def meta_tokenizer(tokenizer_dirs: dict[str, Path], family: ModelFamily) -> Any:
    """Meta's reference tokenizer: tiktoken over `tokenizer.model` with Meta's pattern and special tokens."""
    specials = {t.content: i for i, t in family.tokenizer.added_tokens_decoder.items()}
    return tiktoken.Encoding("llama3", pat_str=LLAMA3_PATTERN, special_tokens=specials,
                             mergeable_ranks=load_tiktoken_bpe(str(tokenizer_dirs["llama-3.1"] / "tokenizer.model")))


def test_ranks_are_metas_tokenizer_model(tokenizer_dirs):
    ranks = (tokenizer_dirs["llama-3.1"] / "tokenizer.model").read_bytes()
    assert hashlib.sha256(ranks).hexdigest() == "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"


def test_special_tokens_have_llama_31s_names(family):
    tok = family.tokenizer
    assert tok.convert_ids_to_tokens([128000, 128004, 128006, 128007, 128008, 128009, 128010, 128255]) == [
        "<|begin_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
        "<|eot_id|>", "<|python_tag|>", "<|reserved_special_token_247|>"]


@SETTINGS
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
       | st.lists(st.sampled_from(["<|eot_id|>", "<|python_tag|>", "{\"name\": ", "東京", " don't", "12345", "\n\n",
                                   "  ", "é", "I'LL"]), max_size=8).map("".join))
def test_ids_equal_metas_tokenizer(family, meta_tokenizer, text):
    assert family.encode(text) == meta_tokenizer.encode(text, allowed_special="all")


# -- template -------------------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"}}, "required": ["key"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
]


def _call(i: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return call_item(i, name, arguments, ensure_ascii=False)  # as the template writes the object


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief. Ünïcödé ok.  "},
    {"role": "user", "content": "Look up naïve keys 東京"},
    {"role": "assistant", "content": "", "tool_calls": [_call(0, "lookup", {"key": "東京", "n": 2})]},
    {"role": "tool", "tool_call_id": "c0", "content": "found 3"},
    {"role": "assistant", "content": "", "tool_calls": [_call(1, "add", {"a": 1.5, "b": -2})]},
    {"role": "tool", "tool_call_id": "c1", "content": "-0.5"},
    {"role": "assistant", "content": "Both done."},
    {"role": "user", "content": "  and again?  "},
    {"role": "system", "content": "Answer in French."},
    {"role": "assistant", "content": "Encore."},
    {"role": "user", "content": "ok"},
]


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
@pytest.mark.parametrize("in_user", [True, False], ids=["tools-in-user", "tools-in-system"])
def test_rendered_ids_equal_the_renderers_llama3(family, tools, in_user):
    oracle = renderers.create_renderer(family.tokenizer, Llama3RendererConfig(tools_in_user_message=in_user))
    kwargs = None if in_user else {"tools_in_user_message": False}
    for start in (0, 1):  # with and without a system message
        for end in range(start + 2, len(CONVERSATION) + 1):
            messages = CONVERSATION[start:end]
            for generation in (True, False):
                ours = family.encode(family.render(messages, tools, generation, kwargs))
                assert ours == oracle.render_ids(messages, tools=tools, add_generation_prompt=generation), (
                    start, end, generation)


@pytest.mark.parametrize("stop", ["eos", "length"])
def test_tito_ids_equal_the_renderers_bridge(family, stop):
    """A tool loop through LinearTrajectory: every appended prompt == the renderer's bridged ids (the model stopping
    on `<|eot_id|>`, or cut by length and closed with it). One divergence, left out: after `<|end_of_text|>` the
    renderer keeps it, where we write the template's `<|eot_id|>` in its place (as for Qwen3's `<|endoftext|>`)."""
    oracle = renderers.create_renderer(family.tokenizer, Llama3RendererConfig())
    traj = LinearTrajectory(family)
    history: list[dict[str, Any]] = [CONVERSATION[0], CONVERSATION[1]]
    replies = [Reply("", None, (("lookup", '{"key": "a", "n": 1}'),), stop=stop),
               Reply("", None, (("add", '{"a": 1, "b": 2}'),), stop=stop), Reply("Done: 3.", None, stop=stop)]
    appended_after = [[{"role": "tool", "tool_call_id": "call_r0_0", "content": "1"}],
                      [{"role": "tool", "tool_call_id": "call_r1_0", "content": "3"},
                       {"role": "system", "content": "Be terse."}, {"role": "user", "content": "sum?"}]]
    previous = None
    for k, reply in enumerate(replies):
        plan = traj.prepare(history, TOOLS)
        if previous is not None:
            bridged = oracle.bridge_to_next_turn(*previous, appended_after[k - 1], tools=TOOLS)
            assert bridged is not None and plan.prompt_ids.tolist() == bridged.token_ids, k
        result, message = generate(family, plan, reply, rid=f"r{k}")
        traj.commit(plan, result, message)
        previous = (plan.prompt_ids.tolist(), result.output_ids.tolist())
        history = [*history, message, *(appended_after[k] if k < len(appended_after) else [])]


# -- SGLang's own parser --------------------------------------------------------------------------------------------
_llama3 = import_sglang_schema("sglang.srt.function_call.llama32_detector")
_protocol = import_sglang_schema("sglang.srt.entrypoints.openai.protocol")

_PROSE = st.lists(WORD | st.sampled_from(["name", "parameters", "{", "}", ";", "\"", " ", "\n"]), min_size=1,
                  max_size=8).map("".join).filter(lambda s: s.strip() == s and s and not s.startswith("{"))
_ARGS = st.dictionaries(ARGUMENT_NAME, NESTED_JSON, min_size=1, max_size=4)
_CALLS = st.lists(st.tuples(CALL_NAME, _ARGS), max_size=3)


@SETTINGS
@given(content=st.none() | _PROSE, calls=_CALLS)
def test_parse_equals_sglangs_llama3_detector(family, content, calls):
    """Replies as the model writes them. Known divergences, outside this domain: SGLang drops a reply's leading JSON
    that is not a call (a JSON answer) and a malformed call after `<|python_tag|>`, where we keep the text; it reads
    a call with empty `parameters` from `arguments`; it drops calls to tools the request did not declare."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name, _ in calls]
    text = family.format_completion(content or "", None, [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls])
    ours = family.parse_reply(text, True, tools)
    detector = _llama3.Llama32Detector()
    if detector.has_tool_call(text):
        parsed = detector.detect_and_parse(text, [_protocol.Tool(**tool) for tool in tools])
        sglang = (parsed.normal_text, [(c.name, c.parameters) for c in parsed.calls])
    else:
        sglang = (text, [])
    assert (ours.content, [(c.name, c.arguments) for c in ours.tool_calls]) == sglang
