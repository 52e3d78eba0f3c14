"""session_server.sessions.recovery: a restart rebuilds every journaled session and tombstone into a fresh registry.

The journal's rows are built here exactly as the turn commit writes them (`store_turn` of each staged delta, with the
segment's info on the turn that starts it), from a live session on the real Qwen3 tokenizer that has a second
segment; the restored session must be the live one -- every segment's tokens, messages and origin, its metadata and
clocks -- and must take its next turn as the live one would.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from session_server.sessions.journal import JournalError, Restored, RestoredSession
from session_server.sessions.recovery import restore_sessions
from session_server.sessions.registry import Registry
from support.bounded import user
from support.tito import Reply, generate
from trajectory import LinearTrajectory, ModelFamily, SegmentSet
from trajectory.restore import StoredTurn, store_turn


def factory(family: ModelFamily, **kw: Any) -> Any:
    def new_segments() -> SegmentSet:
        return SegmentSet(lambda: LinearTrajectory(family, max_rollback=2, **kw), max_segments=4)
    return new_segments


def play(segments: SegmentSet, request: list[dict[str, Any]], text: str,
         journal: dict[int, list[StoredTurn]], infos: dict[int, dict[str, Any]]) -> None:
    """One turn, committed as turns/commit.py does with a journal: stage, store the row, apply."""
    plan = segments.reserve(segments.prepare(request, busy={}))
    result, message = generate(segments.main.family, plan.turn, Reply(text), rid=f"r{text}")
    staged = segments.stage(plan, result, message)
    traj = plan.start.trajectory if plan.start is not None else segments.get(plan.segment).trajectory
    journal.setdefault(plan.segment, []).append(store_turn(staged.delta, traj.messages, traj.tools))
    if staged.start is not None:
        infos[plan.segment] = staged.start.info()
    segments.apply(staged)


def live_episode(family: ModelFamily, sid: str = "ep-1",
                 **kw: Any) -> tuple[SegmentSet, RestoredSession]:
    live = factory(family, **kw)()
    rows: dict[int, list[StoredTurn]] = {}
    infos: dict[int, dict[str, Any]] = {}
    play(live, [user("solve it")], "a", rows, infos)
    play(live, [*live.main.messages, user("and then?")], "b", rows, infos)
    play(live, [user("a side request: name this chat")], "title", rows, infos)  # shares nothing: segment 1
    saved = RestoredSession(
        id=sid, family=family.name, max_rollback=2, matcher="loose_tool_call", metadata={"episode": 7},
        created_at=1234.5, last_active=time.time() - 50, turns=rows.pop(0), segment_turns=rows, segment_infos=infos,
    )
    return live, saved


def test_every_segment_comes_back_as_it_was_committed(family: ModelFamily) -> None:
    live, saved = live_episode(family)
    registry = Registry()
    made: list[SegmentSet] = []

    def new_segments() -> SegmentSet:
        made.append(factory(family)())
        return made[-1]

    before = time.monotonic()
    assert restore_sessions(registry, family, Restored(sessions=[saved], tombstones=[]), new_segments) == 1
    session = registry.get("ep-1")
    assert session is not None
    # The idle clock continues from the journaled wall-clock time: 50 s idle then, about 50 s idle now.
    assert 45 < before - session.last_active < 60
    assert session.segments is made[0]  # the server's settings (max_segments, ...) from its own factory
    assert session.metadata == {"episode": 7} and session.created_at == 1234.5
    assert len(session.segments) == 2
    for (seg, traj), (want_seg, want_traj) in zip(session.segments.snapshot(), live.snapshot(), strict=True):
        assert seg.info() == want_seg.info()
        assert traj.token_ids.tolist() == want_traj.token_ids.tolist()
        assert traj.loss_mask.tolist() == want_traj.loss_mask.tolist()
        assert traj.logprobs.tolist() == want_traj.logprobs.tolist()
        assert traj.messages == want_traj.messages and traj.records == want_traj.records
    assert session.segments.get(1).info()["reason"] == "new_conversation"


def test_a_restored_session_takes_its_next_turn_as_the_live_one_would(family: ModelFamily) -> None:
    live, saved = live_episode(family)
    registry = Registry()
    restore_sessions(registry, family, Restored(sessions=[saved], tombstones=[]), factory(family))
    restored = registry.require("ep-1").segments
    request = [*live.main.messages, user("next")]
    plan, want = restored.prepare(request, busy={}), live.prepare(request, busy={})
    assert (plan.segment, plan.start) == (0, None) and not plan.turn.rolled_back
    assert plan.turn.prompt_ids.tolist() == want.turn.prompt_ids.tolist()
    # A new segment after the restart gets a fresh id: never one a restored segment has.
    side = restored.reserve(restored.prepare([user("another side request")], busy={}))
    assert side.start is not None and side.segment == 2


def test_a_restored_session_keeps_the_servers_special_token_mode(family: ModelFamily) -> None:
    """Under --special-tokens-in-content engine, a control token's spelling in a later turn is the control token,
    after a restart as before it (the mode comes from the server's fresh trajectories: it is not journaled)."""
    live, saved = live_episode(family, special_tokens="engine")
    registry = Registry()
    restore_sessions(registry, family, Restored(sessions=[saved], tombstones=[]),
                     factory(family, special_tokens="engine"))
    restored = registry.require("ep-1").segments
    request = [*live.main.messages, user("quote: <|im_end|> done")]
    want = live.prepare(request, busy={}).turn.prompt_ids.tolist()
    assert restored.prepare(request, busy={}).turn.prompt_ids.tolist() == want


def test_tombstones_come_back_oldest_first_under_the_bound(family: ModelFamily) -> None:
    registry = Registry(max_tombstones=2)
    tombs = [("a", "was deleted"), ("b", "expired after being idle"), ("c", "was deleted")]
    assert restore_sessions(registry, family, Restored(sessions=[], tombstones=tombs), factory(family)) == 0
    assert [registry.is_tombstoned(s) for s in "abc"] == [False, True, True]
    assert not registry.knows("a")
    with pytest.raises(Exception, match="b expired after being idle"):
        registry.require("b")


def test_a_journal_of_another_family_is_refused(family: ModelFamily, families: dict[str, ModelFamily]) -> None:
    _, saved = live_episode(family)
    other = families["llama3"] if "llama3" in families else next(f for n, f in families.items() if n != family.name)
    with pytest.raises(JournalError, match=f"ep-1 is of model family {family.name!r}"):
        restore_sessions(Registry(), other, Restored(sessions=[saved], tombstones=[]), factory(other))


def test_turns_that_do_not_chain_are_refused_naming_the_session(family: ModelFamily) -> None:
    _, saved = live_episode(family, sid="broken")
    shuffled = RestoredSession(
        id=saved.id, family=saved.family, max_rollback=saved.max_rollback, matcher=saved.matcher,
        metadata=saved.metadata, created_at=saved.created_at, last_active=saved.last_active,
        turns=saved.turns[::-1], segment_turns=saved.segment_turns, segment_infos=saved.segment_infos,
    )
    registry = Registry()
    with pytest.raises(JournalError, match="journal session broken cannot be replayed"):
        restore_sessions(registry, family, Restored(sessions=[shuffled], tombstones=[]), factory(family))
    assert registry.get("broken") is None
