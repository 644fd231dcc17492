"""Issue 12's floors/targets judgement and report tables, from JSON alone (no servers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import plots, report, run, stats
from benchmarks.floors import queue_arguments, server_version


def _s(p50: float) -> dict[str, Any]:
    return {"p50_ms": p50, "p99_ms": 2 * p50, "n": 10, "reps": 1}


def _results(**over: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "environment": {"rabbitmq": {"version": "3.10.8"}, "date": "today", "nproc": 2},
        "floors": {
            "get_classic": _s(0.5),
            "get_quorum": _s(2.0),
            "reject_deliver_classic": _s(0.6),
            "reject_deliver_quorum": _s(2.5),
            "exclusive_declare": _s(4.0),
        },
        "uncontended_tokens": {
            "token": {"acquire": _s(0.9)},  # 1.8x: met (<= 2x)
            "token_nofence": {"acquire": _s(0.8)},  # 1.6x: not met (<= 1.5x)
            "token_quorum": {"acquire": _s(3.0)},
        },
        "uncontended": {"mutex": {"acquire": _s(8.0)}, "semaphore_c1": {"acquire": _s(9.0)}},
        "handoff": {"token": _s(1.2), "token_nofence": _s(0.9), "token_quorum": _s(3.0)},
        "reask": {
            "mutex": {**_s(12.0), "releaser_won": 31, "handoffs": 100},
            "semaphore": {**_s(13.0), "releaser_won": 2, "handoffs": 100},
        },
        "search": [
            {"capacity": 1, "free_slot": "last", "p50_ms": 10.0},
            {"capacity": 1000, "free_slot": "last", "p50_ms": 40.0},
            {"capacity": 1000, "free_slot": "first", "p50_ms": 11.0},
        ],
        "fairness": {
            "token": {
                "grants": [10, 10, 10, 10],
                "jain": 1.0,
                "wait_p50_ms": 15.0,
                "wait_max_ms": 30.0,
                "wait_max_over_median": 2.0,
                "errors": [],
            },
            "mutex": {
                "grants": [20, 5, 5, 5],
                "jain": 0.74,
                "wait_p50_ms": 15.0,
                "wait_max_ms": 90.0,
                "wait_max_over_median": 6.0,
                "errors": [],
            },
        },
        "peers": {
            "plan": {"processes": 16},
            "handoff": {
                "ours_token": {"2": _s(0.7), "8": _s(0.8)},
                "pg_advisory": {"2": _s(0.8), "8": _s(0.9)},
            },
            "uncontended": {"ours_token": {"cycle": _s(1.0)}, "redis_py": {"cycle": _s(0.4)}},
            "throughput": {
                "4": {
                    "ours_token": {"grants_per_s": 1000.0},
                    "ours_semaphore": {"grants_per_s": 60},
                }
            },
        },
    }
    r.update(over)
    return r


def _by_label(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["label"]: row for row in rows}


def test_targets_ratios_and_verdicts() -> None:
    rows = _by_label(report.targets(_results()))
    acq = rows["token semaphore (fencing on): uncontended acquire"]
    assert (acq["floor_ms"], acq["ours_ms"], acq["ratio"], acq["met"]) == (0.5, 0.9, 1.8, True)
    assert rows["token semaphore, `fencing=False`: uncontended acquire"]["met"] is False
    assert rows["token semaphore, `fencing=False`: handoff"]["ratio"] == 1.5
    assert rows["token semaphore, `fencing=False`: handoff"]["met"] is True  # <= is inclusive
    assert rows["token semaphore, quorum token queue: handoff"]["met"] is None  # information
    mutex = rows["mutex: handoff, releaser asking again at once"]
    assert (mutex["ratio"], mutex["met"]) == (3.0, True)
    assert "31 times in 100" in mutex["note"]
    assert rows["persistent semaphore, C=1: uncontended acquire"]["met"] is False  # 2.25x
    c1000 = rows["persistent semaphore, C=1000, only the last slot free: acquire"]
    assert (c1000["floor_ms"], c1000["ratio"], c1000["met"], c1000["note"]) == (
        10.0,
        4.0,
        False,
        "",
    )


def test_sequence_floors_explain_but_do_not_judge() -> None:
    """The raw floor of the same broker steps is shown beside the target's ratio; the
    verdict stays the ratio to the single operation the target names."""
    r = _results()
    r["floors"]["token_cycle"] = _s(0.45)
    r["floors"]["mutex_handoff"] = _s(6.0)
    rows = _by_label(report.targets(r))
    acq = rows["token semaphore (fencing on): uncontended acquire"]
    assert (acq["sequence_ms"], acq["sequence_ratio"], acq["met"]) == (0.45, 2.0, True)
    mutex = rows["mutex: handoff, releaser asking again at once"]
    assert (mutex["sequence_ms"], mutex["sequence_ratio"], mutex["ratio"]) == (6.0, 2.0, 3.0)
    assert (
        rows["persistent semaphore, C=1: handoff, releaser asking again at once"]["sequence_ms"]
        is None
    )
    table = report.targets_table(r)
    assert any("0.45 (2.0x)" in cell for line in table.rows for cell in line)
    assert report.targets(_results())[0]["sequence_ms"] is None  # older files: no column


def test_a_floor_that_moved_shows_its_spread() -> None:
    r = _results()
    r["floors"]["exclusive_declare"]["p50_reps_ms"] = [1.2, 2.5, 2.2]
    r["floors"]["get_classic"]["p50_reps_ms"] = [0.5, 0.55]
    rows = _by_label(report.targets(r))
    mutex = rows["mutex: uncontended acquire"]
    assert mutex["floor_reps_ms"] == [1.2, 2.5]
    cells = {line[0]: line[2] for line in report.targets_table(r).rows}
    assert cells["mutex: uncontended acquire"] == "4.00 (reps 1.20-2.50)"
    assert cells["token semaphore (fencing on): uncontended acquire"] == "0.50"  # within 25%


def test_targets_without_measurements_are_not_judged() -> None:
    rows = report.targets({"floors": {}, "search": []})
    assert rows and all(row["met"] is None and row["ratio"] is None for row in rows)
    smaller = report.targets(
        _results(
            search=[
                {"capacity": 1, "free_slot": "last", "p50_ms": 10.0},
                {"capacity": 100, "free_slot": "last", "p50_ms": 20.0},
            ]
        )
    )
    assert "smaller C" in smaller[-1]["note"] and smaller[-1]["met"] is None


def test_head_to_head() -> None:
    rows = _by_label(report.head_to_head(_results()))
    ho = rows["token handoff, 2 waiters"]  # the fewest waiters measured
    assert ho["ratio"] == pytest.approx(0.875, abs=0.01) and ho["met"] is True
    assert rows["token uncontended acquire + release"]["met"] is False  # 2.5x redis-py
    token = rows["16 processes on 4 slots, token semaphore: grants/s"]
    assert token["met"] is True and token["ratio"] == pytest.approx(1000 / 195, abs=0.01)
    assert rows["16 processes on 4 slots, persistent semaphore: grants/s"]["met"] is False
    smoke = _results()
    smoke["peers"]["plan"]["processes"] = 3
    assert all(
        row["met"] is None for row in report.head_to_head(smoke) if row.get("higher_is_better")
    )


def test_fairness_summary_and_verdict() -> None:
    waits = [[(0.0, 0.010), (1.0, 1.010)], [(0.0, 0.020)], [(0.0, 0.040)], []]
    s = stats.fairness_summary(waits)
    assert s["grants"] == [2, 1, 1, 0]
    assert s["idle"] == 1
    assert s["wait_p50_ms"] == 15.0  # median of 10, 10, 20, 40
    assert s["wait_max_over_median"] == 2.67
    assert s["waits_over_bound"] == 0  # 40 ms is not over 3 x 15 ms
    assert s["wait_max_at_s"] == 0.0  # the 40 ms wait began with the run
    late = stats.fairness_summary([[(0.0, 0.010), (2.0, 2.100)], [(0.5, 0.510)]])
    assert (late["waits_over_bound"], late["wait_max_at_s"]) == (1, 2.0)
    row = {**late, "label": "x", "met": False, "errors": []}
    assert "(1 of 3 waits over; the longest at 2.0 s)" in report._over(row)
    rows = {row["kind"]: row for row in report.fairness_rows(_results())}
    assert rows["token"]["met"] is True
    assert rows["mutex"]["met"] is False
    assert stats.fairness_summary([[], []])["wait_max_over_median"] is None


def test_report_section_shows_both_lines() -> None:
    other = _results(json_path="benchmarks/results/latest-4.0.json", quick=True)
    other["environment"] = {"rabbitmq": {"version": "4.0.5"}, "date": "then", "nproc": 2}
    section = report.floors_targets(_results(), [other])
    this, (line,) = section["this"], section["others"]
    assert this["version"] == "3.10.8"
    assert (line["version"], line["json_path"]) == ("4.0.5", "benchmarks/results/latest-4.0.json")
    assert line["quick"]
    first = ["token semaphore (fencing on): uncontended acquire", "`basic.get`", "0.50", "0.90"]
    assert this["targets"].rows[0][:4] == first
    cells = [cell for run in (this, line) for row in run["targets"].rows for cell in row]
    assert "1000 grants/s" in cells
    assert sum(cell.startswith("**not met**") for cell in cells) >= 2


def test_report_plot_renders(tmp_path: Path) -> None:
    other = _results()
    other["environment"] = {"rabbitmq": {"version": "4.0.5"}}
    path = tmp_path / report.PLOTS["floors_targets"]
    plots.floors_targets(_results(), [other], path)
    assert path.stat().st_size > 0
    reask = report.reask_table(_results())
    assert reask is not None and "31 of 100" in [cell for row in reask.rows for cell in row]


def test_server_version_and_quorum_arguments() -> None:
    assert server_version({"version": b"3.10.8"}) == (3, 10)
    assert server_version({"version": "4.0.5"}) == (4, 0)
    assert server_version({}) == (0, 0)
    assert queue_arguments((3, 10), quorum=False) == {}
    assert queue_arguments((3, 10), quorum=True) == {"x-queue-type": "quorum"}
    assert queue_arguments((4, 0), quorum=True)["x-delivery-limit"] == -1


def test_results_paths_per_rabbitmq_line() -> None:
    json_310, doc_310, _ = run._default_paths(False, "3.10")
    assert (json_310.name, doc_310.as_posix().endswith("docs/benchmarks.md")) == (
        "latest.json",
        True,
    )
    json_40, doc_40, img_40 = run._default_paths(False, "4.0")
    assert json_40.name == "latest-4.0.json"
    assert doc_40.parent.name == img_40.parent.name == "rabbitmq-4.0"
    assert run._default_paths(True, "4.0")[0].name == "results-4.0.json"
    assert run._line({"environment": {"rabbitmq": {"version": "4.0.5"}}}) == "4.0"
    assert run._line({"environment": {"rabbitmq_line": "3.10"}}) == "3.10"


def test_the_targets_scenario_shows_each_targets_range_over_its_runs() -> None:
    from benchmarks import targets

    fast, slow = _results(), _results(uncontended_tokens={"token": {"acquire": _s(1.1)}})
    rows = {r["label"]: r for r in targets.rows([fast, slow])}
    token = rows["token semaphore (fencing on): uncontended acquire"]
    assert token["ours_ms"] == [0.9, 1.1]
    assert token["met"] == [True, False]  # 1.8x, then 2.2x against <= 2x
    assert "persistent semaphore, C=1: uncontended acquire" in rows
    assert not any("only the last slot free" in label for label in rows)  # not measured
    table = targets.table([fast, slow])
    assert "| 0.90-1.10 | 1.8-2.2x | <= 2x | 1 of 2 |" in table


def test_the_cluster_scenario_judges_issue_37s_targets() -> None:
    from benchmarks import cluster

    def s(p50: float, reps: list[float]) -> dict[str, Any]:
        return {"p50_ms": p50, "p50_reps_ms": reps}

    results = {
        "cluster": {"acquire_mutex": s(3.0, [2.9, 3.2]), "handoff_mutex": s(4.0, [4.0])},
        "cluster_floors": {
            "get_quorum": s(2.5, [2.4, 2.6]),
            "reject_deliver_quorum": s(1.5, [1.5]),
        },
    }
    lines = cluster.target_table(results).splitlines()
    assert lines[2].endswith("| 1.2x | <= 1.5x | met |")
    assert lines[3].endswith("| 2.7x | <= 2x | **not met** |")
    assert "2.90-3.20" in lines[2]
