"""A chat's engine call raced against everything that may end it first: the client going away, an abort of its claim
(DELETE, expiry, pause, shutdown) and the request deadline. Plain and streamed chats share it.

Why the client is watched at all: without it the engine would keep generating (and holding KV) for nobody. Why one
future settled by callbacks rather than `asyncio.wait` over a waiter task per event: the race runs on every turn,
and none of the three needs a task of its own -- a callback on the connection (http/disconnect.py: our protocol sees
the loss itself; other servers get a `receive()` watcher there), a callback on the claim, a timer on the loop.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

from session_server.http.disconnect import Disconnects
from session_server.sessions.session import Claim


class Ending(enum.Enum):
    FINISHED = "finished"  # the work finished first (result or exception: the caller reads it)
    DISCONNECTED = "disconnected"  # the client went away
    ABORTED = "aborted"  # the claim was aborted (claim.reason says why)
    TIMED_OUT = "timed_out"  # the deadline passed


async def race(work: asyncio.Future[Any], client: Disconnects | None, claim: Claim, deadline: float) -> Ending:
    """How `work` ended, or what ended first; `work` itself is neither awaited nor cancelled here (the caller decides
    what happens to an engine request that lost: it is aborted by rid, see engine/drains.py). `client`: how to watch
    the client (`http.disconnect.disconnects`); None: it is not watched (its disconnect shows up in `work` itself,
    e.g. while reading the body)."""
    loop = asyncio.get_running_loop()
    ending: asyncio.Future[Ending] = loop.create_future()

    def end(how: Ending) -> None:
        if not ending.done():
            ending.set_result(how)

    def on_work(_: asyncio.Future[Any]) -> None:
        end(Ending.FINISHED)

    def on_disconnect() -> None:
        end(Ending.DISCONNECTED)

    if work.done():  # finished before the race began: nothing else can have ended it first
        end(Ending.FINISHED)
    work.add_done_callback(on_work)
    unwatch = client(on_disconnect) if client is not None else None
    unsubscribe = claim.on_abort(lambda: end(Ending.ABORTED))
    timer = loop.call_later(max(0.0, deadline), end, Ending.TIMED_OUT)
    try:
        return await ending
    finally:
        work.remove_done_callback(on_work)
        timer.cancel()
        unsubscribe()
        if unwatch is not None:
            unwatch()
