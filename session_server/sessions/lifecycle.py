"""Session lifecycle, in one owner: create, claim and release the in-flight slot, close (DELETE), expire, shut down.

Routes, the idle sweep, the admin pause and the process shutdown all go through `Lifecycle`; nothing else mutates a
session's slot or removes a session, so every path that ends a chat or a session is written once. The pause for
weight updates is its part `pause` (pause.py), which alone changes whether the server is paused.

The in-flight gate: at most one turn per segment. A segment's trajectory is linear, so two concurrent turns on it
cannot both be right; miles' contract is that the second one is refused with 409 rather than queued. Under
`--on-divergence reject` a session is one segment and the 409 comes before the body is read, as it always did; with
segments (the default) a second request may be a sub-agent or a side request that starts another segment, so its body
is read and matched, and it is refused (409) only when the segment it continues is busy (`bind`) -- before the body
still when every segment is busy and no new one fits. Claiming and binding are synchronous (no await between the
check and the set), so on a single event loop they are race-free without a lock (the claim itself: session.py).

Closing: DELETE marks the session closing (new chats get 404 at once), asks the in-flight chat to abort and waits
until its handler has released the slot -- the handler hands the engine request's abort to the background at once
(engine/drains.py) -- and forgets the session behind a tombstone. The engine session is closed in the background
after that abort (engine/sessions.py `retire`): a DELETE never waits for the engine. The idle sweep expires sessions
through the same path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from session_server.engine.drains import EngineDrains
from session_server.engine.placement import EnginePlacement
from session_server.engine.sessions import EngineSessions
from session_server.errors import (
    AbortReason,
    ForkCapacityError,
    SessionBusyError,
    SessionPausedError,
    TooManySessionsError,
)
from session_server.metrics import Metrics
from session_server.sessions.journal import Journal, SessionInfo
from session_server.sessions.pause import Pause
from session_server.sessions.registry import Registry
from session_server.sessions.session import Claim, Session
from trajectory import SegmentPlan, SegmentSet
from trajectory.errors import RequestValidationError
from trajectory.forks import ForkPlan, Lineage, plan_fork


class Lifecycle:
    def __init__(
        self, registry: Registry, *, retry_after: int, metrics: Metrics,
        engine_sessions: EngineSessions | None = None, journal: Journal | None = None,
        drains: EngineDrains | None = None, drain_wait: float = 1.0, max_sessions: int = 0,
        engines: EnginePlacement | None = None, cut_replies: bool = False,
    ) -> None:
        self.registry = registry
        self.max_sessions = max_sessions  # 0: unbounded
        self.retry_after = retry_after
        self.shutting_down = False
        self._metrics = metrics
        self._engine_sessions = engine_sessions
        self.journal = journal  # --journal: creations and deletions are on disk before they are answered
        self._engines = engines  # placement: a closed session no longer counts against its worker
        self._in_flight: set[Claim] = set()
        self._drains = drains  # aborted engine requests ending in the background (engine/drains.py)
        self._drain_wait = drain_wait
        # Called with the id of each session closed (DELETE, expiry): the adapter book releases its pin.
        self.on_close: list[Callable[[str], None]] = []
        self.pause = Pause(self, registry, engines=engines, journal=journal, drains=drains,
                           engine_sessions=engine_sessions, cut_replies=cut_replies)

    @property
    def paused(self) -> bool:
        """New chats are refused for a pause (pause.py)."""
        return self.pause.active

    # -- sessions ----------------------------------------------------------------------------------------
    def create(self, segments: SegmentSet, metadata: dict[str, Any] | None = None,
               session_id: str | None = None) -> Session:
        """A new session (a random id, or `session_id` for on-demand creation by X-Session-ID)."""
        self._check_capacity()
        if session_id is None:
            session = self.registry.create(segments, metadata)
        else:
            session = self.registry.create_named(session_id, segments)
            if self.journal is not None:  # not awaited: the first turn writes the session's row with it anyway
                self.journal.created_later(SessionInfo.of(session))
        self._metrics.sessions_created.inc()
        return session

    async def create_durably(self, segments: SegmentSet, metadata: dict[str, Any] | None = None,
                             sampling_masks: bool | None = None) -> Session:
        """POST /sessions: with a journal, the session is on disk before its id is handed out (else 503, no
        session): a client that got an id can use it after a restart. `sampling_masks`: Session.sampling_masks."""
        if self.journal is None:
            session = self.create(segments, metadata)
            session.sampling_masks = sampling_masks
            return session
        self._check_capacity()
        session = self.registry.create(segments, metadata, sampling_masks)
        try:
            await self.journal.created(SessionInfo.of(session))
        except BaseException:
            self.registry.discard(session.id)
            raise
        self._metrics.sessions_created.inc()
        return session

    async def fork(self, parent: Session, n: int, at: int | None, metadata: dict[str, Any],
                   new_segments: Callable[[], SegmentSet]) -> list[Session]:
        """POST /sessions/{id}/fork (trajectory/forks.py): `n` children of `parent`'s current segment at turn `at`
        (None: its end), all or none -- 409 while a turn of the parent is in flight (its history is about to change),
        429 past --max-sessions (400 for more children than --max-sessions at all), 400 for a point that is not a
        turn boundary; with a journal the children are on disk (their rows and copies of the parent's turns, one
        transaction) before their ids are handed out."""
        self.check_accepting()
        if parent.claims:
            raise SessionBusyError(f"session {parent.id} has a chat in flight: fork it when the turn has ended")
        self._check_fork_capacity(n)
        plan = plan_fork(parent.segments, new_segments, n, at)
        # the first segment carries the primed prompt, if any; the children ask for sampling masks as the parent
        # does (a child's stored head holds the parent's masks, its own turns add theirs)
        return await self._spawn(parent.id, parent.lineage, plan, {**parent.metadata, **metadata},
                                 parent.sampling_masks, parent.primed if plan.segment == 0 else None)

    async def create_group(self, root_id: str, root: SegmentSet, n: int, metadata: dict[str, Any],
                           sampling_masks: bool | None, new_segments: Callable[[], SegmentSet],
                           prime: tuple[str, bytes] | None) -> list[Session]:
        """POST /sessions with `prime` and `n` (api/sessions.py): `n` sessions forked at the primed prompt of `root`,
        a session that is never registered (`root_id`, minted, is the group's root and parent in their lineage). As
        a fork: all or none, 429/400 past --max-sessions; with a journal the children and the primed prompt's request
        (`prime`: key, body) are on disk in one transaction before the ids are handed out; they join the worker the
        root was placed on (its prefill), which then no longer counts it."""
        try:
            self.check_accepting()
            self._check_fork_capacity(n)
            plan = plan_fork(root, new_segments, n, 0)
            return await self._spawn(root_id, None, plan, metadata, sampling_masks,
                                     prime[0] if prime is not None else None, prime)
        finally:  # placed by its prefill (or not at all): it never counts against its worker after this
            if self._engines is not None:
                self._engines.forget(root_id)

    def _check_fork_capacity(self, n: int) -> None:
        if self.max_sessions and n > self.max_sessions:
            raise RequestValidationError(f"'n' is {n}; the server holds at most {self.max_sessions} sessions "
                                         "(--max-sessions)")
        try:
            self._check_capacity(n)
        except TooManySessionsError as full:
            raise ForkCapacityError(full.message, full.retry_after) from None

    async def _spawn(self, parent_id: str, parent_lineage: Lineage | None, plan: ForkPlan, metadata: dict[str, Any],
                     sampling_masks: bool | None, primed: str | None,
                     prime: tuple[str, bytes] | None = None) -> list[Session]:
        """Register a fork's children (journaled with `prime`, if any, before they count), beside their parent's
        worker, whose radix cache holds what they share."""
        lineage = plan.lineage_of(parent_id, parent_lineage)
        children = [self.registry.create(segments, metadata, sampling_masks) for segments in plan.children]
        for child in children:
            child.lineage, child.primed = lineage, primed
        if self.journal is not None:
            try:
                await self.journal.forked(parent_id, plan.segment, plan.version,
                                          [SessionInfo.of(child) for child in children], prime)
            except BaseException:
                for child in children:
                    self.registry.discard(child.id)
                raise
        if self._engines is not None:  # the shared prefix is in the parent's worker's radix cache
            self._engines.place_beside([child.id for child in children], parent_id)
        self._metrics.sessions_created.inc(len(children))
        return children

    def _check_capacity(self, n: int = 1) -> None:
        """--max-sessions: a full server refuses new sessions with 503 + Retry-After (the idle sweep and DELETEs
        make room); sessions never pile up unbounded until memory runs out. `n`: sessions about to be created at
        once (a fork's children), all or none."""
        if self.max_sessions and len(self.registry) + n > self.max_sessions:
            self._metrics.refused("sessions")
            raise TooManySessionsError(
                f"the server holds its maximum of {self.max_sessions} sessions (--max-sessions); delete finished "
                "sessions or retry later", self.retry_after,
            )

    async def close(self, session: Session, reason: AbortReason) -> None:
        """Abort every turn in flight, wait for their handlers, forget; the engine session closes in the background.
        Safe to call twice."""
        session.closing = True
        claims = list(session.claims)
        for claim in claims:
            claim.abort(reason)
        for claim in claims:
            await claim.done.wait()
        if self._engine_sessions is not None:
            # The engine session is closed in the background, never on DELETE's path: after the abort of what ran
            # in it (an engine defers a close behind a running request), waited for at most the drain bound.
            drains, session_id, wait = self._drains, session.id, self._drain_wait
            self._engine_sessions.retire(
                session_id, None if drains is None else lambda: drains.settle(session_id, wait))
        if self.registry.get(session.id) is session and self.journal is not None:
            why = "expired after being idle" if reason is AbortReason.EXPIRY else "was deleted"
            try:  # the tombstone is on disk before the session is gone: a restart must not bring it back
                await self.journal.deleted(session.id, why)
            except BaseException:
                session.closing = False  # still there, still usable; the DELETE may be retried
                raise
        if self._engines is not None:
            self._engines.forget(session.id)
        for listener in self.on_close:
            listener(session.id)
        if self.registry.get(session.id) is session:
            if reason is AbortReason.EXPIRY:
                self.registry.forget(session.id, "expired after being idle")
                self._metrics.sessions_expired.inc()
            else:
                self.registry.forget(session.id)
                self._metrics.sessions_deleted.inc()

    async def expire(self, sessions: list[Session]) -> list[BaseException | None]:
        """The idle sweep's way out: DELETE's path for each session, concurrently; errors are returned, not raised."""
        return await asyncio.gather(*(self.close(s, AbortReason.EXPIRY) for s in sessions), return_exceptions=True)

    # -- the in-flight slot --------------------------------------------------------------------------------
    def check_accepting(self) -> None:
        """503 + Retry-After while the server is shutting down or paused: the one gate for new chats, whether they
        claim a session's slot or create a session on demand (frontend/root_session.py)."""
        if self.shutting_down:
            raise SessionPausedError("server is shutting down", self.retry_after)
        if self.paused:
            raise SessionPausedError("server is paused", self.retry_after)

    def claim(self, session_id: str) -> Claim:
        """404 unknown/deleted/closing, 503 paused, 409 busy -- in that order (docs/design.md 3). Busy before the body:
        a single-line session (`--on-divergence reject`) with a turn in flight, or every segment busy and no room for
        another."""
        session = self.registry.require(session_id)
        self.check_accepting()
        if session.claims and self.busy_before_body(session):
            raise SessionBusyError(f"session {session_id} already has a chat in flight")
        claim = Claim(session, self.release, self.retry_after)
        session.claims.add(claim)
        self._in_flight.add(claim)
        return claim

    def admit(self, claim: Claim) -> None:
        """The chat's request has arrived in full: from here on it goes to the engine, and a drain waits for it.

        A chat that was still uploading its body when a pause (or the shutdown) began is refused here instead, 503 +
        Retry-After, nothing sent to the engine: a drain waits only for chats that reached the engine, so one slow
        upload cannot hold a weight update for up to --body-timeout."""
        if claim.reason is None and (self.shutting_down or self.paused):
            claim.abort(AbortReason.SHUTDOWN if self.shutting_down else AbortReason.PAUSE)
        claim.raise_if_aborted()
        claim.admitted = True

    @staticmethod
    def busy_before_body(session: Session) -> bool:
        segments = session.segments
        if segments.on_divergence == "reject" or segments.max_segments == 1:
            return True
        room = len(segments) + len(segments.reserved) < segments.max_segments
        return not room and session.busy_segments().keys() >= {s.id for s in segments}

    def bind(self, claim: Claim, plan: SegmentPlan) -> SegmentPlan:
        """Give the matched turn its segment: 409 if another turn holds that segment or committed to it since the
        plan was built (a concurrent request for the same segment); a new segment's id is reserved (400 past
        --max-segments). Synchronous, like `claim`."""
        session = claim.session
        if plan.start is None:
            segment = session.segments.get(plan.segment)
            if plan.segment in session.busy_segments() or segment.trajectory.version != plan.turn.version:
                raise SessionBusyError(f"session {session.id} already has a chat in flight on segment {plan.segment}")
        plan = session.segments.reserve(plan)
        claim.segment, claim.plan = plan.segment, plan
        return plan

    def release(self, claim: Claim) -> None:
        """Free the slot. Idempotent; a no-op unless `claim` still owns a slot of its session."""
        session = claim.session
        if claim in session.claims:
            session.claims.discard(claim)
            session.last_active = time.monotonic()
            if claim.plan is not None:
                session.segments.unreserve(claim.plan)  # a new segment that never committed
        self._in_flight.discard(claim)
        claim.done.set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def at_engine(self) -> int:
        """Chats in flight whose request reached the engine (`admit`): what a drain waits for."""
        return sum(c.admitted for c in self._in_flight)

    def abort_all(self, reason: AbortReason) -> list[Claim]:
        claims = list(self._in_flight)
        for claim in claims:
            claim.abort(reason)
        return claims

    async def wait_idle(self, admitted_only: bool = False) -> None:
        """Wait until every chat that is in flight now (`admitted_only`: and has reached the engine, see `admit`)
        has released its slot."""
        claims = [c for c in self._in_flight if c.admitted or not admitted_only]
        if claims:
            await asyncio.gather(*(c.done.wait() for c in claims))

    # -- the process ---------------------------------------------------------------------------------------
    async def abort_in_flight(self) -> None:
        """First step of a graceful shutdown: refuse new chats, abort running ones at the engine, wait for them."""
        self.shutting_down = True
        self.abort_all(AbortReason.SHUTDOWN)
        await self.wait_idle()

    async def shutdown(self) -> None:
        """Abort what runs, then close every engine session (sessions themselves die with the process)."""
        await self.abort_in_flight()
        if self._engine_sessions is not None:
            await asyncio.gather(*(self._engine_sessions.close(s.id) for s in self.registry.sessions()))
