"""A chat's engine call raced against everything that may end it first: the client going away, an abort of its claim
(DELETE, expiry, pause, shutdown) and the request deadline. Plain and streamed chats share it.

Why a task watches `receive()`: uvicorn reports a vanished client only to whoever awaits `receive()`; without a
watcher the engine would keep generating (and holding KV) for nobody. Why one future settled by callbacks rather than
`asyncio.wait` over a waiter task per event: the race runs on every turn, and the claim's abort and the deadline need
no task of their own (a callback on the claim, a timer on the loop), so a turn creates one watcher task, not three
tasks and a wait.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

from starlette.types import Receive

from session_server.sessions.session import Claim


class Ending(enum.Enum):
    FINISHED = "finished"  # the work finished first (result or exception: the caller reads it)
    DISCONNECTED = "disconnected"  # the client went away
    ABORTED = "aborted"  # the claim was aborted (claim.reason says why)
    TIMED_OUT = "timed_out"  # the deadline passed


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race(work: asyncio.Future[Any], receive: Receive | None, claim: Claim, deadline: float) -> Ending:
    """How `work` ended, or what ended first; `work` itself is neither awaited nor cancelled here (the caller decides
    what happens to an engine request that lost: it is aborted by rid, see engine/drains.py). `receive` None: the
    client is not watched (its disconnect shows up in `work` itself, e.g. while reading the body)."""
    loop = asyncio.get_running_loop()
    ending: asyncio.Future[Ending] = loop.create_future()

    def end(how: Ending) -> None:
        if not ending.done():
            ending.set_result(how)

    def on_work(_: asyncio.Future[Any]) -> None:
        end(Ending.FINISHED)

    def on_watcher(task: asyncio.Future[None]) -> None:
        if not task.cancelled():
            task.exception()  # a receive() that failed means the connection is gone as well
            end(Ending.DISCONNECTED)

    if work.done():  # finished before the race began: nothing else can have ended it first
        end(Ending.FINISHED)
    work.add_done_callback(on_work)
    watcher = None
    if receive is not None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(on_watcher)
    unsubscribe = claim.on_abort(lambda: end(Ending.ABORTED))
    timer = loop.call_later(max(0.0, deadline), end, Ending.TIMED_OUT)
    try:
        return await ending
    finally:
        work.remove_done_callback(on_work)
        timer.cancel()
        unsubscribe()
        if watcher is not None:
            watcher.cancel()
