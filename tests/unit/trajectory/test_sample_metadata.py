"""trajectory.sample_metadata: the one reading of a sample's turns and weight versions, and the rules where the three
old readers (rollout/grpo.py, rollout/adapters/_common.py, rollout/logprob_check.py) disagreed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trajectory import INITIAL_VERSION, GeneratedTurn, Sample, parse_version, sample_metadata, truncate_sample
from trajectory.samples import version_token_counts


def _sample(mask: list[int], metadata: dict[str, Any]) -> Sample:
    n = len(mask)
    m = np.array(mask, dtype=np.uint8)
    first = int(np.flatnonzero(m)[0]) if m.any() else n
    return Sample(tokens=np.arange(n, dtype=np.int32), loss_mask=m,
                  rollout_log_probs=np.where(m == 1, -0.5, 0.0).astype(np.float32), response_length=n - first,
                  status="completed", metadata=metadata)


# A completion's (length, version) pieces: one strategy object for every draw (a new one per draw is validated again).
_PIECES = st.lists(st.tuples(st.integers(1, 3), st.none() | st.sampled_from(["default", "1", "2"])), min_size=1,
                   max_size=2)


@st.composite
def merged(draw: st.DrawFn) -> tuple[Sample, list[str | None]]:
    """A merged sample as samples.py writes it: turns of (glue, completion), each completion's versions in spans
    (an update inside a reply splits it), and the version each token should read back."""
    turns: list[list[int]] = []
    spans: list[list[Any]] = []
    ends: list[str | None] = []
    expected: list[str | None] = []
    mask: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        glue = draw(st.integers(1, 4))
        mask += [0] * glue
        expected += [None] * glue
        start = len(mask)
        pieces = draw(_PIECES)
        for length, version in pieces:
            spans.append([version, len(mask), len(mask) + length])
            mask += [1] * length
            expected += [version or INITIAL_VERSION] * length
        turns.append([start, len(mask) - start])
        ends.append(pieces[-1][1])
    tail = draw(st.integers(0, 2))  # tool output after the last turn
    mask += [0] * tail
    expected += [None] * tail
    meta = {"num_turns": len(turns), "turns": turns, "weight_versions": ends, "weight_version_spans": spans}
    return _sample(mask, meta), expected


@given(merged())
def test_every_sampled_token_reads_its_spans_version_and_no_other_token_has_one(case: Any) -> None:
    sample, expected = case
    meta = sample_metadata(sample)
    assert list(meta.token_versions) == expected
    assert meta.version_ids().tolist() == [-1 if v is None else parse_version(v) for v in expected]
    assert [(t.start, t.end) for t in meta.turns] == [(a, a + n) for a, n in sample.metadata["turns"]]
    assert meta.turn_versions() == [v or INITIAL_VERSION for v in sample.metadata["weight_versions"]]
    runs = meta.generations
    assert sum(b - a for a, b in runs) == int(sample.loss_mask.sum())
    assert all(sample.loss_mask[a:b].all() and (a == 0 or not sample.loss_mask[a - 1]) for a, b in runs)
    for turn in meta.turns:
        assert all(meta.turn_at(p) == turn.index for p in range(turn.start, turn.end))


@given(merged(), st.data())
def test_a_truncated_sample_reads_as_the_prefix_of_the_whole(case: Any, data: st.DataObject) -> None:
    sample, _ = case
    cut = truncate_sample(sample, data.draw(st.integers(1, len(sample.tokens))))
    whole, part = sample_metadata(sample), sample_metadata(cut)
    n = len(cut.tokens)
    assert part.token_versions == tuple(v if cut.loss_mask[i] else None
                                        for i, v in enumerate(whole.token_versions[:n]))
    # the turns whose completion starts inside the cut sample, the last one cut at its end
    assert part.turns == tuple(GeneratedTurn(t.index, t.start, min(t.end, n), t.weight_version)
                               for t in whole.turns if t.start < n)


@given(merged(), st.data())
def test_the_per_version_counts_are_the_sampled_tokens_of_each_version_whole_or_cut(case: Any,
                                                                                   data: st.DataObject) -> None:
    sample, expected = case
    counts = version_token_counts(sample.metadata["weight_version_spans"], sample.loss_mask)
    assert counts == {v: expected.count(v) for v in dict.fromkeys(expected) if v is not None}
    assert sample_metadata(sample).version_counts() == counts
    sample.metadata["weight_version_tokens"] = counts
    cut = truncate_sample(sample, data.draw(st.integers(1, len(sample.tokens))))
    assert cut.metadata["weight_version_tokens"] == sample_metadata(cut).version_counts()
    assert sum(cut.metadata["weight_version_tokens"].values()) == int(cut.loss_mask.sum())


def test_a_turn_sample_has_one_version_over_its_completion() -> None:
    turn = _sample([0, 0, 1, 1], {"turn": 3, "prompt_len": 2, "weight_version": "7"})
    meta = sample_metadata(turn)
    assert meta.token_versions == (None, None, "7", "7")
    assert meta.turns == (GeneratedTurn(3, 2, 4, "7"),) and meta.turn_at(3) == 3 and meta.turn_at(1) is None
    assert meta.version_ids(fill=-7).tolist() == [-7, -7, 7, 7]


def test_a_version_the_engine_did_not_name_is_the_initial_one() -> None:
    """Was: grpo KeyError (no `weight_version`) or TypeError (a None span), the adapters "default" for a missing key
    but the string "None" for a None span, logprob_check None."""
    assert sample_metadata(_sample([0, 1], {})).token_versions == (None, INITIAL_VERSION)
    assert sample_metadata(_sample([0, 1], {"weight_version": None})).token_versions == (None, INITIAL_VERSION)
    spans = _sample([0, 1, 1], {"turns": [[1, 2]], "weight_versions": [None],
                                "weight_version_spans": [[None, 1, 3]]})
    meta = sample_metadata(spans)
    assert meta.token_versions == (None, "default", "default") and meta.turn_versions() == ["default"]
    assert meta.version_range() == (0, 0)


def test_a_sampled_token_without_a_span_is_an_error() -> None:
    """Was: grpo counted it as unsampled (-1, out of the staleness bound), logprob_check scored it with the
    sample's `weight_version` (None on a merged sample); the adapters raised, as all do now."""
    with pytest.raises(ValueError, match=r"sampled tokens \[3\] have no weight version"):
        sample_metadata(_sample([0, 1, 1, 1], {"weight_version_spans": [["1", 1, 3]]}))


def test_spans_are_read_within_the_sample_and_only_on_sampled_tokens() -> None:
    meta = sample_metadata(_sample([0, 1, 0, 1], {"weight_version_spans": [["4", 0, 2], ["5", 2, 99]]}))
    assert meta.token_versions == (None, "4", None, "5")
    assert meta.version_range() == (4, 5) and meta.version_range(lambda v: -int(v)) == (-5, -4)


def test_versions_are_strings_and_parse_as_steps() -> None:
    meta = sample_metadata(_sample([1, 1], {"weight_version_spans": [[3, 0, 2]]}))  # a hand-built int version
    assert meta.token_versions == ("3", "3") and meta.version_ids().tolist() == [3, 3]
    assert parse_version("default") == 0 and parse_version("12") == 12
    with pytest.raises(ValueError, match="pass version_of="):
        parse_version("step-2")
    assert sample_metadata(_sample([0, 0], {})).version_range() == (None, None)


def test_image_spans_in_order() -> None:
    sample = _sample([0, 0, 0, 1], {"images": [{"span": [0, 1], "digest": "a"}, {"span": [1, 3], "digest": "b"}]})
    assert sample_metadata(sample).image_spans == ((0, 1), (1, 3))


def test_adapters_per_token_a_base_turn_says_so_and_old_samples_are_base() -> None:
    from trajectory.sample_metadata import BASE_MODEL, AdapterRevision

    mask = [0, 0, 1, 1, 0, 1, 1, 1, 0, 1]
    meta = {"turns": [[2, 2], [5, 3], [9, 1]], "weight_versions": ["default"] * 3,
            "adapters": [None, ["a1", "0"], ["a1", "2"]]}
    read = sample_metadata(_sample(mask, meta))
    a1, a1_next = AdapterRevision("a1", "0"), AdapterRevision("a1", "2")
    assert read.token_adapters == (None, None, BASE_MODEL, BASE_MODEL, None, a1, a1, a1, None, a1_next)
    assert [t.adapter for t in read.turns] == [BASE_MODEL, a1, a1_next]
    assert read.adapters() == {BASE_MODEL, a1, a1_next}
    turn = sample_metadata(_sample([0, 0, 1, 1], {"turn": 3, "prompt_len": 2, "adapter": ["a2", "0"]}))
    assert turn.token_adapters == (None, None, AdapterRevision("a2", "0"), AdapterRevision("a2", "0"))
    old = sample_metadata(_sample(mask, {"turns": [[2, 2], [5, 3], [9, 1]]}))  # written before adapters existed
    assert old.adapters() == {BASE_MODEL}
