"""trajectory.sampling_masks: the engine's kept sets validated strictly, stored by position through commits,
rollbacks, trims, continuations and the journal's replay, and carried by samples in every encoding."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import FAMILIES
from support.tito import Reply, engine_body, generate
from trajectory import (
    GenerateResult,
    LinearTrajectory,
    build_merged_sample,
    build_turn_samples,
    decode_generate_response,
    join_results,
    samples_from_json,
    samples_from_safetensors,
    samples_to_json,
    samples_to_safetensors,
    truncate_sample,
)
from trajectory.errors import UpstreamError
from trajectory.restore import restore_trajectory, store_turn
from trajectory.sampling_masks import SamplingMasks

VOCAB = 1000


def rows_for(ids: list[int], width: int, vocab: int, salt: int = 0) -> list[list[int]]:
    """A kept set per sampled id: the id first, then `width - 1` other ids (distinct), varying by position."""
    out = []
    for i, tok in enumerate(ids):
        k = 1 + (i + salt) % width
        out.append([tok, *((tok + 1 + j * 7 + salt) % vocab for j in range(k - 1))])
    return out


def body_with_masks(ids: list[int], rows: Any, logprobs: Any) -> bytes:
    return json.dumps(engine_body(ids, output_token_sampling_mask=rows, output_token_sampling_logprobs=logprobs)
                      ).encode()


def test_valid_masks_are_decoded_as_csr() -> None:
    ids = [5, 9, 7]
    rows = [[5, 1, 2], [9], [3, 7]]
    result = decode_generate_response(body_with_masks(ids, rows, [-0.5, 0.0, -1.25]), VOCAB, sampling_mask_bound=3)
    masks = result.sampling_masks
    assert masks is not None
    assert masks.offsets.tolist() == [0, 3, 4, 6] and masks.ids.tolist() == [5, 1, 2, 9, 3, 7]
    assert masks.ids.dtype == np.int32 and masks.offsets.dtype == np.int64
    assert masks.logprobs.tolist() == [-0.5, 0.0, -1.25]
    # Not asked for: the keys are ignored.
    assert decode_generate_response(body_with_masks(ids, rows, [-0.5, 0.0, -1.25]), VOCAB).sampling_masks is None


@pytest.mark.parametrize(("rows", "logprobs", "bound", "rule"), [
    (None, None, 4, "sampling_mask"),                                  # asked for, not sent
    ([[5], [9]], [-0.1, -0.1], 4, "sampling_mask"),                    # a row short
    ([[5], [9], [7]], [-0.1, -0.1], 4, "sampling_mask"),               # a logprob short
    ([[5], [], [7]], [-0.1, -0.1, -0.1], 4, "sampling_mask"),          # an empty row
    ([[5], [9, 9], [7]], [-0.1, -0.1, -0.1], 4, "sampling_mask"),      # an id twice in its row
    ([[5], [9, 1, 2], [7]], [-0.1, -0.1, -0.1], 2, "sampling_mask_bound"),
    ([[5], [9, VOCAB], [7]], [-0.1, -0.1, -0.1], 4, "sampling_mask_range"),
    ([[5], [9, -1], [7]], [-0.1, -0.1, -0.1], 4, "sampling_mask_range"),
    ([[5], [8, 1], [7]], [-0.1, -0.1, -0.1], 4, "sampling_mask_sampled"),
    ([[5], [9], [7]], [-0.1, 0.5, -0.1], 4, "sampling_mask_logprob"),
    ([[5], [9], ["7"]], [-0.1, -0.1, -0.1], 4, "sampling_mask"),      # not an id
    ([[5], [9], [7]], [-0.1, [-0.1], -0.1], 4, "sampling_mask"),      # mode "support", not what we ask
])
def test_broken_masks_are_refused_naming_the_rule(rows: Any, logprobs: Any, bound: int, rule: str) -> None:
    with pytest.raises(UpstreamError) as err:
        decode_generate_response(body_with_masks([5, 9, 7], rows, logprobs), VOCAB, sampling_mask_bound=bound)
    assert err.value.rule == rule


def test_a_reply_aborted_before_its_first_token_has_no_rows() -> None:
    body = engine_body([], finish={"type": "abort", "message": "Abort in waiting queue"})
    result = decode_generate_response(json.dumps(body).encode(), VOCAB, sampling_mask_bound=20)
    assert result.sampling_masks is not None and len(result.sampling_masks) == 0


@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30), cuts=st.lists(st.integers(0, 30), max_size=3))
def test_a_continued_reply_keeps_one_row_per_token(ids: list[int], cuts: list[int]) -> None:
    rows = rows_for(ids, 5, VOCAB)
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    joined: GenerateResult | None = None
    for start, end in itertools.pairwise(bounds):
        last = end == len(ids)
        body = engine_body(ids[start:end], finish={"type": "stop", "matched": 1} if last else
                           {"type": "abort", "message": "Aborted"}, output_token_sampling_mask=rows[start:end],
                           output_token_sampling_logprobs=[-0.5] * (end - start))
        piece = decode_generate_response(json.dumps(body).encode(), VOCAB, sampling_mask_bound=5)
        joined = piece if joined is None else join_results(joined, piece)
    assert joined is not None and joined.sampling_masks is not None
    assert [joined.sampling_masks.row(i).tolist() for i in range(len(ids))] == rows


def with_masks(result: GenerateResult, vocab: int, salt: int) -> GenerateResult:
    ids = result.output_ids.tolist()
    rows = rows_for(ids, 4, vocab, salt)
    return dataclasses.replace(result, sampling_masks=SamplingMasks.from_rows(rows, [-0.25 - salt / 100] * len(ids)))


def rows_of(masks: SamplingMasks | None) -> list[list[int]]:
    assert masks is not None
    return [masks.row(i).tolist() for i in range(len(masks))]


replies = st.builds(Reply, content=st.text(alphabet="abc xyz.\n", min_size=0, max_size=20),
                    stop=st.sampled_from(["eos", "alt", "length"]))
steps = st.lists(st.tuples(st.sampled_from(["user", "user", "retry", "plain"]), replies), min_size=1, max_size=6)


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(family_name=st.sampled_from(FAMILIES), script=steps)
def test_rows_follow_the_stored_tokens(families, family_name: str, script: list[tuple[str, Reply]]) -> None:
    """Through commits, retries (rollback), trims and turns without masks, the stored rows are exactly a model's:
    the rows of the surviving completions at their positions, empty elsewhere; the journal's replay, a snapshot and
    the samples (merged, per turn, truncated, JSON, safetensors) say the same."""
    family = families[family_name]
    traj = LinearTrajectory(family, max_rollback=1)
    expected: list[list[int]] = []
    stored = []
    for i, (kind, reply) in enumerate(script):
        if kind == "retry" and traj.checkpoints:
            messages = [*traj.messages[:traj.checkpoints[-1].num_messages - 1]] or [{"role": "user", "content": "x"}]
        else:
            messages = [*traj.messages, {"role": "user", "content": f"question {i}"}]
        plan = traj.prepare(messages)
        result, message = generate(family, plan, reply, rid=f"r{i}")
        if kind != "plain":
            result = with_masks(result, family.vocab_size, i)
        delta = traj.stage(plan, result, message)
        stored.append(store_turn(delta, traj.messages, traj.tools))
        traj.apply(delta)
        new = rows_of(result.sampling_masks) if result.sampling_masks is not None else [[]] * len(result.output_ids)
        expected = expected[:delta.keep] + [[]] * len(delta.prompt_tail) + new
        if traj.sampling_masks is None:
            assert all(not row for row in expected)
            continue
        assert rows_of(traj.sampling_masks) == expected
        assert rows_of(restore_trajectory(family, stored, max_rollback=1).sampling_masks) == expected
    if traj.sampling_masks is None:
        assert build_merged_sample(traj).sampling_masks is None
        return
    assert rows_of(traj.snapshot().sampling_masks) == expected
    merged = build_merged_sample(traj)
    assert rows_of(merged.sampling_masks) == expected
    sampled = [bool(row) for row in expected]
    assert all(m or not s for m, s in zip(merged.loss_mask.tolist(), sampled, strict=True))
    for sample in [merged, truncate_sample(merged, max(1, len(merged.tokens) // 2))]:
        for back in (samples_from_json(json.loads(json.dumps(samples_to_json([sample]))))[0],
                     samples_from_safetensors(samples_to_safetensors([sample]))[0]):
            assert rows_of(back.sampling_masks) == rows_of(sample.sampling_masks)
            assert back.sampling_mask_offsets is not None and len(back.sampling_mask_offsets) == len(back.tokens) + 1
            np.testing.assert_array_equal(back.sampling_log_probs, sample.sampling_log_probs)
    for k, turn in enumerate(build_turn_samples(traj)):
        rows = rows_of(turn.sampling_masks)
        record = traj.records[k]
        assert all(not row for row in rows[:record.prompt_len])
        ids = turn.tokens.tolist()
        assert all(not row or ids[p] in row for p, row in enumerate(rows))


def test_samples_refuse_inconsistent_masks() -> None:
    traj_like = np.asarray([1, 2, 3], np.int32)
    from trajectory import Sample
    base = {"tokens": traj_like, "loss_mask": np.asarray([0, 1, 1], np.uint8),
            "rollout_log_probs": np.zeros(3, np.float32), "response_length": 2, "status": "completed"}
    ok = Sample(**base, sampling_mask_ids=np.asarray([2, 3], np.int32),
                sampling_mask_offsets=np.asarray([0, 0, 1, 2], np.int64), sampling_log_probs=np.zeros(3, np.float32))
    assert rows_of(ok.sampling_masks) == [[], [2], [3]]
    for broken in ({"sampling_mask_offsets": np.asarray([0, 1, 2], np.int64)},
                   {"sampling_mask_offsets": np.asarray([0, 2, 1, 2], np.int64)},
                   {"sampling_mask_offsets": np.asarray([0, 0, 1, 3], np.int64)},
                   {"sampling_mask_ids": np.asarray([2, 3], np.int64)},
                   {"sampling_log_probs": None}):
        arrays = {"sampling_mask_ids": ok.sampling_mask_ids, "sampling_mask_offsets": ok.sampling_mask_offsets,
                  "sampling_log_probs": ok.sampling_log_probs, **broken}
        with pytest.raises(ValueError):
            Sample(**base, **arrays)
