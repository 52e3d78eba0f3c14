"""trajectory.restore: replaying stored turns rebuilds the live trajectory exactly.

Random episodes (hypothesis) on the real tokenizers mix appended user and tool turns, tool calls, reasoning,
alternative stop tokens (which the next turn trims), length-cut replies, changed tools and retries that roll back
the last turn. After every commit the stored turns, replayed into a fresh trajectory, must give the same tokens,
logprobs, loss mask, messages, records, checkpoints and rollback counts -- and the same next prompt.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import FAMILIES
from support.tito import Reply, generate
from trajectory import LinearTrajectory
from trajectory.errors import InvariantError
from trajectory.restore import StoredTurn, load_turn, restore_trajectory, store_turn

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
OTHER_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]



def state(traj: LinearTrajectory) -> str:
    info = traj.to_dict(include_routed_experts=True)
    return json.dumps([info, traj.logprobs.tolist(), traj.loss_mask.tolist(), traj.rollbacks], sort_keys=True)


def commit_stored(traj: LinearTrajectory, messages: list[dict[str, Any]], tools: Any, reply: Reply,
                  rid: str) -> StoredTurn:
    """One live turn the way the journaling server does it: stage, store against the old lists, apply."""
    plan = traj.prepare(messages, tools)
    result, message = generate(traj.family, plan, reply, rid=rid)
    delta = traj.stage(plan, result, message)
    stored = store_turn(delta, traj.messages, traj.tools)
    traj.apply(delta)
    return stored


replies = st.builds(
    Reply,
    content=st.text(alphabet="abc xyz.é\n{}", min_size=0, max_size=30),
    reasoning=st.none() | st.text(alphabet="hmm ok", min_size=1, max_size=12),
    tool_calls=st.sampled_from([(), (("calc", '{"x": 1}'),)]),
    stop=st.sampled_from(["eos", "eos", "alt", "length"]),
)
steps = st.lists(
    st.tuples(st.sampled_from(["user", "tool", "retry", "tools_change"]), replies), min_size=1, max_size=7
)


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(family_name=st.sampled_from(FAMILIES), script=steps)
def test_replaying_stored_turns_gives_the_live_trajectory(families, family_name, script) -> None:
    family = families[family_name]
    live = LinearTrajectory(family, max_rollback=1)
    stored: list[StoredTurn] = []
    tools: Any = TOOLS
    for i, (kind, reply) in enumerate(script):
        if kind == "retry" and live.checkpoints:
            # The agent re-sends the last request: the stored reply is dropped (a one-step rollback).
            base = live.checkpoints[-1].num_messages - 1
            messages = [*live.messages[:base]]
            if not messages:
                messages = [{"role": "user", "content": "again"}]
        elif kind == "tool" and live.messages and live.messages[-1].get("tool_calls"):
            call = live.messages[-1]["tool_calls"][0]
            messages = [*live.messages, {"role": "tool", "tool_call_id": call["id"], "content": f"result {i}"}]
        else:
            if kind == "tools_change":
                tools = OTHER_TOOLS if tools is TOOLS else TOOLS
            messages = [*live.messages, {"role": "user", "content": f"question {i}"}]
        stored.append(commit_stored(live, messages, tools, reply, rid=f"r{i}"))
        restored = restore_trajectory(family, stored, max_rollback=1)
        assert state(restored) == state(live)
        assert np.array_equal(restored.token_ids, live.token_ids)
    # The next turn of the restored trajectory is the live one's: same prompt.
    nxt = [*live.messages, {"role": "user", "content": "next"}]
    assert restored.prepare(nxt, tools).prompt_ids.tolist() == live.prepare(nxt, tools).prompt_ids.tolist()


def test_a_turn_replayed_out_of_order_is_refused(families) -> None:
    family = families["qwen3"]
    traj = LinearTrajectory(family)
    first = commit_stored(traj, [{"role": "user", "content": "a"}], None, Reply("A"), rid="a")
    second = commit_stored(traj, [*traj.messages, {"role": "user", "content": "b"}], None, Reply("B"), rid="b")
    with pytest.raises(InvariantError):
        restore_trajectory(family, [second])
    with pytest.raises(InvariantError):
        restore_trajectory(family, [first, first])
    fresh = LinearTrajectory(family)
    fresh.apply(load_turn(first, fresh))
    assert fresh.version == 1


def test_stored_turns_are_deltas(families) -> None:
    """Each stored turn carries its new tokens and messages, not the history: sizes do not grow with the turn."""
    family = families["qwen3"]
    traj = LinearTrajectory(family)
    sizes = []
    messages: list[dict[str, Any]] = []
    for i in range(12):
        messages = [*traj.messages, {"role": "user", "content": f"question number {i}"}]
        s = commit_stored(traj, messages, TOOLS, Reply(f"answer number {i}"), rid=f"r{i}")
        sizes.append(len(s.prompt_tail) + len(s.output_ids) + len(s.messages) + len(s.tools or b""))
        if i:
            assert s.messages_kept == len(messages) - 1 and not s.tools_changed
    assert max(sizes[2:]) < 2 * min(sizes[2:])
    assert traj.num_tokens * 4 > 5 * sizes[-1]


def test_a_turns_adapter_revision_is_stored_and_restored(families) -> None:
    """The LoRA adapter revision that sampled a turn (issue 40) lives in the stored record: no schema change."""
    import dataclasses

    family = families["qwen3"]
    traj = LinearTrajectory(family)
    plan = traj.prepare([{"role": "user", "content": "a"}], None)
    result, message = generate(family, plan, Reply("A"), rid="a")
    delta = traj.stage(plan, dataclasses.replace(result, adapter="a1", adapter_revision="2"), message)
    stored = store_turn(delta, traj.messages, traj.tools)
    traj.apply(delta)
    base = commit_stored(traj, [*traj.messages, {"role": "user", "content": "b"}], None, Reply("B"), rid="b")
    restored = restore_trajectory(family, [stored, base])
    assert [(r.adapter, r.adapter_revision) for r in restored.records] == [("a1", "2"), (None, None)]
    assert state(restored) == state(traj)
