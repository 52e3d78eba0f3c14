"""Decoding the reply shapes released SGLang 0.5.23 sends (each pinned to the source that builds it)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trajectory import decode_generate_response
from trajectory.errors import UpstreamError

VOCAB = 1000


def _reply(**meta: Any) -> bytes:
    base: dict[str, Any] = {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 7}, "prompt_tokens": 5, "completion_tokens": 2,
        "cached_tokens": 0, "output_token_logprobs": [[-0.1, 3, None], [-0.2, 7, None]], "weight_version": "v1",
    }
    base.update(meta)
    return json.dumps({"text": "ab", "output_ids": [3, 7], "meta_info": base}).encode()


def test_queued_abort_reduced_meta_info_decodes_as_an_abort() -> None:
    """tokenizer_manager.py _handle_abort_req: id, finish_reason, weight_version, e2e_latency, weight_versions,
    the logprob lists and completion_tokens; no prompt_tokens, cached_tokens or retraction counts."""
    body = json.dumps({"text": "", "output_ids": [], "meta_info": {
        "id": "r1", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}, "weight_version": "v1",
        "e2e_latency": 0.01, "weight_versions": [{"version": "v1", "start": 0, "end": 0}],
        "input_token_logprobs": [], "output_token_logprobs": [], "output_token_logprobs_length": 0,
        "completion_tokens": 0}}).encode()
    result = decode_generate_response(body, VOCAB)
    assert result.finish_reason == {"type": "abort", "message": "Abort in waiting queue"}
    assert result.completion_tokens == 0 and result.weight_versions == (("v1", 0, 0),)


def test_prompt_tokens_still_required_outside_an_abort() -> None:
    body = json.loads(_reply())
    del body["meta_info"]["prompt_tokens"]
    with pytest.raises(UpstreamError) as err:
        decode_generate_response(json.dumps(body).encode(), VOCAB)
    assert err.value.rule == "meta_info"


def test_nan_happened_is_refused_by_rule() -> None:
    with pytest.raises(UpstreamError) as err:
        decode_generate_response(_reply(finish_reason={"type": "stop", "matched": "NaN happened"}), VOCAB)
    assert err.value.rule == "nan_happened"
    ok = decode_generate_response(_reply(finish_reason={"type": "stop", "matched": "</answer>"}), VOCAB)
    assert ok.finish_reason["matched"] == "</answer>"


def test_weight_version_spans() -> None:
    """utils/weight_versions.py: spans tile the output tokens; the last one is meta_info.weight_version."""
    spans = [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 2}]
    assert decode_generate_response(_reply(weight_versions=spans), VOCAB).weight_versions == (
        ("v1", 0, 1), ("v2", 1, 2))
    assert decode_generate_response(_reply(), VOCAB).weight_versions is None
    for bad in ([{"version": "v1", "start": 0, "end": 1}],  # does not cover the output
                [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 1, "end": 2}],  # overlaps
                [{"version": "v1", "start": 0, "end": 3}],  # beyond the output
                [],
                [{"version": 3, "start": 0, "end": 2}]):  # not a string
        with pytest.raises(UpstreamError):
            decode_generate_response(_reply(weight_versions=bad), VOCAB)
