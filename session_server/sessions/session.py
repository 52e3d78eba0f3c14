"""A session and the claims on its in-flight slots, one per segment.

The record is what a session is: its segments (trajectory/session_segments.py; one trajectory until the agent's history
forks), its metadata, the lock that makes each mutation of a trajectory atomic, and the claims of the turns in flight. A
claim is taken before the body is read and bound to its segment once the request is matched (`Lifecycle.bind`): at most
one turn per segment, turns of different segments run side by side. The claim is a token object: only the handler that
took it releases it (`Lifecycle.release` compares identity), and release is idempotent, so a cancellation-safe `finally`
can always call it. Other parties (DELETE, expiry, pause-abort, shutdown) never release a slot; they ask the owner to
stop (`Claim.abort`) and wait for `Claim.done`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from session_server.errors import AbortReason, SessionNotFoundError, SessionPausedError, tag_abort
from trajectory import LinearTrajectory, SegmentPlan, SegmentSet
from trajectory.errors import SessionError
from trajectory.forks import Lineage
from trajectory.infrastructure import InfrastructureAbort, is_infrastructure_status


@dataclass(eq=False, slots=True)
class Session:
    id: str
    segments: SegmentSet
    metadata: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    # Guards every read-modify of `segments`; never held across an await on the engine or the pool.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    claims: set[Claim] = field(default_factory=set)  # the turns in flight
    closing: bool = False
    last_active: float = field(default_factory=time.monotonic)  # last request naming this session (idle sweep)
    # Ask the engine for sampling masks (turns/sampling_masks.py): as POST /sessions said, None for the server's
    # --return-sampling-masks.
    sampling_masks: bool | None = None
    lineage: Lineage | None = None  # where a forked session came from (trajectory/forks.py)
    # The journal's key of the primed prompt its first segment holds (api/primes.py; sessions/journal.py `primes`):
    # the id of the session that was primed, inherited by its children. None: not primed, or no journal.
    primed: str | None = None
    # The infrastructure failure the session's latest turn ended with (trajectory/infrastructure.py), with the
    # commits the session had then: its samples carry it until a later turn commits (`failure`).
    _failure: tuple[InfrastructureAbort, int] | None = None
    # What followed each engine abort of its turns (turns/engine_call.py, the labels of
    # session_server_turn_continuations_total): recomputed, regenerated, stale, continued, ...; its samples say it.
    continuations: dict[str, int] = field(default_factory=dict)

    @property
    def trajectory(self) -> LinearTrajectory:
        """The first segment: all there is of a single-line session."""
        return self.segments.main

    def commits(self) -> int:
        """Turns committed over the session's life (every segment's trajectory version): a later commit changes it."""
        return sum(segment.trajectory.version for segment in self.segments)

    def count_continuation(self, result: str) -> None:
        self.continuations[result] = self.continuations.get(result, 0) + 1

    def record_failure(self, err: SessionError) -> None:
        """A turn of this session was answered `err`: kept if the infrastructure failed it (a 5xx), as the cause its
        abort reason names (a pause, the deadline, the staleness bound, ...) or else its code."""
        if not is_infrastructure_status(err.status):
            return
        cause = err.abort_reason.value if err.abort_reason is not None else err.code
        turns = sum(len(segment.trajectory.records) for segment in self.segments)
        self._failure = (InfrastructureAbort(cause=cause, code=err.code, status=err.status, message=err.message,
                                             turns=turns, source="server"), self.commits())

    @property
    def failure(self) -> InfrastructureAbort | None:
        """The infrastructure failure the session ended with: the latest one, unless a turn committed since."""
        if self._failure is None or self._failure[1] != self.commits():
            return None
        return self._failure[0]

    def busy_segments(self) -> dict[int, dict[str, Any]]:
        """The segments with a turn in flight, each with that turn's first message (SegmentSet.prepare)."""
        return {c.segment: c.plan.turn.messages[0] for c in self.claims if c.segment is not None and c.plan}


class Claim:
    """Ownership of an in-flight slot of a session: of the session until its request is matched, then of one segment
    (`segment`, and `plan`, the matched turn; a new segment's id is reserved until the turn commits or ends)."""

    __slots__ = ("_on_abort", "_release", "admitted", "done", "plan", "reason", "retry_after", "segment", "session",
                 "started")

    def __init__(self, session: Session, release: Callable[[Claim], None], retry_after: int) -> None:
        self.session = session
        self.retry_after = retry_after
        self.started = time.monotonic()
        self.segment: int | None = None
        self.plan: SegmentPlan | None = None
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

    @property
    def lane(self) -> str:
        """The key of this turn's engine-side books (drains): the session's id for its first segment, else the
        session and segment, so concurrent segments never wait for each other's aborted requests."""
        return self.session.id if not self.segment else f"{self.session.id}#{self.segment}"

    def raise_if_aborted(self) -> None:
        err = self.abort_error()
        if err is not None:
            raise err

    def release(self) -> None:
        """Free the slot (idempotent); the handler that took the claim calls it in its `finally`."""
        self._release(self)


def _nothing() -> None:
    return None
