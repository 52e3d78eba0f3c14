"""The in-flight gate: at most one chat per session, decided before the request body is read.

A session's trajectory is linear, so two concurrent turns on it cannot both be right; miles' contract is that the
second one is refused at once with 409 (it never reads its body and never reaches the engine) rather than queued.
Claiming is synchronous (no await between the check and the set), so on a single event loop it is race-free without a
lock. The claim is a token object: only the handler that took it can release it (`release` compares identity), and
release is idempotent, so a cancellation-safe `finally` can always call it. Other parties (DELETE, pause-abort,
shutdown) never release a slot; they ask the owner to stop (`abort`) and wait for `done`.
"""

from __future__ import annotations

import asyncio
import enum
import time

from .errors import SessionBusyError, SessionPausedError
from .registry import Registry, Session


class AbortReason(enum.Enum):
    DELETED = "deleted"
    EXPIRED = "expired"  # the idle sweep (sweeper.py) deleted the session
    PAUSED = "paused"
    SHUTDOWN = "shutdown"


class Claim:
    """Ownership of a session's single in-flight slot."""

    __slots__ = ("_gate", "aborted", "done", "reason", "session", "started")

    def __init__(self, gate: Gate, session: Session) -> None:
        self._gate = gate
        self.session = session
        self.started = time.monotonic()
        self.reason: AbortReason | None = None
        self.aborted = asyncio.Event()  # set by someone else who wants this chat to stop
        self.done = asyncio.Event()  # set once, when the owner has released the slot

    @property
    def retry_after(self) -> int:
        return self._gate.retry_after

    def abort(self, reason: AbortReason) -> None:
        """Ask the owner to abort its engine request and commit nothing. The first reason wins."""
        if self.reason is None:
            self.reason = reason
            self.aborted.set()

    def release(self) -> None:
        """Free the slot. Idempotent; a no-op unless this claim still owns the session's slot."""
        if self.session.claim is self:
            self.session.claim = None
            self.session.last_active = time.monotonic()
        self._gate._in_flight.discard(self)
        self.done.set()


class Gate:
    def __init__(self, registry: Registry, retry_after: int) -> None:
        self._registry = registry
        self._in_flight: set[Claim] = set()
        self.retry_after = retry_after
        self.paused = False
        self.shutting_down = False

    def claim(self, session_id: str) -> Claim:
        """404 unknown/deleted/closing, 503 paused, 409 busy -- in that order (DESIGN.md 3)."""
        session = self._registry.require(session_id)
        if self.shutting_down:
            raise SessionPausedError("server is shutting down", self.retry_after)
        if self.paused:
            raise SessionPausedError("server is paused", self.retry_after)
        if session.claim is not None:
            raise SessionBusyError(f"session {session_id} already has a chat in flight")
        claim = Claim(self, session)
        session.claim = claim
        self._in_flight.add(claim)
        return claim

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def abort_all(self, reason: AbortReason) -> list[Claim]:
        claims = list(self._in_flight)
        for claim in claims:
            claim.abort(reason)
        return claims

    async def wait_idle(self) -> None:
        """Wait until every chat that is in flight now has released its slot."""
        claims = list(self._in_flight)
        if claims:
            await asyncio.gather(*(c.done.wait() for c in claims))
