"""A chat body read by what is new in it: the history and tools an agent resends, recognised by their bytes.

An agent resends its whole history and the same tools every turn. Decoding, checking (depth, 64-bit integers) and
matching all of it again makes a turn's cost grow with the history; here it follows what is new:

- the top level is split into its fields without decoding their values (`msgspec.Raw`);
- `messages`: when the array begins with exactly the elements of the array of the session's last committed turn
  (the trajectory's `SentHistory`: a digest of their bytes), those messages are the ones read then -- the stored
  objects, which the matcher recognises at once -- and only the elements after them are decoded and checked.
  Otherwise (a first turn, a client that re-serialises its history, a rollback) the whole array is, as before;
- `tools`: decoded once per distinct list of bytes (a bounded cache), and those bytes are the key of the list's
  verdict in frontend/fields.py (its depth, integers and schemas, checked once per distinct list), so an unchanged
  list is neither decoded nor encoded again;
- every other field is decoded, and all of them checked in one walk, as the plain decode checks them.

Nothing gets past the body's limits by hiding in a part left undecoded: every byte is either decoded and checked
here, or equal to bytes that were decoded and checked before in the same place (the elements of an earlier array of
messages, a tools list decoded before). msgspec's skipping of a raw value checks its syntax but not its UTF-8, which
is why no raw byte is ever trusted unseen. Any failure on this path reads the body again the plain way
(`decode_object`), so every error keeps its status and its message, word for word.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgspec

from session_server.frontend.fields import CACHED_TOOL_LIST_BYTES, TOOL_LIST_VERDICTS
from session_server.http.body import check_json_value, decode_object
from trajectory.errors import RequestValidationError
from trajectory.linear import SentHistory

_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode = msgspec.json.Decoder().decode
_WHITESPACE = b" \t\n\r"
FIELD_DEPTH = 2  # a top-level field's value stands at this nesting level of the body (the body itself is 1)


@dataclass(slots=True)
class ChatBody:
    obj: dict[str, Any]  # the body as `decode_object(body, unchecked="tools")` reads it
    messages_json: bytes | None = None  # its messages array's bytes, for the trajectory to keep (`SentHistory`)
    tools_json: bytes | None = None  # its tools list's bytes: the key of the list's verdict (fields.check_tool_choice)


def read_chat_body(body: bytes, sent: SentHistory | None) -> ChatBody:
    """The body read by what is new in it; on the plain path (any failure here) without the bytes of its parts."""
    try:
        return _read(body, sent)
    except (ValueError, RecursionError, RequestValidationError):  # msgspec's errors are ValueErrors
        return ChatBody(decode_object(body, unchecked="tools"))


def _read(body: bytes, sent: SentHistory | None) -> ChatBody:
    out = ChatBody({})
    obj = out.obj
    rest: dict[str, Any] = {}  # every other field, checked in one walk: its values stand where they stand in the body
    for key, raw in _fields(body).items():
        if key == "messages":
            obj[key], out.messages_json = _messages(bytes(raw), sent)
        elif key == "tools":
            out.tools_json = data = bytes(raw)
            obj[key] = _tools(data)
        else:
            rest[key] = _decode(raw)
    check_json_value(rest, depth=FIELD_DEPTH - 1)
    obj.update(rest)
    return out


def _messages(data: bytes, sent: SentHistory | None) -> tuple[Any, bytes | None]:
    tail = None if sent is None else _tail(data, sent)
    if tail is not None:
        new = _decode(tail)
        check_json_value(new, depth=FIELD_DEPTH)
        return [*sent.messages, *new], data  # type: ignore[union-attr]  # tail is None when sent is
    value = _decode(data)
    check_json_value(value, depth=FIELD_DEPTH)
    return value, data if type(value) is list else None


def _tail(data: bytes, sent: SentHistory) -> bytes | None:
    """The elements of the JSON array `data` after those of the array `sent` was read from, as an array of their own,
    when `data` begins with exactly those elements' bytes; else None.

    Both arrays passed msgspec's syntax check, and a JSON value ends where its own syntax says (an element of the
    earlier array is followed by `]` there and by `,` or `]` here), so the earlier elements are elements of `data`."""
    if not sent.begins(data):
        return None
    i = sent.end
    while i < len(data) and data[i] in _WHITESPACE:
        i += 1
    if i == len(data) - 1 and data[i] == ord("]"):
        return b"[]"  # the same messages and no more (a retry of the last turn)
    if i < len(data) and data[i] == ord(",") and data[i + 1:].strip(_WHITESPACE) != b"]":
        return b"[" + data[i + 1:]
    return None


# A list of tools, decoded once per distinct bytes: an agent sends the same tools every turn. Bounded like the
# verdicts on the lists (fields.py): at most TOOL_LIST_VERDICTS lists of at most CACHED_TOOL_LIST_BYTES each; a
# larger list is decoded every time. Callers treat the shared list as read-only, as every decoded request value.
_cached_tools = functools.lru_cache(maxsize=TOOL_LIST_VERDICTS)(_decode)


def _tools(data: bytes) -> Any:
    return (_cached_tools if len(data) <= CACHED_TOOL_LIST_BYTES else _decode)(data)
