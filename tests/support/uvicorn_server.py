"""An in-process uvicorn server on a loopback port, for tests of our HTTP protocol against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn


@contextlib.asynccontextmanager
async def serving(app: Any, http: Any) -> AsyncIterator[int]:
    """Serve `app` with the protocol `http` (a class or uvicorn's name for one) on the running loop; yields the
    port, and stops the server on the way out."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=http, lifespan="off", log_level="warning",
                            loop="none")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task
