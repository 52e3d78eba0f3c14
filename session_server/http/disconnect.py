"""Being told that a request's client went away, without a task per request.

uvicorn reports a vanished client only to whoever awaits `receive()`, so noticing it mid-turn took a watcher task
per turn. Our own protocol (limits.py) sees `connection_lost` itself and offers the hook in the request's scope, as
an ASGI extension: `disconnects(scope, receive)` hands it out, and a turn registers a callback there -- no task, no
future. Under any other server or protocol (Starlette's TestClient, httpx's ASGITransport, plain uvicorn) the same
call falls back to a task that awaits `receive()` until it says `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import Any

EXTENSION = "session_server.disconnect"  # scope["extensions"][EXTENSION][WATCH] is the hook
WATCH = "watch"

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Unsubscribe = Callable[[], object]
# Register a callback run (soon, on the loop) once the client is gone; the result stops watching.
Disconnects = Callable[[Callable[[], None]], Unsubscribe]

_NONE: dict[str, Any] = {}


def disconnects(scope: MutableMapping[str, Any], receive: Receive) -> Disconnects:
    """How to watch this request's client: the server's own hook where it offers one, else a `receive()` watcher."""
    extension = (scope.get("extensions") or _NONE).get(EXTENSION)
    hook: Disconnects | None = extension.get(WATCH) if extension else None
    return hook if hook is not None else partial(_watch_receive, receive)


def _watch_receive(receive: Receive, callback: Callable[[], None]) -> Unsubscribe:
    def on_done(task: asyncio.Future[None]) -> None:
        if not task.cancelled():
            task.exception()  # a receive() that failed means the connection is gone as well
            callback()

    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(on_done)
    return watcher.cancel


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
