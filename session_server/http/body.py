"""Request bodies: the one reader and the one JSON-object decoder every route uses.

Every way a body can be hostile ends here as a clear 4xx, never as a 500 from deep inside a handler:

- size: a Content-Length above the limit is refused before a byte is read (413), and a chunked body is counted as it
  arrives, so nothing larger than the limit is ever buffered (413);
- time: the whole body must arrive within the upload deadline (408 Request Timeout: the client was too slow, the
  request itself may be fine; RFC 9110 15.5.9), so a client that never finishes cannot hold a slot, a drain or a
  shutdown;
- bytes: invalid UTF-8 (0xFF, an encoded surrogate) is a 400, not a UnicodeDecodeError;
- shape: the top level is a JSON object; nesting is at most MAX_DEPTH levels (a 100k-deep array would otherwise
  raise RecursionError in the decoder, and a 1k-deep tool schema would do it later in the chat template); every
  integer fits in 64 bits (a bigger one passes Python's range checks and fails when the engine request is
  serialized).

Errors share one message style: `request body <what is wrong>`. `decode_object` is pure, so the chat route runs it on
the CPU pool along with the rest of its parsing; the small routes call `read_object`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request

from session_server.errors import ClientDisconnectedError, RequestTimeoutError, RequestTooLargeError
from trajectory.errors import RequestValidationError

MAX_DEPTH = 64  # JSON nesting levels; OpenAI's own structured-output schemas allow 10
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1  # uint64: the largest integer any field of the engine's wire format can carry

_decoder = msgspec.json.Decoder()


def _bad(what: str) -> RequestValidationError:
    return RequestValidationError(f"request body {what}")


def declared_length(request: Request) -> int | None:
    """Content-Length as an int; a malformed one never reaches us (the HTTP parser answers 400 itself)."""
    value = request.headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None


def check_declared_size(request: Request, limit: int) -> None:
    """413 from the headers alone, before anything is read."""
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise RequestTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")


async def _read(request: Request, limit: int) -> bytes:
    """The body's messages straight from `receive()`, as Starlette's `request.stream()` reads them, without an
    async generator per body; a body that came in one message is returned as it came, not copied by a join."""
    receive = request.receive
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.disconnect":
            raise ClientDisconnect
        if kind != "http.request":
            continue
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_body(request: Request, limit: int, deadline: float) -> bytes:
    """The raw body, at most `limit` bytes, fully received within `deadline` seconds.

    The deadline is a plain timer on the loop that cancels this task, what `asyncio.timeout` does at several times
    the cost (its context manager and rescheduling, on every request, where almost every body has already arrived).
    Only a cancellation of ours becomes the 408: one from anyone else (a claim's abort, shutdown) goes on."""
    check_declared_size(request, limit)
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = task.get_loop().call_later(deadline, expire)
    try:
        return await _read(request, limit)
    except asyncio.CancelledError:
        if expired and task.uncancel() <= cancelling:
            raise RequestTimeoutError(
                f"request body was not received within {deadline:g}s (upload deadline)"
            ) from None
        raise
    except ClientDisconnect:
        raise ClientDisconnectedError("client disconnected while sending the request") from None
    finally:
        timer.cancel()


def check_json_value(value: Any, where: str = "request body", depth: int = 1) -> None:
    """Depth and integer range of a decoded JSON value, iteratively (no recursion to exhaust).

    Runs on every request body, and an agent resends its whole history every turn, so the walk is kept tight: exact
    type tests (a decoded value holds only the builtin JSON types; bools are not ints here), only containers are
    pushed, and integers are checked where they are met. `depth`: the nesting level `value` stands at in its body
    (a part of a body checked on its own)."""
    if type(value) is int:
        _check_int(value, value, where)
        return
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is not dict and kind is not list:
            continue
        if depth > MAX_DEPTH:
            raise RequestValidationError(f"{where} nests deeper than {MAX_DEPTH} levels")
        for child in item.values() if kind is dict else item:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is int and not INT_MIN <= child <= INT_MAX:
                _check_int(child, value, where)


def _check_int(item: int, value: Any, where: str) -> None:
    if not INT_MIN <= item <= INT_MAX:
        raise RequestValidationError(
            f"{where} has an integer beyond 64 bits at {_path_of_big_int(value)}: "
            f"{str(item)[:24]}{'...' if len(str(item)) > 24 else ''}"
        )


def _path_of_big_int(value: Any) -> str:
    """Where the first out-of-range integer is, as `'max_tokens'` or `'messages'[0]['x']` (error path only)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, f"{path}[{k!r}]" if path else repr(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
        elif type(item) is int and not INT_MIN <= item <= INT_MAX:
            return path or "the top level"
    return "?"


def decode_json(body: bytes, where: str = "request body", unchecked: str | None = None) -> Any:
    """Any JSON value, checked like a body (depth, 64-bit integers); every failure is a 400.

    `unchecked`: a top-level key whose value is left for the caller to check (`check_json_value({key: value})`, the
    same verdict and message): the chat front end checks the tools list once per distinct list, not every turn."""
    try:
        value = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestValidationError(f"{where} is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise RequestValidationError(f"{where} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise RequestValidationError(f"{where} nests deeper than {MAX_DEPTH} levels") from None
    if unchecked is not None and type(value) is dict and unchecked in value:
        check_json_value({k: v for k, v in value.items() if k != unchecked}, where)
    else:
        check_json_value(value, where)
    return value


def decode_object(body: bytes, empty: dict[str, Any] | None = None, unchecked: str | None = None) -> dict[str, Any]:
    """The body as a JSON object. With `empty` given, a body of only whitespace means that object (routes whose
    body is optional); otherwise it is a 400 like any other non-object. `unchecked` as in `decode_json`."""
    if empty is not None and not body.strip():
        return empty
    value = decode_json(body, unchecked=unchecked)
    if not isinstance(value, dict):
        raise _bad(f"must be a JSON object, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array"


async def read_object(request: Request, limit: int, deadline: float, *, optional: bool = True) -> dict[str, Any]:
    """Read and decode a small route's body (POST /sessions, /samples, /admin/pause): an object, or {} when the
    body is empty and `optional`."""
    return decode_object(await read_body(request, limit, deadline), {} if optional else None)
