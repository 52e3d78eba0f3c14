"""session_server.turns.commit: the one place a chat changes a trajectory, all or nothing.

Real sessions and segment sets (the real Qwen3 tokenizer, turns from tests/support/tito.py's engine stand-in); the
journal is a stand-in whose writes the test lands or fails. Checked: a commit applies the whole turn; one that does
not validate (a plan gone stale) or whose journal write fails leaves the trajectory exactly as it was; nothing is
applied before the write is on disk, and the session lock is not held while it waits; a write that lands after its
handler was cancelled is still applied (memory never falls behind the journal); a reader holding the lock holds the
commit back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from session_server.sessions.journal import JournalUnavailableError
from session_server.sessions.session import Session
from session_server.turns.commit import commit_turn
from support.bounded import bounded, until, user
from support.inprocess_app import in_process_app
from support.tito import Reply, generate
from trajectory import GenerateResult, ModelFamily, SegmentPlan
from trajectory.errors import InvariantError


class Journal:
    """`write_turn` as the server's journal offers it: a future that resolves once the turn is on disk."""

    def __init__(self) -> None:
        self.writes: list[tuple[Any, asyncio.Future[None]]] = []

    def write_turn(self, info: Any, delta: Any, prev_messages: Any, prev_tools: Any, segment: int = 0,
                   segment_info: Any = None) -> asyncio.Future[None]:
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.writes.append((delta, written))
        return written


@pytest.fixture
def session(family: ModelFamily) -> Iterator[Session]:
    with in_process_app(family) as (_, server):
        yield server.lifecycle.create(server.new_segments())


def planned(session: Session, text: str = "Hello.") -> tuple[SegmentPlan, GenerateResult, dict[str, Any]]:
    """The session's next turn, prepared and answered: what the engine call hands the commit."""
    segments = session.segments
    plan = segments.reserve(segments.prepare([*session.trajectory.messages, user("hi")], busy={}))
    result, message = generate(segments.main.family, plan.turn, Reply(text), rid=f"rid-{text}")
    return plan, result, message


def state(session: Session) -> tuple[int, list[int], list[Any], int]:
    trajectory = session.trajectory
    return trajectory.version, trajectory.token_ids.tolist(), list(trajectory.messages), len(trajectory.records)


def server(journal: Journal | None = None) -> Any:
    metrics = SimpleNamespace(stage=lambda name, seconds: None)
    return SimpleNamespace(journal=journal, engine_sessions=None, metrics=metrics)


def test_a_commit_applies_the_whole_turn(session: Session) -> None:
    plan, result, message = planned(session)
    record = asyncio.run(commit_turn(server(), session, plan, result, message))
    version, ids, messages, records = state(session)
    assert (version, records) == (1, 1) and record is session.trajectory.records[0]
    assert ids == [*plan.turn.prompt_ids.tolist(), *result.output_ids.tolist()]
    assert messages[-1]["content"] == "Hello."


@pytest.mark.parametrize("journaled", [False, True])
def test_a_turn_that_does_not_validate_changes_nothing(session: Session, journaled: bool) -> None:
    """Two turns prepared from the same state: the second is stale once the first commits."""
    first, second = planned(session, "Hello."), planned(session, "Other.")
    journal = Journal() if journaled else None

    async def main() -> None:
        committing = asyncio.ensure_future(commit_turn(server(journal), session, *first))
        if journal is not None:
            await until(lambda: journal.writes != [])
            journal.writes[0][1].set_result(None)
        await bounded(committing)
        before = state(session)
        with pytest.raises(InvariantError):
            await bounded(commit_turn(server(journal), session, *second))
        assert state(session) == before
        assert journal is None or len(journal.writes) == 1  # nothing of the stale turn reached the journal

    asyncio.run(main())


def test_a_failed_journal_write_leaves_the_trajectory_as_it_was(session: Session) -> None:
    journal = Journal()
    before = state(session)

    async def main() -> None:
        committing = asyncio.ensure_future(commit_turn(server(journal), session, *planned(session)))
        await until(lambda: journal.writes != [])
        assert state(session) == before and not session.lock.locked()  # nothing applied, no lock held meanwhile
        journal.writes[0][1].set_exception(JournalUnavailableError("disk full"))
        with pytest.raises(JournalUnavailableError):
            await bounded(committing)

    asyncio.run(main())
    assert state(session) == before


@pytest.mark.parametrize("lands", [True, False])
def test_a_write_that_ends_after_its_handler_was_cancelled_decides_alone(session: Session, lands: bool) -> None:
    """Shutdown cancels the handler mid-write: what reached the disk is applied, what did not is not."""
    journal = Journal()
    plan, result, message = planned(session)
    before = state(session)

    async def main() -> None:
        committing = asyncio.ensure_future(commit_turn(server(journal), session, plan, result, message))
        await until(lambda: journal.writes != [])
        committing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await committing
        assert state(session) == before
        written = journal.writes[0][1]
        if lands:
            written.set_result(None)
        else:
            written.set_exception(JournalUnavailableError("disk full"))
        await asyncio.sleep(0)  # the write's done-callback

    asyncio.run(main())
    if lands:
        assert session.trajectory.version == 1
        assert state(session)[1] == [*plan.turn.prompt_ids.tolist(), *result.output_ids.tolist()]
    else:
        assert state(session) == before


def test_a_reader_holding_the_session_lock_holds_the_commit_back(session: Session) -> None:
    plan, result, message = planned(session)

    async def main() -> None:
        await session.lock.acquire()  # a snapshot (GET, samples) in progress
        committing = asyncio.ensure_future(commit_turn(server(), session, plan, result, message))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not committing.done() and session.trajectory.version == 0
        session.lock.release()
        await bounded(committing)
        assert session.trajectory.version == 1

    asyncio.run(main())
