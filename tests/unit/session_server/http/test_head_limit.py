"""The head-size limit of our protocol: a request is refused with 431 exactly when its URL, header names and values
(4 bytes of separators each) exceed the limit, however its bytes are split into reads. A real uvicorn server over
loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from session_server.http.limits import limited_httptools
from support.uvicorn_server import serving

LIMIT = 1024
URL = "/x"


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _request(size: int, body: bytes) -> bytes:
    """A POST whose head counts exactly `size` bytes by the limit's rule."""
    fixed = [("host", "t"), ("content-length", str(len(body)))]
    used = len(URL) + sum(len(n) + len(v) + 4 for n, v in fixed) + len("x-pad") + 4
    head = f"POST {URL} HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fixed)
    return (head + f"x-pad: {'p' * (size - used)}\r\n\r\n").encode() + body


async def _status(port: int, data: bytes, splits: list[int]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        start = 0
        for end in [*splits, len(data)]:
            writer.write(data[start:end])
            await writer.drain()
            start = end
            await asyncio.sleep(0.01)  # give each piece its own read (merely likelier: the verdict must not depend)
        line = await reader.readline()
        return int(line.split()[1])
    finally:
        writer.close()


@pytest.mark.parametrize("body", [b"", b"b" * (2 * LIMIT)], ids=["no body", "body past the limit in the read"])
@pytest.mark.parametrize("split", ["one read", "two reads"])
def test_the_verdict_is_the_exact_head_size(body: bytes, split: str) -> None:
    async def main() -> None:
        async with serving(_app, limited_httptools(LIMIT)) as port:
            for size, status in [(LIMIT - 100, 200), (LIMIT, 200), (LIMIT + 1, 431)]:
                data = _request(size, body)
                splits = [len(data) // 3] if split == "two reads" else []
                assert await _status(port, data, splits) == status, (size, split)

    asyncio.run(main())
