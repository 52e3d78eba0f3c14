"""Aborted engine requests finish in the background, so no client ever waits for the engine to acknowledge one.

Why: when a chat ends early (the client went away, its deadline passed, DELETE, pause) the engine request must be
aborted by its rid and its KV freed -- but how long that takes is the engine's business. A stalled engine (SIGSTOP,
a long GC, a network partition) must not hold the client's answer (504 at exactly the request timeout), the slot
(an agent's immediate retry must not get 409 for its own dead request), DELETE or shutdown for longer than the
bounded steps below. So the handler hands the engine task to `EngineDrains.start` and returns at once.

A drain: POST /abort_request to the session's worker (bounded by the engine client's control timeout); if the
engine acknowledged it, wait up to `grace` for the engine to end the request (it answers with finish_reason abort);
then close the connection (SGLang aborts a request whose client went away). Every step is bounded, so a drain ends
within control timeout + grace whatever the engine does.

Why the next turn waits for it: with engine sessions a streaming session accepts one request at a time, and in any
mode a resent turn must not run next to its own aborted copy. So the session's next chat waits (bounded by the same
steps and by its own deadline) for the session's drain before it sends anything to the engine.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from session_server.engine.placement import EnginePlacement
from session_server.metrics import Metrics

logger = logging.getLogger("session_server.engine.drains")


class EngineDrains:
    def __init__(self, engine: EnginePlacement, metrics: Metrics, grace: float) -> None:
        self._engine = engine
        self._metrics = metrics
        self._grace = grace
        self._by_session: dict[str, asyncio.Task[None]] = {}  # the latest drain of each session
        self._all: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones

    def start(self, session_id: str, rid: str, engine_task: asyncio.Future[Any],
              lane: str | None = None) -> asyncio.Task[None]:
        """Abort `rid` (on the session's worker) and let its engine task end, in the background; the next chat of
        `lane` (the session, or one segment of it: Claim.lane) waits for it."""
        self._metrics.engine_aborts.inc()
        key = lane or session_id
        task = asyncio.get_running_loop().create_task(self._drain(session_id, rid, engine_task), name=f"drain-{rid}")
        self._by_session[key] = task
        self._all.add(task)
        task.add_done_callback(lambda t: self._forget(key, t))
        return task

    def _forget(self, session_id: str, task: asyncio.Task[None]) -> None:
        self._all.discard(task)
        if self._by_session.get(session_id) is task:
            del self._by_session[session_id]
        if not task.cancelled() and task.exception() is not None:
            logger.warning("drain failed: %r", task.exception())

    async def _drain(self, session_id: str, rid: str, engine_task: asyncio.Future[Any]) -> None:
        try:
            # An acknowledged abort ends the request within moments; an abort the engine did not take (timeout,
            # refused, a router's 404) is not worth waiting for: closing the connection is then the only signal left.
            # The abort goes to the session's worker (engine/placement.py).
            if not engine_task.done() and await self._engine.abort(rid, session_id):
                await asyncio.wait((engine_task,), timeout=self._grace)
        finally:
            if not engine_task.done():
                engine_task.cancel()  # closes the connection; the engine aborts on disconnect as well
                await asyncio.wait((engine_task,))
            if not engine_task.cancelled():
                engine_task.exception()  # retrieved: an error of an abandoned request is not worth a warning

    def pending(self, session_id: str) -> asyncio.Task[None] | None:
        return self._by_session.get(session_id)

    async def settle(self, session_id: str, within: float) -> bool:
        """Wait (at most `within` s) for the session's previous engine request to end; True when it has."""
        task = self._by_session.get(session_id)
        if task is None:
            return True
        if within > 0:
            await asyncio.wait((task,), timeout=within)
        return task.done()

    async def wait_all(self) -> None:
        """Shutdown: every drain has ended (each is bounded)."""
        tasks = list(self._all)
        if tasks:
            await asyncio.wait(tasks)
