"""LinearTrajectory examples: prepare purity, commit invariants, rollback limits, matching, storage, reports."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import FAMILIES, RERENDER_MOVES_GLUE
from support.tito import Reply, engine_body, generate
from trajectory import LinearTrajectory, ModelFamily, decode_generate_response
from trajectory.buffer import TokenBuffer
from trajectory.errors import InvariantError, RequestValidationError, RollbackLimitError
from trajectory.messages import normalize_tools
from trajectory.tito import continuation_ids

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = (("calc", '{"expr": "2+2", "meta": {"ü": [1, null]}}'),)



@pytest.fixture
def qwen(families) -> ModelFamily:
    return families["qwen3"]


def turn(traj: LinearTrajectory, appended: list[dict[str, Any]], reply: Reply, tools: Any = None, rid: str = "r"):
    plan = traj.prepare([*traj.messages, *appended], tools)
    result, message = generate(traj.family, plan, reply, rid=rid)
    return plan, traj.commit(plan, result, message)


def snapshot(traj: LinearTrajectory) -> str:
    return json.dumps([traj.version, traj.to_dict(), traj.logprobs.tolist(), traj.loss_mask.tolist()])


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize("name", FAMILIES)
def test_first_turn_renders_and_prepare_is_pure(families, name):
    family = families[name]
    traj = LinearTrajectory(family)
    messages = [{"role": "system", "content": "Be brief."}, user("2+2?")]
    before = snapshot(traj)
    plan = traj.prepare(messages, TOOLS)
    assert snapshot(traj) == before
    assert plan.prompt_ids.dtype == np.int32 and not plan.prompt_ids.flags.writeable
    assert plan.prompt_ids.tolist() == family.encode(family.render(messages, TOOLS, add_generation_prompt=True))
    assert (plan.new_token_start, plan.base_checkpoints, plan.rolled_back, plan.version) == (0, 0, 0, 0)
    record = traj.commit(plan, *generate(family, plan, Reply("Using calc.", tool_calls=CALL), rid="r0"))
    assert traj.version == 1 and traj.num_tokens == record.prompt_len + record.completion_len
    assert traj.messages[-1]["tool_calls"][0]["id"] == "call_r0_0"
    assert traj.loss_mask.tolist() == [0] * record.prompt_len + [1] * record.completion_len
    assert [(c.num_messages, c.num_tokens) for c in traj.checkpoints] == [(3, traj.num_tokens)]


def test_stale_plan_is_an_invariant_error(qwen):
    traj = LinearTrajectory(qwen)
    plan_a, plan_b = traj.prepare([user("a")]), traj.prepare([user("b")])
    traj.commit(plan_a, *generate(qwen, plan_a, Reply("A"), rid="a"))
    before = snapshot(traj)
    with pytest.raises(InvariantError, match="stale plan") as info:
        traj.commit(plan_b, *generate(qwen, plan_b, Reply("B"), rid="b"))
    assert info.value.status == 500 and snapshot(traj) == before


def test_prompt_that_does_not_extend_the_stored_ids_is_refused(qwen):
    traj = LinearTrajectory(qwen)
    turn(traj, [user("a")], Reply("A"))
    plan = traj.prepare([*traj.messages, user("b")])
    tampered = plan.prompt_ids.copy()
    tampered[3] += 1
    before = snapshot(traj)
    with pytest.raises(InvariantError, match="not a prefix"):
        traj.commit(dataclasses.replace(plan, prompt_ids=tampered), *generate(qwen, plan, Reply("B"), rid="b"))
    with pytest.raises(InvariantError, match="allows 1"):
        traj.commit(dataclasses.replace(plan, trimmed=2), *generate(qwen, plan, Reply("B"), rid="b"))
    result, _ = generate(qwen, plan, Reply("B"), rid="b")
    with pytest.raises(InvariantError, match="role 'user'"):
        traj.commit(plan, result, user("not a reply"))
    assert snapshot(traj) == before


def test_a_continuation_that_adds_nothing_is_400(qwen):
    traj = LinearTrajectory(qwen)
    turn(traj, [user("a")], Reply("A"))
    with pytest.raises(RequestValidationError, match="adds no message") as info:
        traj.prepare(list(traj.messages))
    assert info.value.status == 400


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("canned_last", [False, True])
def test_an_assistant_message_the_model_did_not_generate_is_prompt(families, name, canned_last):
    """An agent injects a canned assistant turn: it is appended as prompt tokens (mask 0), not refused."""
    family = families[name]
    traj = LinearTrajectory(family)
    turn(traj, [user("q1")], Reply("a1", tool_calls=CALL), tools=TOOLS, rid="r0")
    canned = {"role": "assistant", "content": "Canned: I will now summarise."}
    appended = [{"role": "tool", "tool_call_id": "call_r0_0", "content": "4"}, canned]
    if not canned_last:
        appended.append(user("go on"))
    plan, record = turn(traj, appended, Reply("a2"), tools=TOOLS, rid="r1")
    assert plan.rolled_back == 0 and plan.new_token_start == traj.checkpoints[0].num_tokens
    new = family.decode(plan.prompt_ids[plan.new_token_start:])
    probe = [user("x"), *appended[1:]]  # what the template writes as the generation prompt after these messages
    generation_prompt = family.render(probe, None, True)[len(family.render(probe, None, False)):]
    assert "Canned: I will now summarise." in new and new.endswith(generation_prompt)
    mask = traj.loss_mask
    first = traj.records[0]
    sampled = np.zeros(traj.num_tokens, dtype=bool)
    for r in traj.records:
        sampled[r.prompt_len:r.prompt_len + r.completion_len] = True
    assert mask.astype(bool).tolist() == sampled.tolist()  # exactly the generated tokens, the canned turn is 0
    assert record.prompt_len > first.prompt_len + first.completion_len
    assert traj.messages[-2 if canned_last else -3] == {"role": "assistant", "content": canned["content"]}
    # The canned message is history like any other: the next turn repeats it and appends.
    plan = traj.prepare([*traj.messages, user("q3")], TOOLS)
    trim = family.trimmed_tokens(traj.records[-1].last_completion_token)  # harmony's `<|return|>` becomes `<|end|>`
    assert plan.rolled_back == 0 and plan.new_token_start == traj.num_tokens - trim


def test_rollback_limit(qwen):
    traj = LinearTrajectory(qwen, max_rollback=1)
    turn(traj, [user("q1")], Reply("a1"))
    turn(traj, [user("q2")], Reply("a2"))
    before = snapshot(traj)
    # Diverging inside the first turn drops both checkpoints: more than allowed, and nothing changes.
    with pytest.raises(
        RollbackLimitError, match=r"diverges at message 0 \(content\); rolling back 2 turns exceeds max_rollback=1"
    ):
        traj.prepare([user("other"), *traj.messages[1:]])
    assert snapshot(traj) == before
    # Regenerating the last turn (same request as before it) rolls back exactly one checkpoint.
    plan = traj.prepare(traj.messages[:3])
    assert (plan.rolled_back, plan.base_checkpoints, plan.new_token_start) == (1, 1, traj.checkpoints[0].num_tokens)
    assert plan.rollback_reason == "retry"
    traj.commit(plan, *generate(qwen, plan, Reply("a2 again"), rid="r2b"))
    assert [m["content"] for m in traj.messages] == ["q1", "a1", "q2", "a2 again"]
    assert len(traj.records) == 2 and traj.records[-1].rolled_back == 1
    assert traj.records[-1].rollback_reason == "retry"
    # Visible in the records even though the dropped turn's record is gone.
    info = traj.to_dict()
    assert (info["rollbacks"], info["rollbacks_by_reason"]) == (1, {"retry": 1})
    assert info["records"][-1]["rollback_reason"] == "retry"
    assert traj.snapshot().to_dict()["rollbacks_by_reason"] == {"retry": 1}


@pytest.mark.parametrize("name", FAMILIES)
def test_tools_belong_to_the_turn_not_to_the_history(families, name):
    """A later turn that omits or changes `tools` is matched on its messages and rendered with its own tools."""
    family = families[name]
    other = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    for later_tools in (None, [], other, list(reversed([*TOOLS, *other]))):
        traj = LinearTrajectory(family, max_rollback=0)  # any divergence would be a 400
        turn(traj, [user("q1")], Reply("", tool_calls=CALL), tools=TOOLS, rid="r0")
        appended = [{"role": "tool", "tool_call_id": "call_r0_0", "content": "4"}, user("q2")]
        plan = traj.prepare([*traj.messages, *appended], later_tools)
        assert (plan.rolled_back, plan.new_token_start) == (0, traj.num_tokens)
        trim, expected = continuation_ids(family, traj.records[0].last_completion_token,
                                          family.appended_messages([*traj.messages, *appended], len(traj.messages)),
                                          normalize_tools(later_tools))
        assert plan.prompt_ids[plan.new_token_start - trim:].tolist() == expected.tolist()
        traj.commit(plan, *generate(family, plan, Reply("done"), rid="r1"))
        assert traj.tools == normalize_tools(later_tools) and traj.prompt_tools == TOOLS
        # re-rendered with the tools in the stored head (Mistral's encoder moves them to the last user message)
        assert traj.mismatch_report()["assistant_only"] or name in RERENDER_MOVES_GLUE


def test_max_rollback_zero_refuses_any_divergence(qwen):
    traj = LinearTrajectory(qwen, max_rollback=0)
    turn(traj, [user("q1")], Reply("a1"))
    with pytest.raises(RollbackLimitError, match="rolling back 1 turns exceeds max_rollback=0"):
        traj.prepare([user("q1"), {"role": "assistant", "content": "edited"}, user("q2")])


def test_openai_sdk_echo_matches_stored_history(qwen):
    """Agents echo replies as content None + tool calls with `index`, without reasoning: still append-only."""
    traj = LinearTrajectory(qwen)
    turn(traj, [user("2+2?")], Reply("", reasoning="use calc", tool_calls=CALL), tools=TOOLS, rid="r0")
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_r0_0", "type": "function",
         "function": {"name": "calc", "arguments": CALL[0][1]}}]}
    request = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]}, echoed,
               {"role": "tool", "tool_call_id": "call_r0_0", "content": "4"}]
    plan = traj.prepare(request, TOOLS)
    assert plan.rolled_back == 0 and plan.new_token_start == traj.num_tokens
    assert plan.messages[1]["reasoning_content"] == "use calc"  # the stored reply is kept, not the lossy echo
    # Echoing reasoning that differs from what was generated is a divergence.
    plan = traj.prepare([request[0], {**echoed, "reasoning_content": "something else"}, request[2]], TOOLS)
    assert plan.rolled_back == 1


def test_loose_matcher_accepts_reserialised_arguments(qwen):
    reserialised = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_r0_0", "type": "function",
         "function": {"name": "calc", "arguments": json.dumps(json.loads(CALL[0][1]), separators=(",", ":"))}}]}
    assert LinearTrajectory(qwen).matcher.mode == "loose_tool_call"  # the default
    for matcher, rolled_back in (("strict", 1), ("loose_tool_call", 0)):
        traj = LinearTrajectory(qwen, matcher=matcher)
        turn(traj, [user("2+2?")], Reply("", tool_calls=CALL), tools=TOOLS, rid="r0")
        plan = traj.prepare([user("2+2?"), reserialised, {"role": "tool", "content": "4"}], TOOLS)
        assert plan.rolled_back == rolled_back
        assert plan.rollback_reason == ("tool_call_arguments" if rolled_back else None)
    with pytest.raises(ValueError, match="unknown message matcher"):
        LinearTrajectory(qwen, matcher="fuzzy")


def test_qwen3_keeps_generated_reasoning_that_the_template_drops(qwen):
    traj = LinearTrajectory(qwen)
    turn(traj, [user("q1")], Reply("a1", reasoning="secret plan"))
    plan = traj.prepare([*traj.messages, user("q2")])
    assert "secret plan" in qwen.decode(plan.prompt_ids)
    assert "secret plan" not in qwen.render(plan.messages, None, add_generation_prompt=True)
    assert traj.mismatch_report()["equal"]  # the template still renders reasoning of the final message
    traj.commit(plan, *generate(qwen, plan, Reply("a2"), rid="r1"))
    report = traj.mismatch_report()
    assert report["equal"] is False and report["assistant_only"] is True
    assert any("secret plan" in s["stored_text"] and s["in_assistant"] for s in report["segments"])


@pytest.mark.parametrize("name", FAMILIES)
def test_mismatch_report_is_clean_for_append_stable_history(families, name):
    traj = LinearTrajectory(families[name])
    turn(traj, [user("q1")], Reply("a1", tool_calls=CALL), tools=TOOLS, rid="r0")
    turn(traj, [{"role": "tool", "content": "4"}], Reply("It is 4."), tools=TOOLS, rid="r1")
    report = traj.mismatch_report()
    segments = report["segments"]
    # Qwen3 renders the final assistant message with an empty think block; that is its only difference.
    assert all(s["in_assistant"] for s in segments)
    assert report["equal"] is (name in ("deepseek", "deepseek-v4"))
    if name == "qwen3":
        assert [s["canonical_text"] for s in segments] == ["<think>\n\n</think>\n\n"]


def test_turn_cut_by_length_mid_word_is_closed_by_the_next_prompt(qwen):
    traj = LinearTrajectory(qwen)
    plan = traj.prepare([user("count")])
    ids = qwen.encode("one two thr")[:-1]
    body = engine_body(ids, finish={"type": "length", "length": len(ids)}, text=qwen.decode(ids))
    traj.commit(plan, decode_generate_response(json.dumps(body).encode(), qwen.vocab_size),
                qwen.parse_completion(qwen.decode(ids)).to_message("c"))
    nxt = traj.prepare([*traj.messages, user("go on")])
    assert nxt.trimmed == 0 and np.array_equal(nxt.prompt_ids[: traj.num_tokens], traj.token_ids)
    assert qwen.decode(nxt.prompt_ids[traj.num_tokens:]).startswith("<|im_end|>\n<|im_start|>user\ngo on")


def test_aborted_turn_without_tokens(qwen):
    traj = LinearTrajectory(qwen)
    plan = traj.prepare([user("hi")])
    body = engine_body([], finish={"type": "abort", "message": "paused"})
    record = traj.commit(plan, decode_generate_response(json.dumps(body).encode(), qwen.vocab_size),
                         {"role": "assistant", "content": None})
    assert record.completion_len == 0 and record.last_completion_token is None and traj.loss_mask.sum() == 0
    nxt = traj.prepare([*traj.messages, user("again")])
    assert qwen.decode(nxt.prompt_ids[traj.num_tokens:]).startswith("<|im_end|>\n<|im_start|>user\nagain")


def test_storage_is_compact(qwen):
    traj = LinearTrajectory(qwen)
    for k in range(40):
        turn(traj, [user(f"question {k} " + "lorem ipsum " * 60)], Reply("answer " * 300), rid=f"r{k}")
    assert traj.num_tokens > 16_000
    assert traj.token_ids.dtype == np.int32 and traj.logprobs.dtype == np.float32 and traj.loss_mask.dtype == np.uint8
    assert traj.nbytes / traj.num_tokens <= 10  # docs/design.md 7: token arrays at most 10 bytes per stored token
    with pytest.raises(ValueError):
        traj.token_ids[0] = 1  # views are read-only: only commit mutates


def test_to_dict_is_json_and_keeps_heavy_payloads_out(qwen):
    traj = LinearTrajectory(qwen)
    plan = traj.prepare([user("hi")])
    ids = [*qwen.encode("Hello"), qwen.eos_token_id]
    body = engine_body(ids, routed_experts=[[1, 2], [3, 4]], weight_version="step-7")
    traj.commit(plan, decode_generate_response(json.dumps(body).encode(), qwen.vocab_size),
                {"role": "assistant", "content": "Hello"})
    out = json.loads(json.dumps(traj.to_dict()))
    assert out["token_ids"] == traj.token_ids.tolist() and out["family"] == "qwen3"
    record = out["records"][0]
    assert "routed_experts" not in record and record["routed_experts_bytes"] > 0
    assert record["weight_version"] == "step-7" and record["finish_reason"]["type"] == "stop"
    assert traj.to_dict(include_routed_experts=True)["records"][0]["routed_experts"] == [[1, 2], [3, 4]]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=40))
def test_token_buffer_stays_under_ten_bytes_per_token(appends: list[int]) -> None:
    """docs/design.md 7's bar for token arrays, after any sequence of appends: at most 10 bytes per stored token once
    the buffer is past its initial capacity (below it, the initial capacity is all there is)."""
    buffer = TokenBuffer()
    initial = buffer.nbytes
    for n in appends:
        buffer.append(np.zeros(n, np.int32), None, sampled=False)
        assert buffer.nbytes <= max(initial, 10 * buffer.size)


def test_token_buffer_growth_and_truncation():
    buffer = TokenBuffer(capacity=4)
    chunks = [np.arange(k, k + 3, dtype=np.int32) for k in range(0, 30, 3)]
    for i, chunk in enumerate(chunks):
        buffer.append(chunk, np.full(3, -0.5, np.float32) if i % 2 else None, sampled=bool(i % 2))
    assert buffer.ids.tolist() == list(range(30)) and buffer.capacity < 30 * 1.1 + 2
    assert buffer.mask.tolist() == [i // 3 % 2 for i in range(30)]
    assert buffer.logprobs.tolist() == [-0.5 * (i // 3 % 2) for i in range(30)]
    buffer.truncate(5)
    buffer.append(np.array([99], np.int32), None, sampled=False)
    assert buffer.ids.tolist() == [0, 1, 2, 3, 4, 99]
    with pytest.raises(ValueError):
        buffer.truncate(7)


def test_snapshot_is_detached_from_later_commits(qwen):
    """GET /sessions/{id} reads a snapshot in a pool thread while turns keep committing: a rollback rewrites the
    stored slots in place, so the snapshot must own copies, not views."""
    traj = LinearTrajectory(qwen, max_rollback=1)
    turn(traj, [user("q1")], Reply("a1"))
    turn(traj, [user("q2")], Reply("a2 " * 5))
    snap = traj.snapshot()
    view = traj.token_ids  # what a view-based snapshot would hold
    expected, expected_view = content(snap), view.tolist()
    expected_report = snap.mismatch_report()
    assert expected == content(traj) and snap.nbytes <= traj.nbytes  # the copy has no growth slack
    plan = traj.prepare(traj.messages[:3])  # regenerate the last turn: truncate + append into the same buffer
    traj.commit(plan, *generate(qwen, plan, Reply("other"), rid="r2b"))
    turn(traj, [user("q3")], Reply("a3"))
    assert view.tolist() != expected_view  # the live buffer really was rewritten in place
    assert content(snap) == expected and snap.mismatch_report() == expected_report
    assert snap.version == 2 and traj.version == 4 and len(snap.records) == 2 and len(traj.records) == 3


def content(traj: LinearTrajectory) -> str:
    """`snapshot` without the memory footprint, which differs between a trajectory and its snapshot."""
    info = traj.to_dict()
    del info["nbytes"]
    return json.dumps([traj.version, info, traj.logprobs.tolist(), traj.loss_mask.tolist()])
