"""The per-turn benchmark's stage figures read the server's own stage histograms (benchmarks/bench_turn_overhead.py):
the exposition text of a real Metrics registry parses back to the sums and counts observed, and the mean per stage
between two readings counts only what was observed in between."""

from __future__ import annotations

import pytest

from benchmarks.bench_turn_overhead import parse_stage_totals, stage_means
from session_server.metrics import STAGES, Metrics


def test_stage_totals_round_trip_a_real_registry() -> None:
    metrics = Metrics()
    before = parse_stage_totals(metrics.render().decode())
    assert before == {name: (0.0, 0.0) for name in STAGES}
    for seconds in (0.001, 0.003):
        metrics.stage("decode", seconds)
    metrics.stage("prepare", 0.002)
    after = parse_stage_totals(metrics.render().decode())
    assert after["decode"] == (pytest.approx(0.004), 2.0)
    assert after["prepare"] == (pytest.approx(0.002), 1.0)
    assert after["commit"] == (0.0, 0.0)
    means = stage_means(before, after)
    assert means == {"decode": pytest.approx(2.0), "prepare": pytest.approx(2.0)}  # ms; commit had none


def test_stage_means_count_only_the_observations_between_readings() -> None:
    metrics = Metrics()
    metrics.stage("decode", 0.010)  # a warm-up turn, before the first reading
    before = parse_stage_totals(metrics.render().decode())
    metrics.stage("decode", 0.002)
    after = parse_stage_totals(metrics.render().decode())
    assert stage_means(before, after) == {"decode": pytest.approx(2.0)}
    assert stage_means(after, after) == {}
