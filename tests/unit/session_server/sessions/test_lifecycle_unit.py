"""session_server.sessions.lifecycle: the one owner of every way a chat or a session ends, on a real event loop.

The in-flight gate (claim, admit, bind, release) and the paths that end chats from outside (DELETE, the idle
sweep's expiry, the pause, the shutdown) are driven with asyncio tasks playing the turns' handlers: a handler holds
its claim until asked to abort, then releases it in its `finally`, as the real ones do. The engine side (engine
sessions, drains, placement) and the journal are recording stand-ins, so the order of the steps can be checked: a
session is closed at the engine and forgotten only after its handler let go, and the journal writes before anything
is answered. Every wait is bounded (`bounded`) so a hang fails instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from session_server.errors import (
    AbortReason,
    SessionBusyError,
    SessionNotFoundError,
    SessionPausedError,
    TooManySessionsError,
)
from session_server.metrics import Metrics
from session_server.sessions.journal import JournalUnavailableError, SessionInfo
from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.registry import Registry
from session_server.sessions.session import Claim
from support.bounded import bounded, user
from support.tito import Reply, generate
from trajectory import LinearTrajectory, ModelFamily, SegmentSet


class Book:
    """The engine side and the journal, recording every call in one ordered log."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.fail_delete = False
        self.fail_create = False

    # EngineSessions
    async def close(self, session_id: str) -> None:
        self.log.append(("engine_session.close", session_id))

    # EngineDrains
    async def settle(self, session_id: str, within: float) -> bool:
        self.log.append(("drains.settle", (session_id, within)))
        return True

    # EnginePlacement
    def forget(self, session_id: str) -> None:
        self.log.append(("placement.forget", session_id))

    # Journal
    async def created(self, info: SessionInfo) -> None:
        self.log.append(("journal.created", info.id))
        await asyncio.sleep(0)
        if self.fail_create:
            raise JournalUnavailableError("disk full")

    def created_later(self, info: SessionInfo) -> None:
        self.log.append(("journal.created_later", info.id))

    async def deleted(self, session_id: str, why: str) -> None:
        self.log.append(("journal.deleted", (session_id, why)))
        if self.fail_delete:
            raise JournalUnavailableError("disk full")

    def names(self) -> list[str]:
        return [name for name, _ in self.log]


def lifecycle(*, book: Book | None = None, journal: bool = False, **kw: Any) -> tuple[Lifecycle, Metrics]:
    metrics = Metrics()
    lc = Lifecycle(Registry(), retry_after=3, metrics=metrics, engine_sessions=book, drains=book,  # type: ignore[arg-type]
                   engines=book, journal=book if journal else None, drain_wait=0.5, **kw)  # type: ignore[arg-type]
    return lc, metrics


def count(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(f"session_server_{name}_total", labels or {}) or 0.0


def segments(family: ModelFamily, **kw: Any) -> SegmentSet:
    return SegmentSet(lambda: LinearTrajectory(family), **kw)


class Handler:
    """A turn's handler: claims the slot, (optionally) admits its request, holds the claim until it is asked to abort,
    lets `cleanup` run (its engine request being aborted), and releases in `finally` -- also when cancelled."""

    def __init__(self, lc: Lifecycle, session_id: str, *, admit: bool = True,
                 cleanup: Callable[[], Awaitable[None]] | None = None, log: list[tuple[str, Any]] | None = None):
        self.claim = lc.claim(session_id)
        if admit:
            lc.admit(self.claim)
        self.aborted = asyncio.Event()
        self.claim.on_abort(self.aborted.set)
        self._cleanup = cleanup
        self._log = log if log is not None else []
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.aborted.wait()
            self._log.append(("handler.aborted", self.claim.reason))
            if self._cleanup is not None:
                await self._cleanup()
        finally:
            self._log.append(("handler.released", None))
            self.claim.release()


# -- the gate ------------------------------------------------------------------------------------------------------
def test_a_claim_is_refused_404_then_503_then_409_in_that_order(family: ModelFamily) -> None:
    lc, _ = lifecycle()
    session = lc.create(segments(family, on_divergence="reject"))
    lc.claim(session.id)
    with pytest.raises(SessionBusyError):
        lc.claim(session.id)
    lc.pause.restore("drain")
    with pytest.raises(SessionPausedError, match="paused") as paused:  # paused beats busy
        lc.claim(session.id)
    assert paused.value.retry_after == 3
    with pytest.raises(SessionNotFoundError):  # unknown beats paused
        lc.claim("unknown")
    session.closing = True
    with pytest.raises(SessionNotFoundError, match="being deleted"):
        lc.claim(session.id)
    lc.pause.restore(None)
    lc.shutting_down = True
    with pytest.raises(SessionPausedError, match="shutting down"):
        lc.check_accepting()


def test_busy_before_the_body_only_when_no_turn_could_run(family: ModelFamily) -> None:
    """A single-line session (`reject`, or one segment at most) is busy with any turn in flight; with segments a
    second request is read and matched, unless every segment is busy and no new one fits."""
    lc, _ = lifecycle()
    single = lc.create(segments(family, max_segments=1))
    lc.claim(single.id)
    with pytest.raises(SessionBusyError):
        lc.claim(single.id)

    room = lc.create(segments(family, max_segments=2))
    first = lc.claim(room.id)
    lc.bind(first, room.segments.prepare([user("main")]))
    second = lc.claim(room.id)  # segment 0 busy, but a new segment fits: read the body
    lc.bind(second, room.segments.prepare([user("side")], busy=room.busy_segments()))
    assert second.segment == 1 and room.segments.reserved == {1}
    with pytest.raises(SessionBusyError):  # both busy, no room for a third
        lc.claim(room.id)
    assert lc.in_flight == 3  # the single-line session's turn and the two segments' turns


def test_bind_refuses_a_busy_segment_and_one_committed_to_since_the_plan(family: ModelFamily) -> None:
    lc, _ = lifecycle()
    session = lc.create(segments(family))
    a, b = lc.claim(session.id), lc.claim(session.id)
    plan = session.segments.prepare([user("hi")])
    stale = session.segments.prepare([user("hi")])
    lc.bind(a, plan)
    with pytest.raises(SessionBusyError, match="segment 0"):
        lc.bind(b, session.segments.prepare([user("hi")]))
    # a commits, then releases; b's plan was built before that commit: binding it now would fork the history wrong.
    session.segments.commit(plan, *generate(family, plan.turn, Reply("hello"), rid="r0"))
    a.release()
    with pytest.raises(SessionBusyError):
        lc.bind(b, stale)
    assert b.segment is None  # a refused bind leaves the claim unbound
    fresh = session.segments.prepare([*session.trajectory.messages, user("again")])
    assert lc.bind(b, fresh).segment == 0 and b.segment == 0


def test_release_is_idempotent_and_frees_exactly_the_slot_it_holds(family: ModelFamily) -> None:
    lc, _ = lifecycle()
    session = lc.create(segments(family))
    first = lc.claim(session.id)
    lc.bind(first, session.segments.prepare([user("main")]))
    side = lc.claim(session.id)
    lc.bind(side, session.segments.prepare([user("side")], busy=session.busy_segments()))
    assert session.segments.reserved == {1} and lc.in_flight == 2
    session.last_active = 0.0
    side.release()
    assert side.done.is_set() and session.segments.reserved == set()  # the uncommitted new segment's id is freed
    assert session.last_active > 0.0  # the end of a chat counts as activity
    # A second release (a `finally` after an earlier release) changes nothing: the other turn keeps its slot.
    again = lc.claim(session.id)
    lc.bind(again, session.segments.prepare([user("side")], busy=session.busy_segments()))
    side.release()
    assert session.claims == {first, again} and lc.in_flight == 2 and session.segments.reserved == {2}
    first.release()
    again.release()
    assert session.claims == set() and lc.in_flight == 0 and session.segments.reserved == set()


def test_admit_refuses_a_chat_whose_body_arrived_during_a_pause_or_shutdown(family: ModelFamily) -> None:
    lc, metrics = lifecycle()
    session = lc.create(segments(family))
    early = lc.claim(session.id)
    lc.admit(early)
    uploading = lc.claim(session.id)
    assert lc.in_flight == 2 and lc.at_engine == 1
    lc.pause.restore("drain")
    with pytest.raises(SessionPausedError) as refused:
        lc.admit(uploading)
    assert refused.value.abort_reason is AbortReason.PAUSE and uploading.reason is AbortReason.PAUSE  # type: ignore[attr-defined]
    assert not uploading.admitted and lc.at_engine == 1
    lc.pause.restore(None)
    lc.shutting_down = True
    late = Claim(session, lc.release, 3)
    with pytest.raises(SessionPausedError, match="shutting down"):
        lc.admit(late)
    # A claim already aborted for another reason keeps it (DELETE: 404), pause or not.
    lc.shutting_down = False
    deleted = lc.claim(session.id)
    deleted.abort(AbortReason.DELETE)
    with pytest.raises(SessionNotFoundError):
        lc.admit(deleted)
    assert count(metrics, "sessions_created") == 1


def test_concurrent_claims_of_a_single_line_session_admit_exactly_one(family: ModelFamily) -> None:
    async def main() -> list[Any]:
        lc, _ = lifecycle()
        session = lc.create(segments(family, on_divergence="reject"))

        async def contender() -> Claim:
            await asyncio.sleep(0)
            return lc.claim(session.id)

        return await bounded(asyncio.gather(*(contender() for _ in range(20)), return_exceptions=True))

    results = asyncio.run(main())
    assert sum(isinstance(r, Claim) for r in results) == 1
    assert sum(isinstance(r, SessionBusyError) for r in results) == 19


# -- creation ------------------------------------------------------------------------------------------------------
def test_max_sessions_refuses_new_sessions_until_one_is_closed(family: ModelFamily) -> None:
    async def main() -> None:
        lc, metrics = lifecycle(max_sessions=2)
        a = lc.create(segments(family))
        await lc.create_durably(segments(family))
        with pytest.raises(TooManySessionsError) as full:
            lc.create(segments(family), session_id="named")
        assert full.value.status == 503 and full.value.retry_after == 3
        with pytest.raises(TooManySessionsError):
            await lc.create_durably(segments(family))
        assert count(metrics, "limit_refusals", {"limit": "sessions"}) == 2
        await bounded(lc.close(a, AbortReason.DELETE))
        assert lc.create(segments(family)).id
        assert count(metrics, "sessions_created") == 3

    asyncio.run(main())


def test_with_a_journal_an_id_is_handed_out_only_once_it_is_on_disk(family: ModelFamily) -> None:
    async def main() -> None:
        book = Book()
        lc, metrics = lifecycle(book=book, journal=True)
        session = await lc.create_durably(segments(family), {"k": 1})
        assert book.log == [("journal.created", session.id)] and lc.registry.get(session.id) is session
        book.fail_create = True
        with pytest.raises(JournalUnavailableError):
            await lc.create_durably(segments(family))
        failed = book.log[-1][1]
        # The session that could not be journaled is gone without a trace: no tombstone, not counted.
        assert len(lc.registry) == 1 and not lc.registry.knows(failed)
        assert count(metrics, "sessions_created") == 1
        # On demand (X-Session-ID): the creation is journaled without waiting; the first turn writes the row anyway.
        named = lc.create(segments(family), session_id="agent-7")
        assert named.id == "agent-7" and book.log[-1] == ("journal.created_later", "agent-7")
        with pytest.raises(ValueError):
            lc.create(segments(family), session_id="agent-7")

    asyncio.run(main())


# -- closing -------------------------------------------------------------------------------------------------------
def test_delete_waits_for_the_handler_then_closes_the_engine_session_then_forgets(family: ModelFamily) -> None:
    async def main() -> None:
        book = Book()
        lc, metrics = lifecycle(book=book, journal=True)
        session = lc.create(segments(family))
        book.log.clear()
        gate = asyncio.Event()

        async def cleanup() -> None:  # the handler's engine request is still being aborted
            await gate.wait()

        handler = Handler(lc, session.id, cleanup=cleanup, log=book.log)
        closing = asyncio.create_task(lc.close(session, AbortReason.DELETE))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # Already closing: new chats and GETs get 404 at once, but the session is not forgotten under its handler.
        with pytest.raises(SessionNotFoundError, match="being deleted"):
            lc.claim(session.id)
        assert handler.claim.reason is AbortReason.DELETE
        assert lc.registry.get(session.id) is session and not closing.done()
        assert book.names() == ["handler.aborted"]
        gate.set()
        await bounded(closing)
        assert book.names() == ["handler.aborted", "handler.released", "drains.settle", "engine_session.close",
                                "journal.deleted", "placement.forget"]
        assert book.log[2] == ("drains.settle", (session.id, 0.5))  # bounded by drain_wait
        assert book.log[4] == ("journal.deleted", (session.id, "was deleted"))
        assert lc.registry.get(session.id) is None and lc.in_flight == 0 and handler.task.done()
        with pytest.raises(SessionNotFoundError, match="was deleted"):
            lc.registry.require(session.id)
        assert count(metrics, "sessions_deleted") == 1
        # A second close (a repeated DELETE racing the first) does no second deletion.
        book.log.clear()
        await bounded(lc.close(session, AbortReason.DELETE))
        assert "journal.deleted" not in book.names() and count(metrics, "sessions_deleted") == 1

    asyncio.run(main())


def test_a_delete_the_journal_refused_leaves_the_session_usable(family: ModelFamily) -> None:
    async def main() -> None:
        book = Book()
        lc, metrics = lifecycle(book=book, journal=True)
        session = lc.create(segments(family))
        book.fail_delete = True
        with pytest.raises(JournalUnavailableError):
            await bounded(lc.close(session, AbortReason.DELETE))
        assert not session.closing and lc.registry.require(session.id) is session
        assert "placement.forget" not in book.names() and count(metrics, "sessions_deleted") == 0
        book.fail_delete = False
        await bounded(lc.close(session, AbortReason.DELETE))  # the retried DELETE goes through
        assert lc.registry.is_tombstoned(session.id) and count(metrics, "sessions_deleted") == 1

    asyncio.run(main())


def test_expiry_takes_deletes_path_concurrently_and_returns_errors(family: ModelFamily) -> None:
    async def main() -> None:
        book = Book()
        lc, metrics = lifecycle(book=book)
        idle, stuck = lc.create(segments(family)), lc.create(segments(family))
        handler = Handler(lc, stuck.id)
        broken = lc.create(segments(family))
        broken.claims.add(None)  # type: ignore[arg-type]  # a corrupt record: its close raises
        results = await bounded(lc.expire([idle, stuck, broken]))
        assert results[:2] == [None, None] and isinstance(results[2], AttributeError)
        assert handler.claim.reason is AbortReason.EXPIRY and handler.task.done()
        for s in (idle, stuck):
            with pytest.raises(SessionNotFoundError, match="expired after being idle"):
                lc.registry.require(s.id)
        assert count(metrics, "sessions_expired") == 2 and count(metrics, "sessions_deleted") == 0

    asyncio.run(main())


def test_a_handler_cancelled_mid_turn_still_releases_and_unblocks_delete(family: ModelFamily) -> None:
    """Cancellation (a client gone, a shutdown) runs the handler's `finally`: the slot is freed exactly once and a
    DELETE waiting for it completes."""
    async def main() -> None:
        lc, _ = lifecycle()
        session = lc.create(segments(family))
        never = asyncio.Event()

        async def stuck_cleanup() -> None:
            await never.wait()

        handler = Handler(lc, session.id, cleanup=stuck_cleanup)
        closing = asyncio.create_task(lc.close(session, AbortReason.DELETE))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not closing.done()
        handler.task.cancel()
        await bounded(closing)
        assert handler.claim.done.is_set() and lc.in_flight == 0 and lc.registry.get(session.id) is None

    asyncio.run(main())


# -- pause and shutdown --------------------------------------------------------------------------------------------
def test_wait_idle_for_admitted_chats_ignores_chats_still_uploading(family: ModelFamily) -> None:
    async def main() -> None:
        lc, _ = lifecycle()
        session = lc.create(segments(family))
        at_engine = Handler(lc, session.id)
        uploading = Handler(lc, session.id, admit=False)
        waiting = asyncio.create_task(lc.wait_idle(admitted_only=True))
        await asyncio.sleep(0)
        assert not waiting.done()
        at_engine.claim.abort(AbortReason.PAUSE)
        await bounded(waiting)
        assert not uploading.claim.done.is_set()  # not waited for
        everything = asyncio.create_task(lc.wait_idle())
        await asyncio.sleep(0)
        assert not everything.done()
        uploading.claim.abort(AbortReason.PAUSE)
        await bounded(everything)
        await bounded(lc.wait_idle())  # nothing in flight: returns at once

    asyncio.run(main())


def test_abort_all_keeps_each_claims_first_reason(family: ModelFamily) -> None:
    lc, _ = lifecycle()
    session = lc.create(segments(family))
    a, b = lc.claim(session.id), lc.claim(session.id)
    a.abort(AbortReason.DELETE)
    assert set(lc.abort_all(AbortReason.PAUSE)) == {a, b}
    assert (a.reason, b.reason) == (AbortReason.DELETE, AbortReason.PAUSE)


def test_shutdown_refuses_new_chats_aborts_the_running_ones_then_closes_engine_sessions(family: ModelFamily) -> None:
    async def main() -> None:
        book = Book()
        lc, _ = lifecycle(book=book)
        s1, s2 = lc.create(segments(family)), lc.create(segments(family))
        handlers = [Handler(lc, s1.id, log=book.log), Handler(lc, s2.id, admit=False, log=book.log)]
        await bounded(lc.shutdown())
        assert lc.shutting_down and lc.in_flight == 0
        assert [h.claim.reason for h in handlers] == [AbortReason.SHUTDOWN] * 2
        # Every handler let go before any engine session closed; every session's engine session is closed.
        names = book.names()
        assert names[:4].count("handler.released") == 2 and names.count("handler.released") == 2
        assert sorted(sid for name, sid in book.log if name == "engine_session.close") == sorted([s1.id, s2.id])
        with pytest.raises(SessionPausedError, match="shutting down"):
            lc.claim(s1.id)

    asyncio.run(main())
