"""The view document (trajectory/view/document.py) from samples, and the page that embeds it."""

from __future__ import annotations

import json
import re

import numpy as np

from trajectory import Sample
from trajectory.view import SegmentExtras, TurnExtras, build_document, offline_page, piece_table, segment_of_sample
from trajectory.view.page import embedded_json, list_page, session_page


def merged_sample() -> Sample:
    """Two turns: prompt [0, 4) + completion [4, 7), appended [7, 9) + completion [9, 12); an image at [1, 3)."""
    tokens = np.arange(100, 112, dtype=np.int32)
    mask = np.array([0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=np.uint8)
    logprobs = np.where(mask == 1, -0.123456789, 0.0).astype(np.float32)
    routed = np.full((12, 4), -1, dtype=np.int32)
    routed[0:11] = 3
    return Sample(tokens=tokens, loss_mask=mask, rollout_log_probs=logprobs, response_length=8, status="completed",
                  metadata={"turns": [[4, 3], [9, 3]], "rids": ["a", "b"], "weight_versions": ["v1", "v2"],
                            "weight_version_spans": [["v1", 4, 7], ["v2", 9, 11], ["v3", 11, 12]],
                            "images": [{"span": [1, 3], "digest": "sha256:x", "image_grid_thw": [1, 2, 4]}],
                            "segment": 0, "parent": None, "branch_turn": 0, "reason": "first"},
                  routed_experts=routed)


def test_a_merged_sample_becomes_turns_spans_and_presence() -> None:
    extras = SegmentExtras("segment 0", turns=[TurnExtras(cached_tokens=0, tool_calls=[{"name": "f"}]),
                                               TurnExtras(cached_tokens=7, messages=[{"role": "tool"}])],
                           image_sources={"sha256:x": "data:image/png;base64,AA=="})
    seg = segment_of_sample(merged_sample(), extras)
    assert seg["mask"] == "000011100111"
    assert seg["logprobs"][4] == -0.12346 and seg["logprobs"][0] == 0.0
    assert [(t["start"], t["prompt_len"], t["completion_len"], t["rid"], t["weight_version"])
            for t in seg["turns"]] == [(0, 4, 3, "a", "v1"), (7, 9, 3, "b", "v2")]
    assert seg["turns"][0]["tool_calls"] == [{"name": "f"}] and seg["turns"][1]["cached_tokens"] == 7
    assert seg["weight_spans"] == [["v1", 4, 7], ["v2", 9, 11], ["v3", 11, 12]]
    assert seg["images"] == [{"span": [1, 3], "digest": "sha256:x", "grid": [1, 2, 4],
                              "src": "data:image/png;base64,AA=="}]
    assert seg["experts"] == [[0, 11]]
    assert seg["info"] == {"segment": 0, "parent": None, "branch_turn": 0, "reason": "first"}


def test_turns_of_a_turn_sample_or_a_bare_mask() -> None:
    sample = merged_sample()
    turn = Sample(tokens=sample.tokens[:7], loss_mask=sample.loss_mask[:7],
                  rollout_log_probs=sample.rollout_log_probs[:7], response_length=3, status="completed",
                  metadata={"turn": 0, "rid": "a", "weight_version": "v1", "prompt_len": 4})
    seg = segment_of_sample(turn, SegmentExtras("turn 0"))
    assert [(t["prompt_len"], t["completion_len"], t["rid"]) for t in seg["turns"]] == [(4, 3, "a")]
    assert seg["weight_spans"] == [["v1", 4, 7]] and seg["experts"] is None
    bare = Sample(tokens=sample.tokens, loss_mask=sample.loss_mask, rollout_log_probs=sample.rollout_log_probs,
                  response_length=8, status="completed")
    assert [(t["start"], t["prompt_len"], t["completion_len"]) for t in segment_of_sample(
        bare, SegmentExtras("s"))["turns"]] == [(0, 4, 3), (7, 9, 3)]


def test_a_truncated_sample_keeps_the_turns_it_holds() -> None:
    sample = merged_sample()
    cut = Sample(tokens=sample.tokens[:8], loss_mask=sample.loss_mask[:8],
                 rollout_log_probs=sample.rollout_log_probs[:8], response_length=3, status="truncated",
                 metadata={**sample.metadata, "truncated_from": 12})
    seg = segment_of_sample(cut, SegmentExtras("s"))
    assert [t["turn"] for t in seg["turns"]] == [0] and seg["truncated_from"] == 12


def test_pieces_are_decoded_once_per_distinct_token() -> None:
    calls: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        calls.append(ids)
        return f"<{ids[0]}>"

    table = piece_table(decode, [np.array([5, 3, 5, 5]), np.array([3, 9])])
    assert table == {"3": "<3>", "5": "<5>", "9": "<9>"} and sorted(calls) == [[3], [5], [9]]
    assert piece_table(decode, []) == {}
    doc = build_document("samples", "t", {}, [], table, special=[9, 42])
    assert doc["special"] == [9] and doc["schema"] == 1


def test_the_offline_page_embeds_the_document_safely() -> None:
    doc = build_document("samples", "a </script> title", {}, [], {"1": "</script><script>alert(1)</script>"})
    page = offline_page(doc)
    embedded = re.search(r'<script type="application/json" id="view-doc">(.*?)</script>', page, re.S)
    assert embedded is not None and json.loads(embedded.group(1)) == doc
    assert "<title>a &lt;/script&gt; title" in page
    assert "\\u003c" in embedded_json("<") and "<" not in embedded_json({"k": "</script>"})
    for page in (list_page(), session_page("abc"), offline_page(doc)):
        assert "{{" not in page and "<style>" in page and "trajectoryView" in page  # every asset inlined
    assert 'data-source="../api/sessions/abc"' in session_page("abc")
