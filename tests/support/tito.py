"""Test support for the trajectory tests: an in-process stand-in for the engine and hypothesis strategies.

The "engine" generates exactly what the real emulated engine does: the family's formatted completion,
tokenized, plus a stop token, wrapped in a native `/generate` body that goes through the real strict
decoder. Strategies keep generated text free of template markers, since a model that writes
`<tool_call>` inside its prose is a different test (see the malformed-call examples).
"""

from __future__ import annotations

import functools
import json
import operator
import string
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from trajectory import GenerateResult, ModelFamily, TurnPlan, decode_generate_response

STOPS = ("eos", "alt", "length")


def engine_body(ids: list[int], logprobs: list[float] | None = None, *, finish: dict[str, Any] | None = None,
                prompt_tokens: int = 0, text: str = "", rid: str = "rid-0", **meta: Any) -> dict[str, Any]:
    """A well-formed native /generate response body (a dict, to be corrupted or serialised by the test)."""
    logprobs = [-0.25] * len(ids) if logprobs is None else logprobs
    return {
        "text": text,
        "output_ids": list(ids),
        "meta_info": {
            "id": rid,
            "finish_reason": finish or {"type": "stop", "matched": ids[-1] if ids else None},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
            "weight_version": "w0",
            "e2e_latency": 0.01,
            **meta,
        },
    }


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None = None
    tool_calls: tuple[tuple[str, str], ...] = ()
    stop: str = "eos"  # "eos": template stop token, "alt": another stop token, "length": no stop token
    cut: int | None = None  # with stop == "length": keep only this many tokens (mid-word, mid-character)


def generate(family: ModelFamily, plan: TurnPlan, reply: Reply, rid: str) -> tuple[GenerateResult, dict[str, Any]]:
    """Simulate one engine call for `plan` and return the validated result and the reply message.

    A prompt that opened the reply (Qwen3.5's `<think>\n`) is continued as the emulated engine continues it: the
    reasoning block is closed, empty if the reply has none, and the opener is not generated again."""
    opened = family.opened_reply(plan.prompt_ids)
    reasoning = "" if opened and reply.reasoning is None else reply.reasoning
    text = family.format_completion(reply.content, reasoning, list(reply.tool_calls)).removeprefix(opened)
    ids = family.encode(text)
    if reply.stop == "length" and reply.cut is not None:
        ids = ids[: reply.cut]
        text = family.completion_text(ids)
    if reply.stop == "eos":
        stop = family.stop_token_after(text)
        ids.append(stop)
        finish: dict[str, Any] = {"type": "stop", "matched": stop}
    elif reply.stop == "alt":
        ids.append(family.stop_token_ids[-1])
        finish = {"type": "stop", "matched": family.stop_token_ids[-1]}
    else:
        finish = {"type": "length", "length": len(ids)}
    logprobs = [-(i % 7) / 8 - 0.01 for i in range(len(ids))]
    body = engine_body(ids, logprobs, finish=finish, prompt_tokens=len(plan.prompt_ids), text=text, rid=rid)
    result = decode_generate_response(json.dumps(body).encode(), family.vocab_size)
    return result, family.parse_completion(opened + text).to_message(f"call_{rid}")


# -- strategies ---------------------------------------------------------------------------------------------
_ALPHABET = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="<>|｜`\\")
# The same without the quote, excluded by the character strategy itself: text over a filtered one is drawn a character
# at a time (3x the cost), and the names below are drawn without from_regex (1.8 ms an example, these 0.1-0.4 ms).
_KEY_ALPHABET = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="<>|｜`\\\"")
_LOWER, _DIGITS = string.ascii_lowercase, string.digits


def identifiers(first: str, rest: str, max_rest: int) -> st.SearchStrategy[str]:
    """Names of one character of `first`, then up to `max_rest` of `rest` (the regex `[first][rest]{0,max_rest}`)."""
    return st.builds(operator.add, st.sampled_from(first), st.text(rest, max_size=max_rest))


# Starts with a letter: the generated text follows the assistant header's "\n", and leading whitespace
# would let the canonical tokenization merge across that boundary (a tokenizer property, not TITO's).
TEXT = st.builds(lambda head, tail: head + tail, st.sampled_from("AbcXyzé東"), st.text(_ALPHABET, max_size=24))
MESSAGE_TEXT = st.text(_ALPHABET, min_size=1, max_size=30).filter(lambda s: s.strip() == s)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(_ALPHABET, max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(_ALPHABET, max_size=6), inner, max_size=3),
    max_leaves=6,
)
# Argument names as tools declare them: not empty, no quote (DSML writes `name="..."`, XML `<parameter=...>`).
ARGUMENTS = st.dictionaries(st.text(_KEY_ALPHABET, min_size=1, max_size=8), JSON_VALUE,
                            max_size=3).map(
    lambda obj: json.dumps(obj, ensure_ascii=False)
)
TOOL_NAME = identifiers(_LOWER, _LOWER + _DIGITS + "_", 11)  # [a-z][a-z0-9_]{0,11}
# Replies for the differential tests against SGLang's JSON-call detectors: words, scalars and nested JSON values.
WORD = st.text(_ALPHABET, min_size=1, max_size=10)
SCALAR = (st.integers(-10**9, 10**9) | st.floats(allow_nan=False, allow_infinity=False) | st.booleans()
          | st.text(_ALPHABET, max_size=12))
NESTED_JSON = st.recursive(st.none() | SCALAR, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(WORD, inner, max_size=3), max_leaves=8)
ARGUMENT_NAME = identifiers(_LOWER + "_", _LOWER + _DIGITS + "_", 8)  # [a-z_][a-z0-9_]{0,8}
CALL_NAME = identifiers(_LOWER, _LOWER + _DIGITS + "_", 8)  # [a-z][a-z0-9_]{0,8}


def replies(family: ModelFamily, reasoning: bool) -> st.SearchStrategy[Reply]:
    """Replies the model may generate; `reasoning` also enables reasoning and cuts at arbitrary tokens,
    which are not append-stable under the template (so the canonical-render property excludes them)."""
    return _replies(bool(family.max_trim_tokens), reasoning)


@functools.cache
def _replies(alternative_stops: bool, reasoning: bool) -> st.SearchStrategy[Reply]:
    """One strategy object per kind of reply, drawn from again and again (`conversations` draws one per turn): a new
    object per draw is validated and its properties computed again by hypothesis, as costly as the draw itself."""
    stops = STOPS if alternative_stops else ("eos", "length")
    return st.builds(
        Reply,
        content=TEXT | st.just(""),
        reasoning=(st.none() | TEXT) if reasoning else st.none(),
        tool_calls=st.lists(st.tuples(TOOL_NAME, ARGUMENTS), max_size=3).map(tuple),
        stop=st.sampled_from(stops),
        cut=(st.none() | st.integers(0, 40)) if reasoning else st.none(),
    )


@dataclass
class Turn:
    """Messages the agent appends before a generation, then the model's reply."""

    appended: list[dict[str, Any]]
    reply: Reply


TOOLS = st.none() | st.lists(TOOL_NAME, min_size=1, max_size=2, unique=True).map(
    lambda names: [{"type": "function", "function": {"name": n, "description": "d", "parameters": {"type": "object"}}}
                   for n in names])


@st.composite
def conversations(draw: st.DrawFn, family: ModelFamily, reasoning: bool, max_turns: int = 4) -> tuple[Any, list[Turn]]:
    """(tools, turns): a random multi-turn agent episode valid for `family`."""
    tools = draw(TOOLS)
    turns: list[Turn] = []
    n_turns = draw(st.integers(1, max_turns))
    previous: Reply | None = None
    for k in range(n_turns):
        appended: list[dict[str, Any]] = []
        if k == 0 and draw(st.booleans()):
            appended.append({"role": "system", "content": draw(MESSAGE_TEXT)})
        if previous is not None and previous.tool_calls:
            for i, _ in enumerate(previous.tool_calls):
                appended.append({"role": "tool", "content": draw(MESSAGE_TEXT), "tool_call_id": f"call_r{k - 1}_{i}"})
        if previous is not None and "system" in family.appendable_roles and draw(st.integers(0, 4)) == 0:
            appended.append({"role": "system", "content": draw(MESSAGE_TEXT)})
        if not appended or appended[-1]["role"] != "tool" or draw(st.booleans()):
            appended.append({"role": "user", "content": draw(MESSAGE_TEXT)})
        previous = draw(replies(family, reasoning))
        turns.append(Turn(appended=appended, reply=previous))
    return tools, turns


def call_item(i: int, name: str, arguments: dict[str, Any], ensure_ascii: bool = True) -> dict[str, Any]:
    """An OpenAI `tool_calls` item with id `c{i}`, its arguments as JSON text."""
    return {"id": f"c{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=ensure_ascii)}}


# Message text as agents send it, with what a mirror of a template gets wrong first: newlines and spaces at either
# end, empty text, and the spellings the templates themselves write or test for.
_SPELLINGS = ("<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>", "<think>", "</think>", "\n", " ",
              "<｜User｜>", "<|eot_id|>", "<|end|>", "{{", "%}")
APPENDED_TEXT = st.lists(st.sampled_from(_SPELLINGS) | st.text(max_size=12), max_size=4).map("".join)


@st.composite
def appended_turns(draw: st.DrawFn, family: ModelFamily) -> list[dict[str, Any]]:
    """1-4 messages an agent appends after a generated turn, in any order of the family's appendable roles."""
    out: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        role = draw(st.sampled_from(sorted(family.appendable_roles)))
        message: dict[str, Any] = {"role": role, "content": draw(APPENDED_TEXT)}
        if role == "tool" and draw(st.booleans()):
            message["tool_call_id"] = "call_0"
        if role in ("user", "system") and draw(st.booleans()):
            message["name"] = "agent"
        out.append(message)
    return out
