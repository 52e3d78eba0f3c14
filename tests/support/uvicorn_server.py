"""An in-process uvicorn server on a loopback port, for tests of our HTTP protocol against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    """uvicorn's server whose main loop waits for the way out, where uvicorn's wakes every 0.1 s to look for it (its
    other per-tick work, the Date header and the request limits, is not what these tests read)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.leave = asyncio.Event()

    async def main_loop(self) -> None:
        await self.leave.wait()


@contextlib.asynccontextmanager
async def serving(app: Any, http: Any) -> AsyncIterator[int]:
    """Serve `app` with the protocol `http` (a class or uvicorn's name for one) on the running loop; yields the
    port, and stops the server on the way out."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=http, lifespan="off", log_level="warning",
                            loop="none")
    server = _Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        server.leave.set()
        await task
