"""Forks (trajectory/forks.py): a child's next turn is the parent's next turn from the fork point, children are
independent of the parent and of each other, a fork shares the stored tokens instead of copying them, and the
journal's replay (restore_trajectory with cuts) rebuilds exactly the forked trajectory."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.tito import MESSAGE_TEXT, Reply, conversations, generate
from trajectory import LinearTrajectory, SegmentSet
from trajectory.errors import ForkPointError
from trajectory.forks import Lineage, parse_fork, plan_fork
from trajectory.restore import restore_trajectory, store_turn
from trajectory.sampling_masks import SamplingMasks

SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fingerprint(traj: LinearTrajectory, owned: bool = True) -> str:
    """Everything a trajectory holds; `owned` False leaves out its bytes (what it holds by reference varies)."""
    info = traj.to_dict()
    if not owned:
        info.pop("nbytes")
    return json.dumps([info, traj.loss_mask.tolist(), traj.logprobs.tolist()])


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def play(family: Any, tools: Any, turns: list[Any], max_rollback: int) -> tuple[LinearTrajectory, list[Any]]:
    traj = LinearTrajectory(family, max_rollback=max_rollback)
    stored = []
    for k, turn in enumerate(turns):
        plan = traj.prepare([*traj.messages, *turn.appended], tools)
        prev_messages, prev_tools = traj.messages, traj.tools
        delta = traj.stage(plan, *generate(family, plan, turn.reply, rid=f"r{k}"))
        stored.append(store_turn(delta, prev_messages, prev_tools))
        traj.apply(delta)
    return traj, stored


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@SETTINGS
@given(data=st.data())
def test_a_childs_next_turn_is_the_parents_next_turn_from_the_fork_point(families, name, data):
    family = families[name]
    tools, turns = data.draw(conversations(family, reasoning=True, max_turns=5))
    parent, stored = play(family, tools, turns, max_rollback=len(turns))
    at = data.draw(st.integers(1, len(turns)), label="at")
    before = fingerprint(parent)
    a, b = parent.fork(at), parent.fork(at)
    request = [*parent.messages[:parent.checkpoints[at - 1].num_messages], user(data.draw(MESSAGE_TEXT))]
    # what the parent sends for that request (a rollback to `at` when it is earlier than the end) is what a child sends
    reference = parent.prepare(request, tools)
    plan = a.prepare(request, tools)
    assert plan.prompt_ids.tolist() == reference.prompt_ids.tolist()
    assert plan.new_token_start == reference.new_token_start and plan.rolled_back == 0
    # the child commits a turn: the parent and the sibling are untouched
    a.commit(plan, *generate(family, plan, Reply(content="child"), rid="c"))
    assert fingerprint(parent) == before
    assert b.token_ids.tolist() == parent.token_ids[:parent.checkpoints[at - 1].num_tokens].tolist()
    # the parent rolls back into the shared prefix and commits: the children keep what they had
    kept_b = fingerprint(b)
    retry = parent.prepare(request, tools)
    parent.commit(retry, *generate(family, retry, Reply(content="parent"), rid="p"))
    assert fingerprint(b) == kept_b
    assert a.records[-1].message["content"] == "child"
    # the journal's replay of the parent's turns with the fork's cut rebuilds the child as forked
    replayed = restore_trajectory(family, stored, max_rollback=len(turns), cuts=[(len(turns), at)])
    assert fingerprint(replayed) == kept_b


def test_fork_points_are_turn_boundaries(families):
    family = families["qwen3"]
    traj = LinearTrajectory(family)
    with pytest.raises(ForkPointError):
        traj.fork()
    plan = traj.prepare([user("hi")])
    traj.commit(plan, *generate(family, plan, Reply(content="yo"), rid="r"))
    for bad in (0, 2, -1):
        with pytest.raises(ForkPointError):
            traj.fork(bad)
    with pytest.raises(ForkPointError):
        parse_fork(2, "middle", 8)
    assert parse_fork(3, None, 8) == (3, None) and parse_fork(3, 1, 8) == (3, 1)
    for n in (0, 9, True, "2"):
        with pytest.raises(Exception, match="'n'"):
            parse_fork(n, None, 8)


def test_a_fork_of_32k_tokens_shares_them(families):
    """The bytes a child costs do not grow with the history: ~9 bytes per token copied would be 288 KiB here."""
    family = families["qwen3"]
    traj = LinearTrajectory(family)
    plan = traj.prepare([user("w " * 16_000)])
    assert len(plan.prompt_ids) > 15_000
    traj.commit(plan, *generate(family, plan, Reply(content="x " * 200), rid="r"))
    plan = traj.prepare([*traj.messages, user("v " * 16_000)])
    traj.commit(plan, *generate(family, plan, Reply(content="y"), rid="s"))
    assert traj.num_tokens >= 32_000
    segments = SegmentSet(lambda: LinearTrajectory(family))
    segments.get(0).trajectory = traj
    n = 16
    tracemalloc.start()
    try:
        start = tracemalloc.take_snapshot()
        forked = plan_fork(segments, lambda: SegmentSet(lambda: LinearTrajectory(family)), n, None)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(start, "filename"))
    finally:
        tracemalloc.stop()
    per_child = grown / n
    print(f"fork of {traj.num_tokens} tokens: {per_child:.0f} bytes per child")
    assert per_child < 4096
    assert all(np.shares_memory(c.main.token_ids, traj.token_ids) for c in forked.children)
    assert forked.position == traj.num_tokens and forked.turns == 2


def test_lineage_round_trips_and_deepens():
    root = Lineage(parent="r", segment=0, turns=2, position=10, group="g", root="r", depth=1, version=2,
                   cuts=((2, 2),))
    assert Lineage.of_json(json.loads(json.dumps(root.to_json()))) == root
    assert set(root.info()) == {"parent_session", "fork_segment", "fork_turns", "fork_position", "group",
                                "root_session", "depth"}


def test_a_fork_keeps_the_sampling_masks_up_to_its_point_and_its_own_from_there(families):
    """Issues 39 + 42: a child's rows are the parent's up to the fork (a turn past it is not the child's), and rows
    the child then appends are its own (the mask buffer is appended in place, unlike the shared token buffer)."""
    family = families["qwen3"]

    def commit(traj: LinearTrajectory, text: str, row_extra: int) -> None:
        plan = traj.prepare([*traj.messages, user(text)])
        result, message = generate(family, plan, Reply(content=text), rid=text)
        ids = result.output_ids.tolist()
        masks = SamplingMasks.from_rows([[t, row_extra] for t in ids], [-0.1] * len(ids))
        traj.commit(plan, dataclasses.replace(result, sampling_masks=masks), message)

    parent = LinearTrajectory(family)
    commit(parent, "one", 1)
    commit(parent, "two", 2)
    child = parent.fork(1)
    end = parent.checkpoints[0].num_tokens
    parent_rows = parent.sampling_masks
    child_rows = child.sampling_masks
    assert parent_rows is not None and child_rows is not None and len(child_rows) == end == child.num_tokens
    assert child_rows.ids.tolist() == parent_rows.rows(0, end).ids.tolist()
    commit(child, "three", 3)
    assert parent.sampling_masks is not None and parent.sampling_masks.ids.tolist() == parent_rows.ids.tolist()
    after = child.sampling_masks
    assert after is not None and len(after) == child.num_tokens and 3 in after.ids.tolist()
    assert 2 not in after.ids.tolist()  # the parent's second turn is not the child's


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@SETTINGS
@given(data=st.data())
def test_a_fork_at_the_primed_prompt_sends_what_a_fresh_session_sends(families, name, data):
    """A GRPO group's parent primes its prompt (rendered once) and forks at it: each child's turns send exactly the
    ids an unforked session of the same conversation sends, and the child's first turn renders nothing."""
    family = families[name]
    tools, turns = data.draw(conversations(family, reasoning=True, max_turns=3))
    first = turns[0].appended
    parent = LinearTrajectory(family)
    primed = parent.prime(first, tools)
    parent.set_primed(primed)
    segments = SegmentSet(lambda: LinearTrajectory(family))
    segments.get(0).trajectory = parent
    forked = plan_fork(segments, lambda: SegmentSet(lambda: LinearTrajectory(family)), 2, 0)
    assert forked.turns == 0 and forked.position == primed.num_tokens > 0
    a, b = (c.main for c in forked.children)
    fresh = LinearTrajectory(family)
    with pytest.MonkeyPatch.context() as m:  # no render for the primed request
        m.setattr("trajectory.linear.first_turn_ids", lambda *a, **k: pytest.fail("rendered a primed prompt"))
        plan_a = a.prepare([dict(m) for m in first], tools)
    reference = fresh.prepare(first, tools)
    assert plan_a.prompt_ids.tolist() == reference.prompt_ids.tolist()
    for k, turn in enumerate(turns):
        plan = a.prepare([*a.messages, *turn.appended], tools) if k else plan_a
        ref = fresh.prepare([*fresh.messages, *turn.appended], tools) if k else reference
        assert plan.prompt_ids.tolist() == ref.prompt_ids.tolist()
        a.commit(plan, *generate(family, plan, turn.reply, rid=f"r{k}"))
        fresh.commit(ref, *generate(family, ref, turn.reply, rid=f"r{k}"))
    # the same trajectory, but for its bytes: the child holds the primed prompt by reference (TokenBuffer.adopt_head)
    assert fingerprint(a, owned=False) == fingerprint(fresh, owned=False)
    # (its own arrays begin after it; their bytes vs a fresh buffer's depend on both capacities' rounding)
    assert a._buffer.shared_head == primed.num_tokens and fresh._buffer.shared_head == 0
    assert b.num_tokens == 0 and not b.checkpoints and parent.num_tokens == 0  # the sibling and parent untouched
    # another first request is rendered as usual
    other = [*first, user("and one more")]
    assert b.prepare(other, tools).prompt_ids.tolist() == LinearTrajectory(family).prepare(other, tools) \
        .prompt_ids.tolist()
    # the journal's replay of a fork at the prompt: an empty trajectory (it renders its first turn again)
    assert restore_trajectory(family, [], cuts=[(0, 0)]).num_tokens == 0


def test_priming_is_before_the_first_turn_and_a_prompt_fork_needs_it(families):
    family = families["qwen3"]
    traj = LinearTrajectory(family)
    with pytest.raises(ForkPointError):
        traj.fork(0)  # nothing primed
    primed = traj.prime([user("hi")])
    plan = traj.prepare([user("hi")])
    traj.commit(plan, *generate(family, plan, Reply(content="yo"), rid="r"))
    with pytest.raises(ForkPointError):
        traj.set_primed(primed)  # a turn came first
    with pytest.raises(ForkPointError):
        traj.prime([user("hi")])
