"""Background retries of engine control calls that failed (a close, an abort): the one machinery for both.

Why: the calls that free engine KV -- `/close_session` after a DELETE, `/abort_request` after a chat ended early -- are
exactly the ones a busy or stalled engine fails to answer within the control timeout. Dropping them leaves engine
sessions and running requests (and their KV) behind after every session was deleted (measured: 97 engine sessions
left open after a burst on a slow machine). So a failed call is retried in the background with doubling pauses
until it lands, or until it is moot: the thing it would free is gone anyway (`moot`: a future that ends when it is,
e.g. the aborted request's own engine call), or its `horizon` has passed (e.g. the engine session's own idle
timeout has closed it). Bounded twice: at most `limit` retries run at once (beyond, the call is dropped and counted
as moot: the horizon's mechanism frees it), and each gives up at its horizon. A lasting refusal (a 4xx such as a
router's 404) ends the retry too. Every outcome is counted in /metrics: `retry` (one more attempt), the landing
outcome (`closed`, `aborted`), `moot`, `refused`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from prometheus_client import Counter

from session_server.engine.client import Answer


class ControlRetries:
    """Retries of one kind of control call; `counter` is labelled by outcome, `landed` names the success."""

    def __init__(self, counter: Counter, landed: str, *, backoff: tuple[float, float] = (0.5, 30.0),
                 limit: int = 10_000) -> None:
        self._counter = counter
        self._landed = landed
        self._backoff = backoff
        self._limit = limit
        self._tasks: set[asyncio.Task[Any]] = set()  # strong references: the loop keeps only weak ones

    def start(self, body: Coroutine[Any, Any, Any]) -> bool:
        """Run `body` (a coroutine that calls `until_landed`) in the background; False, with `body` closed and the
        call counted moot, when `limit` retries already run."""
        if len(self._tasks) >= self._limit:
            body.close()
            self._counter.labels("moot").inc()
            return False
        task = asyncio.get_running_loop().create_task(body)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def until_landed(self, attempt: Callable[[], Awaitable[Answer]], *, horizon: float,
                           moot: asyncio.Future[Any] | None = None) -> bool:
        """Call `attempt` after doubling pauses until the engine takes it (True), refuses it for good, or the retry
        is moot: `moot` has ended, or the next attempt would come `horizon` seconds or more after the first failure
        (False)."""
        give_up_at = time.monotonic() + horizon
        pause, largest = self._backoff
        while True:
            if (moot is not None and moot.done()) or time.monotonic() + pause >= give_up_at:
                self._counter.labels("moot").inc()
                return False
            if moot is None:
                await asyncio.sleep(pause)
            else:
                await asyncio.wait((moot,), timeout=pause)
                if moot.done():
                    continue
            self._counter.labels("retry").inc()
            answer = await attempt()
            if answer is not Answer.RETRY:
                self._counter.labels(self._landed if answer is Answer.DONE else "refused").inc()
                return answer is Answer.DONE
            pause = min(pause * 2, largest)

    @property
    def pending(self) -> int:
        """Retries still running."""
        return len(self._tasks)

    async def wait(self, within: float) -> bool:
        """Wait (at most `within` s) for the retries running now to end; True when they have."""
        tasks = list(self._tasks)
        if tasks and within > 0:
            await asyncio.wait(tasks, timeout=within)
        return all(t.done() for t in tasks)

    async def aclose(self) -> None:
        """Shutdown: stop every retry (the horizons' own mechanisms free what they would have)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
