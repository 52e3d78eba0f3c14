"""session_server.sessions.journal in process: schema checks, what is written and read back, group commit, compaction.

A real SQLite file in a temp dir and the real writer thread, driven from an asyncio loop the way the server does;
turns are real staged commits of a trajectory on the real Qwen3 tokenizer, restored through trajectory.restore.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from session_server.sessions.journal import (
    SCHEMA_VERSION,
    Journal,
    JournalError,
    JournalUnavailableError,
    SessionInfo,
    wall_to_monotonic,
)
from support.tito import Reply, generate
from trajectory import LinearTrajectory
from trajectory.restore import restore_trajectory
from trajectory.sampling_masks import SamplingMasks


@pytest.fixture(scope="module")
def family(families):
    return families["qwen3"]


def info(sid: str, **metadata: Any) -> SessionInfo:
    return SessionInfo(id=sid, family="qwen3", max_rollback=1, matcher="loose_tool_call", metadata=metadata,
                       created_at=1000.0)


def staged_turns(family, n: int):
    """(delta, prev_messages, prev_tools) of n live turns, applied to the returned trajectory as they are staged."""
    traj = LinearTrajectory(family)
    out = []
    for i in range(n):
        plan = traj.prepare([*traj.messages, {"role": "user", "content": f"question {i}"}])
        result, message = generate(family, plan, Reply(f"answer {i}"), rid=f"r{i}")
        delta = traj.stage(plan, result, message)
        out.append((delta, traj.messages, traj.tools))
        traj.apply(delta)
    return traj, out


def test_write_and_read_back(tmp_path: Path, family) -> None:
    path = tmp_path / "j.sqlite"
    live, turns = staged_turns(family, 3)

    async def main() -> None:
        journal = Journal(path, max_tombstones=10)
        assert journal.open().sessions == []
        journal.start()
        await journal.created(info("a", episode=1, name="ü"))
        await journal.created(info("gone"))
        # Three turns queued at once: one transaction, each caller woken when its own turn is on disk.
        await asyncio.gather(*(journal.write_turn(info("a"), *t) for t in turns))
        await journal.deleted("gone", "was deleted")
        assert journal.queue_depth == 0
        await journal.close()
        await journal.close()  # idempotent
        with pytest.raises(JournalUnavailableError):
            await journal.created(info("late"))

    asyncio.run(main())
    restored = Journal(path).open()
    assert [s.id for s in restored.sessions] == ["a"]
    saved = restored.sessions[0]
    assert saved.metadata == {"episode": 1, "name": "ü"} and saved.family == "qwen3" and saved.max_rollback == 1
    assert restored.tombstones == [("gone", "was deleted")]
    back = restore_trajectory(family, saved.turns, max_rollback=saved.max_rollback, matcher=saved.matcher)
    assert back.token_ids.tolist() == live.token_ids.tolist()
    assert back.logprobs.tolist() == live.logprobs.tolist() and back.loss_mask.tolist() == live.loss_mask.tolist()
    assert back.messages == live.messages and back.records == live.records
    with sqlite3.connect(path) as db:  # the deleted session's rows are gone with it
        assert db.execute("SELECT count(*) FROM sessions WHERE id = 'gone'").fetchone()[0] == 0
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_failing_write_fails_alone(tmp_path: Path, family) -> None:
    """The same turn twice (a version the file already has): that write fails, the rest of its batch commits."""
    path = tmp_path / "j.sqlite"
    _, turns = staged_turns(family, 2)

    async def main() -> list[Any]:
        journal = Journal(path)
        journal.open()
        journal.start()
        results = await asyncio.gather(
            journal.write_turn(info("a"), *turns[0]), journal.write_turn(info("a"), *turns[0]),
            journal.write_turn(info("a"), *turns[1]), journal.created(info("b")), return_exceptions=True,
        )
        await journal.close()
        return results

    results = asyncio.run(main())
    assert results[0] is None and results[2] is None and results[3] is None
    assert isinstance(results[1], JournalUnavailableError) and results[1].status == 503
    restored = Journal(path).open()
    assert sorted(s.id for s in restored.sessions) == ["a", "b"]
    assert [t.version for t in next(s for s in restored.sessions if s.id == "a").turns] == [0, 1]


def test_tombstones_are_bounded_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"

    async def main() -> None:
        journal = Journal(path, max_tombstones=2)
        journal.open()
        journal.start()
        for sid in ("a", "b", "c"):
            await journal.created(info(sid))
            await journal.deleted(sid, "was deleted")
        await journal.close()

    asyncio.run(main())
    assert Journal(path).open().tombstones == [("b", "was deleted"), ("c", "was deleted")]


def test_the_pause_in_force_is_read_back(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"

    async def write(*modes: str | None) -> None:
        journal = Journal(path)
        journal.open()
        journal.start()
        for mode in modes:
            await journal.paused(mode)
        await journal.close()

    assert Journal(path).open().paused is None
    asyncio.run(write("drain", "in_place"))  # the last one holds
    assert Journal(path).open().paused == "in_place"
    asyncio.run(write(None))
    assert Journal(path).open().paused is None


def test_engine_sessions_stay_in_the_book_until_closed(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"

    async def main() -> None:
        journal = Journal(path)
        journal.open()
        journal.start()
        for session_id, sid in (("a", "a-1"), ("a", "a-2"), ("b", "b-1")):
            journal.engine_session_opening(session_id, sid)
        journal.engine_session_gone("a-1")
        journal.engine_session_gone("never-booked")  # harmless
        await journal.close()

    asyncio.run(main())
    assert Journal(path).open().engine_sessions == [("a", "a-2"), ("b", "b-1")]


def test_a_journal_of_schema_2_gains_the_new_tables_and_keeps_its_sessions(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"

    async def main() -> None:
        journal = Journal(path)
        journal.open()
        journal.start()
        await journal.created(info("a", run=1))
        await journal.close()

    asyncio.run(main())
    with sqlite3.connect(path) as db:
        db.executescript("DROP TABLE pause; DROP TABLE engine_sessions; ALTER TABLE turns DROP COLUMN sampling_masks; "
                         "ALTER TABLE sessions DROP COLUMN lineage; DROP INDEX sessions_by_primed; "
                         "ALTER TABLE sessions DROP COLUMN primed; DROP TABLE primes;"
                         "PRAGMA user_version = 2;")
    restored = Journal(path).open()
    assert [s.id for s in restored.sessions] == ["a"] and restored.paused is None and restored.engine_sessions == []
    assert restored.sessions[0].lineage is None
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert "lineage" in [row[1] for row in db.execute("PRAGMA table_info(sessions)")]
        assert "sampling_masks" in [row[1] for row in db.execute("PRAGMA table_info(turns)")]
        assert db.execute("SELECT count(*) FROM pause").fetchone()[0] == 0
        assert db.execute("SELECT count(*) FROM engine_sessions").fetchone()[0] == 0
        assert "primed" in [row[1] for row in db.execute("PRAGMA table_info(sessions)")]
        assert db.execute("SELECT count(*) FROM primes").fetchone()[0] == 0


def test_files_we_must_not_read_are_refused_untouched(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE notes (x)")
    with pytest.raises(JournalError, match="not a session-server journal"):
        Journal(foreign).open()
    newer = tmp_path / "newer.sqlite"
    Journal(newer).open()
    with sqlite3.connect(newer) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = newer.read_bytes()
    with pytest.raises(JournalError, match="newer session-server"):
        Journal(newer).open()
    assert newer.read_bytes() == before
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 0")
    with pytest.raises(JournalError, match="unknown journal schema"):
        Journal(newer).open()
    not_sqlite = tmp_path / "text.sqlite"
    not_sqlite.write_text(json.dumps({"hello": "world"}) * 100)
    with pytest.raises(JournalError):
        Journal(not_sqlite).open()
    with pytest.raises(ValueError, match="journal-sync"):
        Journal(tmp_path / "x.sqlite", sync="sometimes")


def test_journaled_clock_maps_to_the_monotonic_clock() -> None:
    assert wall_to_monotonic(900.0, now_wall=lambda: 1000.0, now_mono=lambda: 50.0) == -50.0
    assert wall_to_monotonic(1100.0, now_wall=lambda: 1000.0, now_mono=lambda: 50.0) == 50.0  # never in the future


def test_sampling_masks_and_the_sessions_choice_survive_a_restart(tmp_path: Path, family) -> None:
    """A turn's sampling-mask rows and the session's `return_sampling_masks` are read back as written."""
    path = tmp_path / "j.sqlite"
    traj = LinearTrajectory(family)
    plan = traj.prepare([{"role": "user", "content": "q"}])
    result, message = generate(family, plan, Reply("an answer"), rid="r0")
    ids = result.output_ids.tolist()
    rows = [[t, (t + 1) % family.vocab_size] for t in ids]
    result = dataclasses.replace(result, sampling_masks=SamplingMasks.from_rows(rows, [-0.5] * len(ids)))
    delta = traj.stage(plan, result, message)

    async def main() -> None:
        journal = Journal(path)
        journal.open()
        journal.start()
        chosen = dataclasses.replace(info("a"), sampling_masks=False)
        await journal.created(chosen)
        await journal.write_turn(chosen, delta, [], None)
        await journal.close()

    asyncio.run(main())
    (saved,) = Journal(path).open().sessions
    assert saved.sampling_masks is False
    back = restore_trajectory(family, saved.turns)
    masks = back.sampling_masks
    assert masks is not None
    assert [masks.row(p).tolist() for p in range(plan.prompt_ids.size, back.num_tokens)] == rows
