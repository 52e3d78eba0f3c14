"""The one body reader over the ASGI messages as a server hands them out: chunks joined in order (a single one
returned as it came), empty and foreign messages skipped, the size counted as it arrives, a disconnect the
client-gone error. The deadline and the 4xx over real HTTP are in tests/e2e/test_attacks.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from session_server.errors import ClientDisconnectedError, RequestTooLargeError
from session_server.http.body import read_body


def _read(messages: list[dict[str, Any]], limit: int = 100) -> bytes:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    async def main() -> bytes:
        return await read_body(Request({"type": "http", "method": "POST", "headers": []}, receive), limit, 10.0)

    return asyncio.run(main())


def _msg(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


def test_chunks_are_joined_in_order_and_one_chunk_is_not_copied() -> None:
    assert _read([_msg(b"ab", True), _msg(b"", True), {"type": "http.other"}, _msg(b"cd", False)]) == b"abcd"
    one = b"x" * 50
    assert _read([_msg(one, False)]) is one
    assert _read([_msg(b"", False)]) == b""
    assert _read([{"type": "http.request"}]) == b""  # body and more_body are optional keys


def test_the_size_is_counted_as_it_arrives_and_a_disconnect_is_one() -> None:
    with pytest.raises(RequestTooLargeError, match="exceeds the limit of 100 bytes"):
        _read([_msg(b"x" * 60, True), _msg(b"x" * 60, True)])  # the rest never needs to arrive
    with pytest.raises(ClientDisconnectedError, match="while sending the request"):
        _read([_msg(b"x", True), {"type": "http.disconnect"}])
