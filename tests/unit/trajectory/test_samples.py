"""Training samples: per-turn and merged assembly, truncation, and the JSON / safetensors codecs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as st_save

from support.examples import examples
from support.tito import Reply, engine_body, generate
from trajectory import (
    LinearTrajectory,
    Sample,
    build_merged_sample,
    build_turn_samples,
    decode_generate_response,
    sample_metadata,
    samples_from_json,
    samples_from_safetensors,
    samples_to_json,
    samples_to_safetensors,
    truncate_sample,
)


def make(mask: list[int], response_length: int, status: str = "completed") -> Sample:
    n = len(mask)
    lp = np.where(np.array(mask) == 1, -0.5, 0.0).astype(np.float32)
    return Sample(np.arange(n, dtype=np.int32), np.array(mask, dtype=np.uint8), lp, response_length, status, {"k": 1})


def same(a: Sample, b: Sample) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss_mask, b.loss_mask)
            and np.array_equal(a.rollout_log_probs, b.rollout_log_probs) and a.response_length == b.response_length
            and a.status == b.status and a.metadata == b.metadata)


# Two turns: prompt 0-2, response 3-5, tool result 6-7, response 8-10.
MASK = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(("max_len", "kept", "response_length"), [
    (11, 11, 8),   # fits: unchanged
    (10, 10, 7),   # cuts the last turn's response
    (8, 6, 3),     # lands in the tool result: ends at the last whole response
    (9, 9, 6),     # keeps one token of the second response
    (6, 6, 3),     # exactly the first turn
    (2, 2, 0),     # even the first prompt overflows: nothing sampled survives
])
def test_truncation_keeps_whole_turns(max_len, kept, response_length):
    sample = make(MASK, response_length=8)
    out = truncate_sample(sample, max_len)
    assert len(out.tokens) == kept and out.response_length == response_length
    assert out.loss_mask.tolist() == MASK[:kept]
    if kept == len(MASK):
        assert out is sample
    else:
        assert out.status == "truncated" and out.metadata == {"k": 1, "truncated_from": 11}
    with pytest.raises(ValueError):
        truncate_sample(sample, 0)


@pytest.fixture(scope="module")
def qwen(families):
    return families["qwen3"]


def test_samples_from_a_trajectory_carry_statuses(qwen):
    traj = LinearTrajectory(qwen)
    for k, reply in enumerate([Reply("first", stop="alt"), Reply("second", stop="length")]):
        plan = traj.prepare([*traj.messages, {"role": "user", "content": f"q{k}"}])
        traj.commit(plan, *generate(qwen, plan, reply, rid=f"r{k}"))
    plan = traj.prepare([*traj.messages, {"role": "user", "content": "q2"}])
    ids = qwen.encode("par")
    body = engine_body(ids, finish={"type": "abort", "message": "stop"}, rid="r2")
    traj.commit(plan, decode_generate_response(json.dumps(body).encode(), qwen.vocab_size),
                {"role": "assistant", "content": "par"})
    turns = build_turn_samples(traj)
    assert [s.status for s in turns] == ["completed", "truncated", "aborted"]
    assert [s.metadata["rid"] for s in turns] == ["r0", "r1", "r2"]
    assert turns[0].tokens[-1] == qwen.stop_token_ids[1]  # restored although the next prompt replaced it
    merged = build_merged_sample(traj)
    assert merged.status == "aborted" and merged.metadata["num_turns"] == 3
    # every sampled token counted under its version
    assert merged.metadata["weight_version_tokens"] == sample_metadata(merged).version_counts()
    assert sum(merged.metadata["weight_version_tokens"].values()) == int(merged.loss_mask.sum())
    assert [sum(s.metadata["weight_version_tokens"].values()) for s in turns] == [int(s.loss_mask.sum())
                                                                                 for s in turns]
    assert int(merged.loss_mask.sum()) == sum(int(s.loss_mask.sum()) for s in turns) - 1  # the trimmed stop token
    short = build_merged_sample(traj, max_seq_len=turns[1].tokens.size - 1)
    assert short.status == "truncated" and short.loss_mask[-1] == 1
    assert [len(s.tokens) for s in build_turn_samples(traj, max_seq_len=len(turns[0].tokens))] == [
        len(turns[0].tokens)] * 3
    with pytest.raises(ValueError, match="no generated turn"):
        build_merged_sample(LinearTrajectory(qwen))


def test_a_turn_that_went_without_its_engine_session_says_so_in_the_samples(qwen):
    """--engine-sessions: each turn's record says how it used its engine session; a turn that went without one
    ("without": its whole history was prefilled) is named in the merged sample and in its turn sample."""
    traj = LinearTrajectory(qwen)
    for k, mode in enumerate(["opened", "reused", "without"]):
        plan = traj.prepare([*traj.messages, {"role": "user", "content": f"q{k}"}])
        result, message = generate(qwen, plan, Reply(f"a{k}"), rid=f"r{k}")
        traj.commit(plan, dataclasses.replace(result, engine_session=mode), message)
    assert build_merged_sample(traj).metadata["engine_sessions"] == ["opened", "reused", "without"]
    assert [s.metadata["engine_session"] for s in build_turn_samples(traj)] == ["opened", "reused", "without"]
    assert [r.to_dict()["engine_session"] for r in traj.records] == ["opened", "reused", "without"]
    plain = LinearTrajectory(qwen)  # without --engine-sessions the samples are as they always were
    plan = plain.prepare([{"role": "user", "content": "q"}])
    plain.commit(plan, *generate(qwen, plan, Reply("a"), rid="r"))
    assert "engine_sessions" not in build_merged_sample(plain).metadata
    assert "engine_session" not in build_turn_samples(plain)[0].metadata


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 30))
    mask = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.uint8)
    lp = np.array(draw(st.lists(st.floats(-100, 0, width=32), min_size=n, max_size=n)), dtype=np.float32) * mask
    return Sample(
        tokens=np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), dtype=np.int32),
        loss_mask=mask, rollout_log_probs=lp.astype(np.float32), response_length=draw(st.integers(0, n)),
        status=draw(st.sampled_from(["completed", "truncated", "aborted"])),
        metadata=draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)),
    )


@settings(max_examples=examples(60), deadline=None)
@given(batch=st.lists(samples(), max_size=4))
def test_codecs_round_trip(batch):
    via_json = samples_from_json(json.loads(json.dumps(samples_to_json(batch))))
    via_safetensors = samples_from_safetensors(samples_to_safetensors(batch))
    assert len(via_json) == len(via_safetensors) == len(batch)
    for original, a, b in zip(batch, via_json, via_safetensors, strict=True):
        assert same(original, a) and same(original, b)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("tokens", [1, True, 3], "tokens must be a list of integers"),
    ("tokens", [1, 2.0, 3], "tokens must be a list of integers"),
    ("tokens", [1, "2", 3], "tokens must be a list of integers"),
    ("tokens", [1, 2**40, 3], "outside the int32 range"),
    ("loss_mask", [0, 2, 1], "only 0 and 1"),
    ("loss_mask", [0, 1], "has 2 items"),
    ("rollout_log_probs", [0.0, "x", 0.0], "list of numbers"),
    ("response_length", 4, "not in"),
    ("response_length", True, "not in"),
    ("status", "done", "status 'done'"),
])
def test_json_decoder_rejects_bad_samples(field, value, match):
    item = samples_to_json([make([0, 1, 1], 2)])[0]
    item[field] = value
    with pytest.raises(ValueError, match=match):
        samples_from_json([item])


def test_safetensors_decoder_checks_dtypes_and_shapes():
    good = make([0, 1, 1], 2)
    meta = {"format": "trajectory-samples/v1", "samples": json.dumps([{"response_length": 2, "status": "completed"}])}
    arrays = {"0.tokens": good.tokens, "0.loss_mask": good.loss_mask, "0.rollout_log_probs": good.rollout_log_probs}
    assert same(samples_from_safetensors(st_save(arrays, metadata=meta))[0], Sample(
        good.tokens, good.loss_mask, good.rollout_log_probs, 2, "completed"))
    for key, bad, match in [
        ("0.tokens", good.tokens.astype(np.int64), "tokens must be a 1-D int32"),
        ("0.loss_mask", good.loss_mask.astype(np.bool_), "loss_mask must be a 1-D uint8"),
        ("0.rollout_log_probs", good.rollout_log_probs.astype(np.float64), "float32"),
        ("0.tokens", good.tokens.reshape(1, 3), "1-D"),
        ("0.tokens", good.tokens[:2], "has 3 items, tokens has 2"),
        ("1.tokens", good.tokens, "do not match the metadata"),
    ]:
        with pytest.raises(ValueError, match=match):
            samples_from_safetensors(st_save({**arrays, key: bad}, metadata=meta))
    with pytest.raises(ValueError, match="format"):
        samples_from_safetensors(st_save(arrays, metadata={**meta, "format": "other"}))
    with pytest.raises(ValueError, match="invalid safetensors"):
        samples_from_safetensors(b"\x00\x01garbage")
