"""SegmentSet: histories that are not one line (compaction, sub-agents, side requests, edits) become segments.

The properties drive random episodes of continued turns, compactions, retries and new conversations through a
SegmentSet and check it against a plain model of the documented matching rule, the single-segment equivalence with
LinearTrajectory, and the sample invariants: one sample per segment, each loss mask exactly on its own segment's
sampled tokens, nothing sampled lost.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.tito import MESSAGE_TEXT, Reply, conversations, generate, replies
from trajectory import (
    LinearTrajectory,
    ModelFamily,
    SegmentSet,
    build_merged_sample,
    build_segment_samples,
    samples_from_json,
    samples_to_json,
)
from trajectory.errors import RollbackLimitError
from trajectory.session_segments import SegmentLimitError, SegmentPlan

SETTINGS = settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])



def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def segment_set(family: ModelFamily, max_rollback: int = 1, **kwargs: Any) -> SegmentSet:
    return SegmentSet(lambda: LinearTrajectory(family, max_rollback=max_rollback), **kwargs)


def play(segments: SegmentSet, request: list[dict[str, Any]], reply: Reply, rid: str,
         busy: frozenset[int] = frozenset()) -> SegmentPlan:
    plan = segments.reserve(segments.prepare(request, None, busy=dict.fromkeys(busy, request[0])))
    segments.commit(plan, *generate(segments.main.family, plan.turn, reply, rid=rid))
    return plan


def fingerprint(segments: SegmentSet) -> str:
    return json.dumps([[s.info(), s.trajectory.to_dict(), s.trajectory.loss_mask.tolist()] for s in segments]
                      + [sorted(segments.reserved)])


def shared(stored: list[dict[str, Any]], request: list[dict[str, Any]]) -> int:
    n = 0
    while n < min(len(stored), len(request)) and stored[n] == request[n]:
        n += 1
    return n


def expected_segment(segments: SegmentSet, request: list[dict[str, Any]], busy: frozenset[int]) -> int | None:
    """The documented rule, written plainly: of the segments whose rollback window the request fits, the longest
    shared prefix, then the fewest turns rolled back, then a free one, then the lowest id; a segment with turns
    fits only a request that shares its first message."""
    fits = []
    for segment in segments:
        traj = segment.trajectory
        matched = shared(traj.messages, request)
        keep = sum(c.num_messages <= matched for c in traj.checkpoints)
        dropped = len(traj.checkpoints) - keep
        if dropped <= traj.max_rollback and (matched or not traj.checkpoints):
            fits.append((-matched, dropped, segment.id in busy, segment.id))
    return min(fits)[3] if fits else None


def kept_sampled_tokens(segments: SegmentSet) -> int:
    """Completion tokens over every kept turn, less those a later turn replaced (a non-template stop token)."""
    return sum(r.completion_len - r.trimmed for s in segments for r in s.trajectory.records)


def check_samples(segments: SegmentSet) -> None:
    samples = build_segment_samples(segments.snapshot())
    with_turns = [s for s in segments if s.trajectory.records]
    assert len(samples) == len(with_turns)
    assert sum(int(s.loss_mask.sum()) for s in samples) == kept_sampled_tokens(segments)
    for sample, segment in zip(samples, with_turns, strict=True):
        traj = segment.trajectory
        mask = np.zeros(traj.num_tokens, dtype=np.uint8)
        for k, record in enumerate(traj.records):
            end = record.prompt_len + record.completion_len
            trimmed = traj.records[k + 1].trimmed if k + 1 < len(traj.records) else 0
            mask[record.prompt_len:end - trimmed] = 1
        assert sample.tokens.tolist() == traj.token_ids.tolist()
        assert sample.loss_mask.tolist() == mask.tolist()
        assert not sample.rollout_log_probs[mask == 0].any()
        if len(segments) == 1:
            assert sample.metadata == build_merged_sample(traj).metadata  # exactly as a single-line session
        else:
            assert {k: sample.metadata[k] for k in segment.info()} == segment.info()
    assert [s.metadata for s in samples_from_json(samples_to_json(samples))] == [s.metadata for s in samples]


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@SETTINGS
@given(data=st.data())
def test_single_line_sessions_are_linear_trajectories(families, name, data):
    """Without divergence a SegmentSet is its first segment: the same prompts, records and the same one sample."""
    family = families[name]
    tools, turns = data.draw(conversations(family, reasoning=True))
    segments, linear = segment_set(family), LinearTrajectory(family)
    for k, turn in enumerate(turns):
        plan = segments.prepare([*segments.main.messages, *turn.appended], tools)
        reference = linear.prepare([*linear.messages, *turn.appended], tools)
        assert plan.segment == 0 and not plan.new_segment
        assert plan.turn.prompt_ids.tolist() == reference.prompt_ids.tolist()
        result, message = generate(family, plan.turn, turn.reply, rid=f"r{k}")
        segments.commit(segments.reserve(plan), result, message)
        linear.commit(reference, result, message)
    assert len(segments) == 1 and segments.main.to_dict() == linear.to_dict()
    [sample] = build_segment_samples(segments.snapshot())
    reference_sample = build_merged_sample(linear)
    assert sample.metadata == reference_sample.metadata
    assert sample.loss_mask.tolist() == reference_sample.loss_mask.tolist()


OPS = ("continue", "continue", "new", "compact", "retry")


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@SETTINGS
@given(data=st.data())
def test_random_episodes_keep_every_sampled_token(families, name, data):
    family = families[name]
    max_rollback = data.draw(st.integers(0, 2), label="max_rollback")
    max_segments = data.draw(st.integers(1, 5), label="max_segments")
    segments = segment_set(family, max_rollback, max_segments=max_segments)
    reply = replies(family, reasoning=False)
    play(segments, [{"role": "system", "content": "main agent"}, user("task")], data.draw(reply), "r0")
    commits, rolled_back, latest = 1, 0, 0
    for step in range(1, data.draw(st.integers(1, 8), label="steps") + 1):
        op = data.draw(st.sampled_from(OPS), label="op")
        ids = sorted(s.id for s in segments)
        target = segments.get(data.draw(st.sampled_from(ids), label="segment")).trajectory
        if op == "continue":
            request = [*target.messages, user(data.draw(MESSAGE_TEXT, label="text"))]
        elif op == "new":
            request = [{"role": "system", "content": f"sub-agent {step}"}, user(data.draw(MESSAGE_TEXT))]
        elif op == "compact":
            request = [target.messages[0], user(f"summary {step}: {data.draw(MESSAGE_TEXT)}")]
        else:
            request = target.messages[:target.checkpoints[-1].num_messages - 1]
        busy = frozenset(data.draw(st.sets(st.sampled_from(ids)), label="busy"))
        in_flight = {i: segments.get(i).trajectory.messages[0] for i in busy}
        expected = expected_segment(segments, request, busy)
        before = fingerprint(segments)
        if expected is None and len(segments) >= max_segments:
            with pytest.raises(SegmentLimitError) as info:
                segments.prepare(request, None, busy=in_flight)
            assert info.value.status == 400 and fingerprint(segments) == before
            continue
        plan = segments.prepare(request, None, busy=in_flight)
        assert fingerprint(segments) == before  # prepare is pure
        again = segments.prepare(request, None, busy=in_flight)  # and deterministic
        assert (again.segment, again.turn.prompt_ids.tolist()) == (plan.segment, plan.turn.prompt_ids.tolist())
        if expected is not None:
            assert not plan.new_segment and plan.segment == expected
            rolled_back += plan.turn.rolled_back
        else:
            start = plan.start
            assert start is not None and plan.turn.new_token_start == 0  # rendered in full
            sharing = {s.id: shared(s.trajectory.messages, request) for s in segments}
            most = max(sharing.values())
            assert start.shared_messages == most
            if most:
                assert start.reason == "divergence" and sharing[start.parent] == most
                assert start.parent == min((i for i in sharing if sharing[i] == most), key=lambda i: (i != latest, i))
            else:
                assert start.reason == "new_conversation" and start.parent == latest
            assert start.branch_turn == len(segments.get(start.parent).trajectory.records)
        plan = segments.reserve(plan)
        segments.commit(plan, *generate(family, plan.turn, data.draw(reply), rid=f"r{step}"))
        commits += 1
        latest = plan.segment
        assert len(segments) <= max_segments and not segments.reserved
        check_samples(segments)
    assert sum(len(s.trajectory.records) for s in segments) == commits - rolled_back
    check_samples(segments)


def test_compaction_after_three_turns_starts_a_segment_and_keeps_all_five_turns(families):
    family = families["qwen3"]
    segments = segment_set(family)
    system = {"role": "system", "content": "You are a coding agent."}
    for k in range(3):
        play(segments, [system, *segments.main.messages[1:], user(f"step {k}")], Reply(f"did {k}"), f"m{k}")
    compacted = [system, user("Summary of the work so far: steps 0-2 done. Continue.")]
    plan = play(segments, compacted, Reply("continuing"), "c0")
    start = plan.start
    assert start is not None and plan.segment == 1
    assert (start.parent, start.branch_turn, start.reason, start.divergence, start.shared_messages) == (
        0, 3, "divergence", "content", 1)
    play(segments, [*segments.get(1).trajectory.messages, user("and the last step")], Reply("done"), "c1")
    samples = build_segment_samples(segments.snapshot())
    assert [s.metadata["segment"] for s in samples] == [0, 1]
    assert [s.metadata["num_turns"] for s in samples] == [3, 2]
    completions = sum(r.completion_len for s in segments for r in s.trajectory.records)
    assert sum(int(s.loss_mask.sum()) for s in samples) == completions


def test_reject_policy_is_todays_400(families):
    segments = segment_set(families["qwen3"], on_divergence="reject")
    for k in range(2):
        play(segments, [*segments.main.messages, user(f"q{k}")], Reply("a"), f"r{k}")
    before = fingerprint(segments)
    with pytest.raises(RollbackLimitError) as info:
        segments.prepare([user("something else")])
    assert info.value.status == 400 and fingerprint(segments) == before


def test_reserved_segments_count_against_the_bound_and_get_distinct_ids(families):
    family = families["qwen3"]
    segments = segment_set(family, max_segments=3)
    play(segments, [user("main")], Reply("a"), "r0")
    first = segments.reserve(segments.prepare([user("side request")]))
    second = segments.reserve(segments.prepare([user("sub-agent")]))
    assert (first.segment, second.segment) == (1, 2) and segments.reserved == {1, 2}
    with pytest.raises(SegmentLimitError, match="--max-segments"):
        segments.prepare([user("one too many")])
    segments.commit(second, *generate(family, second.turn, Reply("s"), rid="s"))  # out of order
    segments.unreserve(first)  # its turn ended without a commit
    assert sorted(s.id for s in segments) == [0, 2] and not segments.reserved
    plan = segments.reserve(segments.prepare([user("later")]))
    assert plan.segment == 3  # ids are never reused


def test_a_request_beside_an_in_flight_first_turn_starts_a_segment(families):
    segments = segment_set(families["qwen3"])
    in_flight = {0: {"role": "user", "content": "main task"}}
    assert segments.prepare([user("main task")], busy=in_flight).segment == 0  # a duplicate: the caller's 409
    side = segments.prepare([user("a title for this chat")], busy=in_flight)
    assert side.start is not None and (side.start.reason, side.start.parent, side.start.branch_turn) == (
        "new_conversation", 0, 0)
    assert segment_set(families["qwen3"], on_divergence="reject").prepare(
        [user("a title")], busy=in_flight).segment == 0  # one line: the caller's 409, as before


def test_a_busy_segment_loses_a_tie_to_an_identical_free_one(families):
    family = families["qwen3"]
    segments = segment_set(family, max_rollback=0)
    play(segments, [user("main")], Reply("m"), "r0")
    for rid in ("a", "b"):  # two sub-agents given the same task sample the same reply
        play(segments, [user("same task")], Reply("same"), rid)
    request = [*segments.get(1).trajectory.messages, user("next")]
    assert segments.prepare(request).segment == 1
    assert segments.prepare(request, busy={1: request[0]}).segment == 2
    assert segments.prepare(request, busy={1: request[0], 2: request[0]}).segment == 1  # both busy: the 409


def test_merge_continues_a_segment_whose_tokens_the_new_render_extends(families):
    """Qwen3 does not render tool-call ids: a history whose ids were rewritten diverges from the stored messages
    (beyond max_rollback=0) but renders the very tokens the model saw and sampled. Merged, it stays one sequence."""
    family = families["qwen3"]
    call = (("calc", '{"x": 1}'),)
    for merge in (False, True):
        segments = segment_set(family, max_rollback=0, merge=merge)
        play(segments, [user("compute")], Reply("", tool_calls=call), "r0")
        play(segments, [*segments.main.messages, {"role": "tool", "content": "1", "tool_call_id": "call_r0_0"}],
             Reply("one"), "r1")
        rewritten = json.loads(json.dumps(segments.main.messages))
        rewritten[1]["tool_calls"][0]["id"] = rewritten[2]["tool_call_id"] = "toolu_01"
        stored = segments.main.num_tokens
        plan = play(segments, [*rewritten, user("and now?")], Reply("two"), "r2")
        if not merge:
            assert plan.new_segment and len(segments) == 2
            continue
        assert plan.segment == 0 and plan.turn.merged and plan.turn.new_token_start == stored
        assert len(segments) == 1 and segments.main.records[-1].merged
        assert segments.main.messages[1]["tool_calls"][0]["id"] == "toolu_01"  # the request's messages now
        [sample] = build_segment_samples(segments.snapshot())
        assert int(sample.loss_mask.sum()) == sum(r.completion_len for r in segments.main.records)
        # the turns before the merge are no longer rollback targets: a retry of them starts a segment
        assert segments.prepare([user("compute")]).new_segment
        # and the merged history continues as usual
        assert segments.prepare([*segments.main.messages, user("more")]).turn.new_token_start == \
            segments.main.num_tokens


def test_a_session_of_several_segments_keeps_no_sent_history(families):
    """A resent history's bytes stand for one segment's stored messages (SentHistory); with several segments every
    request is read as sent, since those stored messages may carry what the agent left out (reasoning) and would be
    compared with another segment's history."""
    segments = segment_set(families["qwen3"])
    first = [user("one")]
    plan = segments.reserve(segments.prepare(first, None, messages_json=json.dumps(first).encode()))
    segments.commit(plan, *generate(segments.main.family, plan.turn, Reply("a"), rid="r0"))
    assert segments.main.sent is not None and segments.main.sent.messages == first
    other = [user("a side request")]
    plan = segments.reserve(segments.prepare(other, None, messages_json=json.dumps(other).encode()))
    segments.commit(plan, *generate(segments.main.family, plan.turn, Reply("b"), rid="r1"))
    assert len(segments) == 2 and all(s.trajectory.sent is None for s in segments)
    again = [*segments.main.messages, user("two")]
    plan = segments.reserve(segments.prepare(again, None, messages_json=json.dumps(again).encode()))
    segments.commit(plan, *generate(segments.main.family, plan.turn, Reply("c"), rid="r2"))
    assert all(s.trajectory.sent is None for s in segments)
