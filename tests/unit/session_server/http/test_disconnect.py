"""A handler learns that its client went away: from our protocol's own hook (no task), and under any other server
from a `receive()` watcher. Real uvicorn servers over loopback, real sockets closed by the client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from session_server.http.disconnect import EXTENSION, disconnects
from session_server.http.limits import limited_httptools
from support.uvicorn_server import serving

Scope = dict[str, Any]


async def _hang_up_after_headers(port: int, watching: asyncio.Event) -> None:
    """Send a whole request, wait until the handler watches the client, then close the connection."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello")
    await writer.drain()
    await watching.wait()
    writer.close()
    await writer.wait_closed()


@pytest.mark.parametrize("http", ["ours", "plain"])
def test_a_watcher_is_told_once_when_the_client_goes_away(http: str) -> None:
    """Ours: the scope carries the hook and the callbacks run without a task; plain uvicorn: the fallback watches
    `receive()`. Either way an unsubscribed callback is never run and the watched ones run once."""

    async def main() -> None:
        watching, told, late = asyncio.Event(), asyncio.Event(), asyncio.Event()
        calls: list[str] = []
        seen: dict[str, Any] = {}

        async def app(scope: Scope, receive: Any, send: Any) -> None:
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            seen["body"], seen["hooked"] = body, EXTENSION in scope.get("extensions", {})
            tasks_before = len(asyncio.all_tasks())
            watch = disconnects(scope, receive)
            watch(lambda: (calls.append("kept"), told.set()))
            stop = watch(lambda: calls.append("dropped"))
            seen["new_tasks"] = len(asyncio.all_tasks()) - tasks_before
            stop()
            watching.set()
            await told.wait()
            await asyncio.sleep(0)  # the dropped one, had it been kept, was due in the same pass
            watch(lambda: (calls.append("late"), late.set()))  # the client is gone already: told at once
            await late.wait()

        async with serving(app, limited_httptools(64 * 1024) if http == "ours" else "httptools") as port:
            await _hang_up_after_headers(port, watching)
            await asyncio.wait_for(late.wait(), 30)
        assert seen["body"] == b"hello"
        assert calls == ["kept", "late"]
        assert seen["hooked"] is (http == "ours")
        assert seen["new_tasks"] == (0 if http == "ours" else 2)  # a watcher task per watch in the fallback

    asyncio.run(main())
