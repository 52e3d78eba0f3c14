"""A session and the claim on its single in-flight slot.

The record is what a session is: its trajectory, its metadata, the lock that makes each mutation of the trajectory
atomic, and the claim of the chat in flight. The claim is a token object: only the handler that took it releases
it (`Lifecycle.release` compares identity), and release is idempotent, so a cancellation-safe `finally` can always
call it. Other parties (DELETE, expiry, pause-abort, shutdown) never release a slot; they ask the owner to stop
(`Claim.abort`) and wait for `Claim.done`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from session_server.errors import AbortReason, SessionNotFoundError, SessionPausedError, tag_abort
from trajectory import LinearTrajectory
from trajectory.errors import SessionError


@dataclass(eq=False, slots=True)
class Session:
    id: str
    trajectory: LinearTrajectory
    metadata: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    # Guards every read-modify of `trajectory`; never held across an await on the engine or the pool.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    claim: Claim | None = None  # the in-flight chat
    closing: bool = False
    last_active: float = field(default_factory=time.monotonic)  # last request naming this session (idle sweep)


class Claim:
    """Ownership of a session's single in-flight slot."""

    __slots__ = ("_on_abort", "_release", "admitted", "done", "reason", "retry_after", "session", "started")

    def __init__(self, session: Session, release: Callable[[Claim], None], retry_after: int) -> None:
        self.session = session
        self.retry_after = retry_after
        self.started = time.monotonic()
        self.reason: AbortReason | None = None
        self.admitted = False  # its request has arrived and goes to the engine (Lifecycle.admit): a drain waits for it
        self.done = asyncio.Event()  # set once, when the owner has released the slot
        self._release = release
        self._on_abort: list[Callable[[], object]] = []

    def abort(self, reason: AbortReason) -> None:
        """Ask the owner to abort its engine request and commit nothing. The first reason wins."""
        if self.reason is None:
            self.reason = reason
            for callback in self._on_abort:
                callback()

    def on_abort(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call `callback` when the claim is aborted (at once if it already is); returns the unsubscribe. A callback,
        not an event to wait on: no task per stage of every chat is spent waiting for an abort that rarely comes."""
        if self.reason is not None:
            callback()
            return _nothing
        self._on_abort.append(callback)
        return lambda: self._on_abort.remove(callback) if callback in self._on_abort else None

    def abort_error(self) -> SessionError | None:
        """What the agent hears when its chat was aborted by someone else (tagged with the reason); None if not."""
        reason = self.reason
        if reason is None:
            return None
        err: SessionError
        if reason is AbortReason.DELETE:
            err = SessionNotFoundError(f"session {self.session.id} was deleted during the chat")
        elif reason is AbortReason.EXPIRY:
            err = SessionNotFoundError(f"session {self.session.id} expired: its chat outlived the request timeout")
        elif reason is AbortReason.PAUSE:
            err = SessionPausedError("chat aborted: the server was paused; retry the same turn", self.retry_after)
        else:
            err = SessionPausedError("chat aborted: the server is shutting down", self.retry_after)
        return tag_abort(err, reason)

    def raise_if_aborted(self) -> None:
        err = self.abort_error()
        if err is not None:
            raise err

    def release(self) -> None:
        """Free the slot (idempotent); the handler that took the claim calls it in its `finally`."""
        self._release(self)


def _nothing() -> None:
    return None
