"""The idle-session sweep (as in AReaL): delete sessions nobody has used for --session-idle-timeout seconds.

A long RL run loses episodes -- an agent process crashes, a trainer step is cancelled, a client never sends its
DELETE -- and each lost session keeps its trajectory in memory and, with --engine-sessions, an engine session. Without
a sweep they pile up until the process runs out of memory. Every request that names a session (chat, GET, samples,
models) marks it active (`Registry.require`), and so does the end of a chat. A session with a chat in flight is not
idle, unless that chat has been in flight longer than the request timeout: then it is stuck (a client that never
finishes sending its body is the one case the engine timeout does not cover) and is aborted like DELETE aborts it.

A pause for a weight update stops the clock: nothing expires while paused, and `/admin/continue` marks every
session active again, so a long update does not sweep away the episodes that were politely waiting for it.

An expired session goes through exactly DELETE's path (`Lifecycle.close`: abort the chat and wait for its
handler, close the engine session, forget behind a tombstone that says it expired) and is counted in /metrics. The
scan itself is plain attribute reads on the loop, a few microseconds per thousand sessions, every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.session import Session

logger = logging.getLogger("session_server.sessions.sweeper")


def sweep_interval(idle_timeout: float) -> float:
    """How often to scan: a tenth of the timeout, between 50 ms and 5 s (so expiry is late by at most that)."""
    return min(5.0, max(0.05, idle_timeout / 10))


def idle_sessions(sessions: list[Session], now: float, idle_timeout: float, request_timeout: float) -> list[Session]:
    """Sessions unused for longer than `idle_timeout` whose chat, if any, is older than `request_timeout`."""
    out = []
    for session in sessions:
        if session.closing or now - session.last_active <= idle_timeout:
            continue
        if any(now - claim.started <= request_timeout for claim in session.claims):
            continue
        out.append(session)
    return out


class Sweeper:
    """Owns the background task; `stop` lets a batch of deletions in progress finish instead of cutting it."""

    def __init__(self, lifecycle: Lifecycle, idle_timeout: float, request_timeout: float) -> None:
        self._lifecycle = lifecycle
        self._idle_timeout = idle_timeout
        self._request_timeout = request_timeout
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._idle_timeout > 0:
            self._task = asyncio.create_task(self._run(), name="idle-session-sweep")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        interval = sweep_interval(self._idle_timeout)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)
            if self._stop.is_set():
                return
            try:
                await self.sweep_once()
            except Exception:  # the sweep must outlive any one failure
                logger.exception("idle-session sweep failed")

    async def sweep_once(self) -> int:
        lifecycle = self._lifecycle
        if lifecycle.paused:  # agents are told to wait (503 Retry-After): a pause is nobody's idleness
            return 0
        expired = idle_sessions(
            lifecycle.registry.sessions(), time.monotonic(), self._idle_timeout, self._request_timeout
        )
        for session in expired:
            session.closing = True  # at once: from here on chats, GETs and DELETEs of these sessions get 404
        results = await lifecycle.expire(expired)
        for session, result in zip(expired, results, strict=True):
            if isinstance(result, BaseException):
                logger.error("session %s: expiring it failed: %r", session.id, result)
        return len(expired)
