"""A chat body read by what is new in it (session_server/chat/chat_body.py) reads exactly what the plain decode reads.

The oracle is `decode_object(body, unchecked="tools")`, the plain path every body took before: for any body, either
both refuse it with the same message, or both read the same object (the resent messages, recognised by their bytes,
are the ones the session read from those bytes before). Malicious parts -- integers beyond 64 bits, nesting past the
limit, invalid UTF-8 -- placed in the new messages, in the other fields, in the tools or in bytes that only look
like the resent history get exactly the plain path's 400.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from session_server.chat.chat_body import read_chat_body
from session_server.http.body import MAX_DEPTH, decode_object
from support.examples import examples
from trajectory.errors import RequestValidationError
from trajectory.linear import SentHistory

STYLES = [
    {},  # json.dumps' defaults: ", " and ": ", ASCII escapes (the OpenAI SDK through httpx)
    {"separators": (",", ":"), "ensure_ascii": False},
    {"indent": 2},
]


def read_plain(body: bytes) -> tuple[str, Any]:
    try:
        return "ok", decode_object(body, unchecked="tools")
    except RequestValidationError as err:
        return "error", err.message


def read_fast(body: bytes, sent: SentHistory | None) -> tuple[str, Any]:
    try:
        return "ok", read_chat_body(body, sent).obj
    except RequestValidationError as err:
        return "error", err.message


def sent_of(messages: list[Any], style: dict[str, Any]) -> SentHistory:
    """What a session keeps after a turn with these messages: the array's bytes in the body that carried them and
    what they were read as (a history the body's limits refuse is never kept)."""
    try:
        read = read_chat_body(json.dumps({"messages": messages, "model": "m"}, **style).encode(), None)
        obj, data = read.obj, read.messages_json
    except RequestValidationError:
        assume(False)
    assert data is not None and obj["messages"] == messages
    sent = SentHistory.of(data, msgspec.json.decode(data))
    assert sent is not None
    return sent


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=4), inner, max_size=3), max_leaves=8)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"]), "content": st.text(max_size=12)},
    optional={"name": st.text(max_size=4), "extra": json_value})


@settings(max_examples=examples(300), deadline=None)
@given(before=st.lists(message, min_size=1, max_size=4), new=st.lists(message, max_size=3),
       fields=st.dictionaries(st.sampled_from(["model", "max_tokens", "temperature", "x"]), json_value, max_size=3),
       style=st.sampled_from(STYLES), tools=st.none() | st.lists(json_value, max_size=2))
def test_a_resent_history_reads_as_the_plain_decode(
    before: list[Any], new: list[Any], fields: dict[str, Any], style: dict[str, Any], tools: Any,
) -> None:
    """Whatever the new messages and other fields hold (big integers included), the result or the refusal is the
    plain decode's; the resent messages come back as the objects read before."""
    sent = sent_of(before, style)
    body = {"messages": [*before, *new], **fields} | ({} if tools is None else {"tools": tools})
    data = json.dumps(body, **style).encode()
    kind, plain = read_plain(data)
    assert read_fast(data, sent) == (kind, plain)
    if kind == "ok":
        read = read_chat_body(data, sent)
        obj, messages_json = read.obj, read.messages_json
        assert all(a is b for a, b in zip(obj["messages"], sent.messages, strict=False))
        assert messages_json is not None and msgspec.json.decode(messages_json) == [*before, *new]


@settings(max_examples=examples(300), deadline=None)
@given(before=st.lists(message, min_size=1, max_size=3), new=st.lists(message, max_size=2),
       style=st.sampled_from(STYLES), edits=st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=3)),
                                                     min_size=1, max_size=3))
def test_a_mangled_body_is_refused_or_read_as_the_plain_decode(
    before: list[Any], new: list[Any], style: dict[str, Any], edits: list[tuple[int, bytes]],
) -> None:
    """Bytes spliced in anywhere -- inside the resent history, at its end, into a string (invalid UTF-8) -- never
    make the two paths disagree: the resent part is trusted only where it is byte for byte what was read before."""
    sent = sent_of(before, style)
    data = bytearray(json.dumps({"messages": [*before, *new], "model": "m"}, **style).encode())
    for at, insert in edits:
        at %= len(data) + 1
        data[at:at] = insert
    assert read_fast(bytes(data), sent) == read_plain(bytes(data))


BIG = 2**64


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("hidden", [
    pytest.param({"role": "user", "content": "x", "n": BIG}, id="big-int"),
    pytest.param({"role": "user", "content": "x", "n": deep(MAX_DEPTH)}, id="too-deep"),
    pytest.param({"role": "user", "content": "x", "n": deep(MAX_DEPTH - 4)}, id="deep-but-allowed"),
])
def test_a_new_message_is_held_to_the_body_limits(style: dict[str, Any], hidden: dict[str, Any]) -> None:
    before = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    sent = sent_of(before, style)
    data = json.dumps({"messages": [*before, hidden]}, **style).encode()
    plain = read_plain(data)
    assert read_fast(data, sent) == plain
    if "n" in hidden and hidden["n"] == BIG:
        assert plain[0] == "error" and "beyond 64 bits at 'messages'[2]['n']" in plain[1]


def test_bytes_that_only_look_like_the_history_are_read() -> None:
    """An array whose first element extends the old one's last (a longer number, more text), or a body whose old
    part is followed by something other than a new element, is decoded in full."""
    sent = sent_of([{"role": "user", "content": "a", "n": 1}], STYLES[1])
    for messages in (b'[{"role":"user","content":"a","n":12}]', b'[{"role":"user","content":"a","n":1}x]',
                     b'[{"role":"user","content":"a","n":1},]', b'[{"role":"user","content":"a","n":1}, \xff]'):
        data = b'{"messages":' + messages + b"}"
        assert read_fast(data, sent) == read_plain(data)
    invalid_utf8 = b'{"messages":[{"role":"user","content":"a","n":1},{"role":"user","content":"\xff"}]}'
    kind, message = read_fast(invalid_utf8, sent)
    assert kind == "error" and "not valid UTF-8" in message and (kind, message) == read_plain(invalid_utf8)


def test_a_retry_of_the_same_messages_reads_the_objects_kept() -> None:
    before = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    sent = sent_of(before, STYLES[0])
    read = read_chat_body(json.dumps({"messages": before, "model": "n"}).encode(), sent)
    obj, messages_json = read.obj, read.messages_json
    assert obj["messages"] == sent.messages and all(a is b for a, b in zip(obj["messages"], sent.messages, strict=True))
    assert messages_json is not None and sent.begins(messages_json) and len(messages_json) == sent.end + 1


def test_tools_are_decoded_once_per_distinct_list() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    data = json.dumps(tools).encode()
    first = read_chat_body(b'{"messages": [], "tools": ' + data + b"}", None)
    again = read_chat_body(b'{"messages": [], "tools": ' + data + b', "model": "m"}', None)
    assert first.obj["tools"] == tools and again.obj["tools"] is first.obj["tools"]
    assert first.tools_json == again.tools_json == data


@pytest.mark.parametrize("body", [b"", b"[]", b"{", b'{"messages": [1,]}', b'{"a": 1, "a": 99999999999999999999999}',
                                  b'{"messages": "x", "messages": [{"role": "user", "content": "\xff"}]}'])
def test_what_is_no_chat_object_is_the_plain_refusal(body: bytes) -> None:
    sent = sent_of([{"role": "user", "content": "x"}], STYLES[0])
    assert read_fast(body, sent) == read_plain(body) and read_plain(body)[0] == "error"


def test_duplicate_keys_read_as_the_plain_decode() -> None:
    sent = sent_of([{"role": "user", "content": "x"}], STYLES[0])
    data = b'{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], "model": "a", ' \
           b'"messages": [{"role": "user", "content": "z"}]}'
    assert read_fast(data, sent) == read_plain(data)
