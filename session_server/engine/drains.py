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

An abort the engine did not answer (a timeout, a broken connection, a 5xx: the engine busy or stopped for a moment)
is not dropped: the drain still ends within the bounds above, but hands the request to a background retry
(engine/retries.py, the same machinery as failed closes) that keeps the /generate connection open and retries the
abort with backoff until it lands (then the request ends within `grace`), or it is moot: the engine call itself
ended (the request finished, or the engine restarted and the connection broke). Only at the retry's horizon (the
request timeout; an engine silent that long is treated as gone) or at shutdown is the connection closed unanswered.
A lasting refusal (a router's 404) is not retried: the connection is closed at once. Counted in /metrics
(`engine_abort_retries_total{outcome}`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from session_server.engine.client import Answer
from session_server.engine.placement import EnginePlacement
from session_server.engine.retries import ControlRetries
from session_server.metrics import Metrics

logger = logging.getLogger("session_server.engine.drains")

# Short pauses: the engine keeps generating (and holding KV for) the request until an abort lands.
ABORT_BACKOFF = (0.25, 4.0)
MAX_ABORT_RETRIES = 10_000  # at once (a task and a held connection each); beyond, the connection is closed at once


class EngineDrains:
    def __init__(self, engine: EnginePlacement, metrics: Metrics, grace: float, horizon: float = 600.0) -> None:
        self._engine = engine
        self._metrics = metrics
        self._grace = grace
        self._horizon = horizon  # how long a failed abort is retried at most
        self._retries = ControlRetries(metrics.engine_abort_retries, "aborted", backoff=ABORT_BACKOFF,
                                       limit=MAX_ABORT_RETRIES)
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
        handed_over = False
        try:
            # An acknowledged abort ends the request within moments; an unanswered one is retried in the background
            # (holding the connection, whose end tells when the request ended); a refused one (a router's 404) is
            # not worth waiting for: closing the connection is then the only signal left. The abort goes to the
            # session's worker (engine/placement.py).
            if engine_task.done():
                return
            answer = await self._engine.abort(rid, session_id)
            if answer is Answer.DONE:
                await asyncio.wait((engine_task,), timeout=self._grace)
            elif answer is Answer.RETRY and not engine_task.done():
                handed_over = self._retries.start(self._abort_later(session_id, rid, engine_task))
        finally:
            if not handed_over:
                await _end(engine_task)

    async def _abort_later(self, session_id: str, rid: str, engine_task: asyncio.Future[Any]) -> None:
        """Retry the abort until it lands or the engine call ends by itself; then the connection is closed."""
        try:
            if await self._retries.until_landed(lambda: self._engine.abort(rid, session_id), horizon=self._horizon,
                                                moot=engine_task):
                await asyncio.wait((engine_task,), timeout=self._grace)
        finally:
            await _end(engine_task)

    @property
    def retries_pending(self) -> int:
        """Unanswered aborts still being retried."""
        return self._retries.pending

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

    async def wait_all(self, retries_within: float = 0.0) -> None:
        """Every drain has ended (each is bounded), and, for at most `retries_within` s more, the aborts being
        retried (a pause wants the engine quiet for the weight update)."""
        tasks = list(self._all)
        if tasks:
            await asyncio.wait(tasks)
        await self._retries.wait(retries_within)

    async def aclose(self) -> None:
        """Shutdown, after wait_all: the retried aborts stop and close their connections."""
        await self._retries.aclose()


async def _end(engine_task: asyncio.Future[Any]) -> None:
    """Close the engine call's connection if it still runs (the engine aborts on disconnect as well)."""
    if not engine_task.done():
        engine_task.cancel()
        await asyncio.wait((engine_task,))
    if not engine_task.cancelled():
        engine_task.exception()  # retrieved: an error of an abandoned request is not worth a warning


def abandon(drains: EngineDrains | None, session_id: str, rid: str, engine_task: asyncio.Future[Any],
            lane: str | None = None) -> None:
    """Give up on an engine request: aborted by its rid and left to end in the background (`EngineDrains.start`);
    without drains (no lifespan state: unit use), its connection is closed, which SGLang takes as an abort."""
    if drains is not None:
        drains.start(session_id, rid, engine_task, lane)
    else:
        engine_task.cancel()
