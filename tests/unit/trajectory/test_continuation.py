"""trajectory.continuation: a reply cut by an abort and continued is, joined, the reply sampled in one go."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from trajectory import GenerateResult, continuable_abort, decode_generate_response, join_results
from trajectory.continuation import WEIGHTS_CHANGED, cut_to_version, sampled_by
from trajectory.sampling_masks import SamplingMasks

ABORTED = {"type": "abort", "message": "Aborted"}


def _result(ids: list[int], logprobs: list[float], finish: dict[str, object], version: str, prompt: int,
            text: str, cached: int = 0, rid: str | None = None) -> GenerateResult:
    return GenerateResult(
        text=text, output_ids=np.asarray(ids, np.int32), logprobs=np.asarray(logprobs, np.float32),
        finish_reason=finish, prompt_tokens=prompt, completion_tokens=len(ids), cached_tokens=cached,
        weight_version=version, rid=rid)


@given(
    ids=st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=3),
    prompt=st.integers(1, 50),
)
def test_pieces_joined_are_the_whole_reply(ids: list[int], cuts: list[int], prompt: int) -> None:
    """Cut anywhere, any number of times, under a new weight version each time: tokens, logprobs and text are the
    whole reply's, the prompt is the original, and the versions tile the reply in order."""
    logprobs = [-(i % 7) / 3 for i in range(len(ids))]
    text = [f"<{t}>" for t in ids]
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    joined = None
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        last = end == len(ids)
        piece = _result(ids[start:end], logprobs[start:end], {"type": "stop", "matched": 7} if last else ABORTED,
                        f"v{i}", prompt + start, "".join(text[start:end]), rid=f"rid{i}")
        joined = piece if joined is None else join_results(joined, piece)
    assert joined is not None
    assert joined.output_ids.tolist() == ids and joined.completion_tokens == len(ids)
    np.testing.assert_array_equal(joined.logprobs, np.asarray(logprobs, np.float32))
    assert joined.text == "".join(text) and joined.prompt_tokens == prompt and joined.rid == "rid0"
    assert joined.finish_reason == {"type": "stop", "matched": 7}
    pieces = len(bounds) - 1
    if pieces == 1:
        assert joined.weight_versions is None
    else:
        spans = joined.weight_versions
        assert spans is not None and [v for v, _, _ in spans] == [f"v{i}" for i in range(pieces)]
        assert spans[0][1] == 0 and spans[-1][2] == len(ids)
        assert all(a[2] == b[1] and a[1] < a[2] for a, b in itertools.pairwise(spans))


def test_a_length_finish_counts_the_whole_reply_and_spans_merge() -> None:
    before = _result([1, 2, 3], [-0.1, -0.2, -0.3], ABORTED, "v1", 10, "abc", cached=4)
    after = _result([4, 5], [-0.4, -0.5], {"type": "length", "length": 2}, "v1", 13, "de", cached=13)
    joined = join_results(before, after)
    assert joined.finish_reason == {"type": "length", "length": 5}
    assert joined.cached_tokens == 4 and joined.weight_versions is None and joined.weight_version == "v1"


def test_a_queued_abort_continued_keeps_the_continuations_prompt_facts() -> None:
    """Nothing sampled before the cut (aborted in the queue: reduced meta_info without prompt_tokens)."""
    body = b'{"text":"","output_ids":[],"meta_info":{"id":"r0","finish_reason":{"type":"abort","message":' \
           b'"Abort in waiting queue"},"completion_tokens":0,"output_token_logprobs":[],"weight_version":"v1"}}'
    queued = decode_generate_response(body, 1000)
    assert continuable_abort(queued.finish_reason)
    after = _result([4, 5], [-0.4, -0.5], {"type": "stop", "matched": 5}, "v2", 13, "de", cached=9, rid="r1")
    joined = join_results(queued, after)
    assert joined.prompt_tokens == 13 and joined.cached_tokens == 9 and joined.rid == "r0"
    assert joined.weight_versions is None and joined.weight_version == "v2"


def test_which_aborts_are_continued() -> None:
    """SGLang 0.5.23: an abort of everything carries no status code; aborts with a reason of their own do."""
    assert continuable_abort({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
    assert continuable_abort({"type": "abort", "message": "Abort in waiting queue"})
    assert not continuable_abort({"type": "abort", "message": "Aborted", "status_code": 503})
    assert not continuable_abort({"type": "abort", "message": "Request timed out"})
    assert not continuable_abort({"type": "stop", "matched": 5})
    body = b'{"text":"","output_ids":[],"meta_info":{"finish_reason":{"type":"abort","message":"Timeout",' \
           b'"status_code":503,"err_type":null},"completion_tokens":0,"output_token_logprobs":[]}}'
    assert not continuable_abort(decode_generate_response(body, 10).finish_reason)


def test_a_reply_of_the_weights_its_key_named_is_left_alone() -> None:
    whole = _result([5, 6, 7], [-0.1, -0.2, -0.3], {"type": "stop", "matched": 7}, "3", 4, "")
    assert cut_to_version(whole, "3", _text) is None
    unnamed = dataclasses.replace(whole, weight_version=None)
    assert cut_to_version(unnamed, "4", _text) is None  # an engine that names no weights: nothing to check


def test_tokens_of_other_weights_are_cut_off_as_a_continuable_abort() -> None:
    """Issue 38: the tokens the keyed weights sampled are kept (with their logprobs), the rest is sampled again."""
    spans = (("3", 0, 2), ("4", 2, 5))
    reply = dataclasses.replace(
        _result([5, 6, 7, 8, 9], [-0.1, -0.2, -0.3, -0.4, -0.5], {"type": "length", "length": 5}, "4", 4, ""),
        weight_versions=spans)
    cut = cut_to_version(reply, "3", _text)
    assert cut is not None and continuable_abort(cut.finish_reason) and cut.finish_reason["message"] == WEIGHTS_CHANGED
    assert cut.output_ids.tolist() == [5, 6] and cut.logprobs.tolist() == np.float32([-0.1, -0.2]).tolist()
    assert cut.text == "5 6" and cut.completion_tokens == 2 and cut.weight_versions == (("3", 0, 2),)
    assert cut.weight_version == "4"  # what the engine serves now: the server learns it
    assert sampled_by(reply, "3") == 2 and sampled_by(reply, "4") == 0
    # a reply wholly of other weights (a prefix cached under the old key, sampled by the new) keeps nothing
    stale = cut_to_version(_result([5, 6], [-0.1, -0.2], {"type": "stop", "matched": 6}, "4", 4, ""), "3", _text)
    assert stale is not None and len(stale.output_ids) == 0 and stale.text == "" and stale.weight_versions is None
    joined = join_results(stale, _result([5, 6], [-0.3, -0.4], {"type": "stop", "matched": 6}, "4", 4, ""))
    assert joined.output_ids.tolist() == [5, 6] and joined.prompt_tokens == 4


def test_a_cut_keeps_one_sampling_mask_row_per_kept_token() -> None:
    """Issues 38 + 42: the kept tokens keep their rows (and their logprobs over them); a continuation joins the rest,
    so the turn still has one row per token."""
    rows = [[5, 1], [6], [7, 2, 3], [8], [9, 4]]
    masks = SamplingMasks.from_rows(rows, [-0.05, 0.0, -0.2, 0.0, -0.3])
    reply = dataclasses.replace(
        _result([5, 6, 7, 8, 9], [-0.1, -0.2, -0.3, -0.4, -0.5], {"type": "length", "length": 5}, "4", 4, ""),
        weight_versions=(("3", 0, 3), ("4", 3, 5)), sampling_masks=masks)
    cut = cut_to_version(reply, "3", _text)
    assert cut is not None and cut.sampling_masks is not None and len(cut.sampling_masks) == 3
    assert [cut.sampling_masks.row(i).tolist() for i in range(3)] == rows[:3]
    assert cut.sampling_masks.logprobs.tolist() == np.float32([-0.05, 0.0, -0.2]).tolist()
    rest = dataclasses.replace(
        _result([8, 9], [-0.4, -0.5], {"type": "length", "length": 2}, "4", 4, ""),
        sampling_masks=SamplingMasks.from_rows(rows[3:], [0.0, -0.3]))
    joined = join_results(cut, rest)
    assert joined.sampling_masks is not None and len(joined.sampling_masks) == len(joined.output_ids) == 5


def _text(ids: np.ndarray) -> str:
    return " ".join(str(i) for i in ids.tolist())
