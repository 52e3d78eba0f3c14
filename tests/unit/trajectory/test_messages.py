"""Message normalisation and the matcher policies (JSON-equivalent arguments, rollback reasons)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from trajectory import MessageMatcher, normalize_messages, normalize_tools
from trajectory.errors import RequestValidationError
from trajectory.messages import ROLLBACK_REASONS


def test_normalisation_canonicalises_equivalent_shapes():
    messages = normalize_messages([
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "hi", "name": "bob", "extra": 1},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": {"ü": [1]}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c0"},
        {"role": "assistant", "content": "done", "reasoning_content": "why", "tool_calls": []},
    ])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"ü": [1]}'}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c0"},
        {"role": "assistant", "content": "done", "reasoning_content": "why"},
    ]


def test_normalisation_is_idempotent_and_match_reuses_stored_messages():
    raw = [{"role": "system", "content": [{"type": "text", "text": "s"}]}, {"role": "user", "content": "q"},
           {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
               {"index": 0, "id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]},
           {"role": "tool", "content": "4", "tool_call_id": "c"}]
    stored = normalize_messages(raw)
    assert normalize_messages(stored) == stored
    request = [*stored[:2], {**raw[2], "reasoning_content": None}, {"role": "user", "content": "new"}]
    messages, matched = MessageMatcher("strict").match(stored, request)
    assert matched == 3 and all(a is b for a, b in zip(messages[:3], stored, strict=False))
    assert messages[3] == {"role": "user", "content": "new"}
    messages, matched = MessageMatcher("strict").match(stored, [stored[0], {"role": "user", "content": "other"}])
    assert matched == 1 and messages[1]["content"] == "other"
    with pytest.raises(RequestValidationError, match=r"messages\[2\] has no role"):
        MessageMatcher("strict").match(stored, [*stored[:2], {"content": "x"}])


@pytest.mark.parametrize(("messages", "match"), [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\] has no role"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}], r"messages\[1\] has unknown role 'robot'"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no content"),
    ([{"role": "tool", "tool_call_id": "c"}], r"messages\[0\] \(tool\) has no content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"content\[0\]: only text parts"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": ""}}]}], r"name must be a non-empty"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     "arguments must be a JSON string"),
    ([{"role": "assistant", "content": "", "tool_calls": "f"}], "tool_calls must be a list"),
    ([{"role": "assistant", "content": "", "reasoning_content": 1}], "reasoning_content must be a string"),
    ([{"role": "tool", "content": "x", "tool_call_id": 5}], "tool_call_id must be a string"),
])
def test_bad_messages_are_400_naming_the_message(messages, match):
    with pytest.raises(RequestValidationError, match=match) as info:
        normalize_messages(messages)
    assert info.value.status == 400


def test_tools_normalisation():
    assert normalize_tools(None) is None and normalize_tools([]) is None
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert normalize_tools(tools) == tools
    for bad in ("f", [{"type": "function"}], [{"function": {"name": 1}}]):
        with pytest.raises(RequestValidationError):
            normalize_tools(bad)


def _assistant(**fields):
    return normalize_messages([{"role": "assistant", **fields}])[0]


def test_strict_matcher():
    m = MessageMatcher("strict")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    stored = _assistant(content="x", reasoning_content="r", tool_calls=[call])
    assert m.equal(stored, _assistant(content="x", tool_calls=[{**call, "index": 0}]))  # reasoning not echoed
    assert m.equal(stored, _assistant(content="x", reasoning_content="r", tool_calls=[call]))
    assert not m.equal(stored, _assistant(content="x", reasoning_content="other", tool_calls=[call]))
    assert not m.equal(stored, _assistant(content="y", tool_calls=[call]))
    assert not m.equal(stored, _assistant(content="x", tool_calls=[{**call, "id": "d"}]))
    assert not m.equal(stored, _assistant(content="x", tool_calls=[]))
    assert not m.equal(stored, _assistant(content="x", tool_calls=[
        {**call, "function": {"name": "f", "arguments": '{"a":1}'}}]))
    assert m.equal(_assistant(content=None), _assistant(content=""))
    assert m.match([stored, stored], [stored, _assistant(content="z")])[1] == 1


def test_loose_matcher_compares_arguments_as_json():
    m = MessageMatcher("loose_tool_call")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}
    stored = _assistant(content="", tool_calls=[call])
    assert m.equal(stored, _assistant(tool_calls=[{**call, "function": {"name": "f", "arguments": '{"b":[2],"a":1}'}}]))
    assert not m.equal(stored, _assistant(tool_calls=[{**call, "function": {"name": "f", "arguments": '{"a": 2}'}}]))
    assert not m.equal(stored, _assistant(tool_calls=[{**call, "function": {"name": "f", "arguments": "{bad"}}]))
    assert MessageMatcher().mode == "loose_tool_call"  # JSON-equivalent arguments are equal by default


def _args(text: str) -> dict:
    return _assistant(tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}])


@pytest.mark.parametrize(("a", "b", "equal"), [
    ('{"key": "x"}', '{"key":"x"}', True),  # pydantic-ai compacts
    ('{"a": 1, "b": {"c": [1, 2]}}', '{"b": {"c": [1, 2]}, "a": 1}', True),  # reordered, nested
    ('{"a": 1}', '{"a": 1.0}', True),  # numbers by value
    ('{"a": true}', '{"a": 1}', False),  # but a boolean is not a number
    ('{"a": false}', '{"a": 0}', False),
    ('{"a": null}', '{"a": 0}', False),
    ('{"a": [1, 2]}', '{"a": [2, 1]}', False),  # list order matters
    ('{"a": "1"}', '{"a": 1}', False),
    ('{"a": 1}', '{"a": 1, "b": 2}', False),
    ("not json", "not json", True),  # malformed arguments: only the same text is equal
    ("not json", "not  json", False),
])
def test_json_equivalent_arguments(a, b, equal):
    assert MessageMatcher().equal(_args(a), _args(b)) is equal
    assert MessageMatcher().equal(_args(b), _args(a)) is equal


def test_rollback_reasons():
    m = MessageMatcher()
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    stored = [{"role": "user", "content": "q"}, _assistant(content="x", reasoning_content="r", tool_calls=[call])]
    cases = [
        ([{"role": "user", "content": "other"}], "content"),
        ([{"role": "system", "content": "q"}], "role"),
        ([stored[0], _assistant(content="x", reasoning_content="s", tool_calls=[call])], "reasoning_content"),
        ([stored[0], _assistant(content="x")], "tool_calls"),
        ([stored[0], _assistant(content="x", tool_calls=[{**call, "id": "d"}])], "tool_call_id"),
        ([stored[0], _assistant(content="x", tool_calls=[
            {**call, "function": {"name": "f", "arguments": '{"a": 2}'}}])], "tool_call_arguments"),
        ([stored[0]], "retry"),
        ([*stored, {"role": "user", "content": "next"}], None),
    ]
    for request, reason in cases:
        assert m.match_detail(stored, request)[2] == reason, request
    assert set(ROLLBACK_REASONS) >= {r for _, r in cases if r}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _reordered(value):
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


@settings(max_examples=examples(200), deadline=None)
@given(args=st.dictionaries(st.text(max_size=6), _JSON, max_size=5), indent=st.sampled_from([None, 2]))
def test_any_reserialisation_of_the_arguments_matches(args, indent):
    """Whatever an agent does to the arguments' text -- compact, indent, reorder keys, escape non-ASCII -- the echo
    repeats the stored message by default (and only the identical text does under `strict`)."""
    stored_text = json.dumps(args, ensure_ascii=False)
    echoed_text = json.dumps(_reordered(args), separators=(",", ":") if indent is None else None, indent=indent)
    assert MessageMatcher().equal(_args(stored_text), _args(echoed_text))
    assert MessageMatcher("strict").equal(_args(stored_text), _args(echoed_text)) is (stored_text == echoed_text)
