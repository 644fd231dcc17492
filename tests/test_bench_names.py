"""The names benchmark's pure logic (benchmarks/names.py): no broker, no servers."""

from __future__ import annotations

import pytest

from benchmarks.names import (
    merge,
    parse_state,
    per_item,
    settled,
    split,
    summarize_ms,
    summarize_workers,
    table,
)


def test_summarize_ms() -> None:
    s = summarize_ms([0.001, 0.002, 0.003, 0.004])
    assert s["n"] == 4 and s["p50_ms"] == 2.5 and s["max_ms"] == 4.0
    assert s["p95_ms"] == pytest.approx(3.85)
    assert summarize_ms([])["p50_ms"] is None


def test_split_deals_round_robin() -> None:
    shares = split([f"n{i}" for i in range(7)], 3)
    assert shares == [["n0", "n3", "n6"], ["n1", "n4"], ["n2", "n5"]]
    assert split(["a"], 0) == [["a"]] and split(["a", "b"], 8) == [["a"], ["b"]]


def test_parse_state_3_10_and_4_x() -> None:
    assert parse_state("{630,139181728,1613,{930,927}}\n") == {
        "queues": 630,
        "memory": 139181728,
        "processes": 1613,
        "handles": 930,
        "handles_limit": 927,
    }
    four = parse_state("{0,80000000,400,{-1,-1}}")  # no file_handle_cache on 4.x
    assert four["handles"] is None and four["handles_limit"] is None
    with pytest.raises(ValueError):
        parse_state("{badrpc,nodedown}")


def test_settled_within_5_percent_or_slack() -> None:
    start = {"queues": 0, "fds": 35, "memory": 100_000_000, "processes": 269}
    assert settled(start, {"queues": 2, "fds": 45, "memory": 105_000_000, "processes": 280})
    assert not settled(start, {**start, "queues": 3})
    assert not settled(start, {**start, "memory": 105_000_001})
    assert settled(start, {"queues": None, "memory": 90_000_000})  # missing: not judged


def test_per_item() -> None:
    d = per_item({"queues": 10, "memory": 1000, "fds": 5}, {"queues": 40, "memory": 4000}, 10)
    assert d["queues"] == 3.0 and d["memory"] == 300.0
    assert d["fds"] is None and d["processes"] is None
    assert per_item({"queues": 1}, {"queues": 2}, 0)["queues"] is None


def test_parts_merge_and_summarize() -> None:
    w: dict[str, object] = {}
    merge(w, {"first": [0.01], "release": [0.001], "done": 1, "granted": 1, "errors": {}})
    merge(w, {"first": [0.03], "release": [], "done": 3, "granted": 2, "timeouts": 1})
    assert w["first"] == [0.01, 0.03] and w["done"] == 3  # samples add up, counts replace
    other = {"first": [0.02], "warm": [0.005], "done": 1, "errors": {"boom": 2}, "failures": 2}
    s = summarize_workers([w, other], wall=2.0)  # type: ignore[list-item]
    assert s["names_done"] == 4 and s["names_per_s"] == 2.0
    assert s["granted"] == 2 and s["timeouts"] == 1 and s["failures"] == 2
    assert s["first_use"]["p50_ms"] == 20.0 and s["warm"]["n"] == 1
    assert s["errors"] == {"boom": 2}


def test_table_renders_with_and_without_broker_state() -> None:
    amqp = summarize_workers([{"first": [0.04], "done": 1, "granted": 1}], 1.0)
    results = {
        "plan": {"names": 1, "procs": 1},
        "environment": {"broker": "RabbitMQ 3.10.8 (one node)", "amqp_locks_git": "e0bde30"},
        "amqp": amqp,
        "states": {
            "start": {"queues": 0, "fds": 35, "memory": 2**26, "processes": 269},
            "after_release": {"queues": 2, "fds": 35, "memory": 2**27, "processes": 273},
            "watch": [{"t_s": 10.0, "queues": 2, "fds": 35, "memory": 2**27}],
        },
        "node_limits": {"open_files": 1024},
        "stalled": "status stopped answering",
    }
    md = table(results)
    assert "| names/s | 1.0 |" in md and "0 -> 2 -> 2" in md and "(1,024)" in md
    assert "64.0 MiB -> 128.0 MiB" in md and "STALLED" in md
    bare = table({"plan": {"names": 1, "procs": 1}, "environment": {}, "amqp": amqp})
    assert "n/a" in bare
