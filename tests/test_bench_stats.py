"""The statistics every benchmark table is built from (no servers needed)."""

from __future__ import annotations

import math

import pytest

from benchmarks.compare import _max_concurrent
from benchmarks.stats import fairness, percentile, summarize_reps


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def test_summary_is_the_median_of_repetitions() -> None:
    s = summarize_reps([[0.001, 0.002, 0.003], [0.010, 0.020, 0.030], [0.004, 0.005, 0.006]])
    assert s["p50_reps_ms"] == [2.0, 20.0, 5.0]
    assert s["p50_ms"] == 5.0  # median of 2, 20, 5: one noisy repetition does not move it
    assert s["n"] == 9 and s["reps"] == 3
    assert s["min_ms"] == 1.0 and s["max_ms"] == 30.0


def test_fairness_even_spread() -> None:
    f = fairness([10, 10, 10, 10])
    assert f["jain"] == 1.0
    assert f["cv"] == 0.0
    assert (f["min"], f["max"], f["idle"]) == (10, 10, 0)


def test_fairness_one_process_takes_everything() -> None:
    f = fairness([40, 0, 0, 0])
    assert f["jain"] == 0.25  # 1/n: the worst possible
    assert f["idle"] == 3
    assert f["cv"] == pytest.approx(math.sqrt(3), abs=1e-3)


def test_fairness_uneven_spread_lies_between() -> None:
    f = fairness([30, 10, 10, 10])
    assert 0.25 < f["jain"] < 1.0
    assert f["jain"] == pytest.approx(60**2 / (4 * (900 + 300)), abs=1e-3)


def test_fairness_no_grants() -> None:
    f = fairness([0, 0])
    assert math.isnan(f["jain"]) and f["idle"] == 2


def test_max_concurrent_counts_overlapping_holds() -> None:
    assert _max_concurrent([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 1  # back to back
    assert _max_concurrent([(0.0, 2.0), (1.0, 3.0), (1.5, 1.7)]) == 3
    assert _max_concurrent([]) == 0
