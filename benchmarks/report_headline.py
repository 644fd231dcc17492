"""The data of the "Floors and targets" section of docs/benchmarks.md (issue 12).

From results JSON alone: this run's, and those of the other RabbitMQ lines given to
``context`` (``--also``), each judged against its own floors, measured in its own run.
"""

from __future__ import annotations

from typing import Any

from . import headline
from .tables import Table, num, verdict


def rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The target rows of a results file (recomputed: older files judge by today's rules)."""
    return headline.targets(r) + headline.head_to_head(r)


def version(r: dict[str, Any]) -> str:
    return str(r.get("environment", {}).get("rabbitmq", {}).get("version", "?"))


def _value(row: dict[str, Any], key: str) -> str:
    v = row[key]
    if row.get("higher_is_better"):
        return "n/a" if v is None else f"{v:.0f} grants/s"
    return num(v)


def _reps(row: dict[str, Any]) -> str:
    """The floor's lowest and highest p50 over its repetitions, when they differ by more
    than a quarter (a floor that moved while it was measured)."""
    reps = row.get("floor_reps_ms")
    if not reps or reps[0] <= 0 or reps[1] / reps[0] <= 1.25:
        return ""
    return f" (reps {num(reps[0])}-{num(reps[1])})"


def _sequence(row: dict[str, Any]) -> str:
    seq, ratio = row.get("sequence_ms"), row.get("sequence_ratio")
    if seq is None:
        return ""
    return f"{num(seq)} ({'n/a' if ratio is None else f'{ratio:.1f}x'})"


def targets_table(r: dict[str, Any]) -> Table:
    return Table(
        [
            "operation (p50)",
            "floor",
            "floor ms",
            "ours ms",
            "ours / floor",
            "target",
            "met?",
            "same steps, raw: ms (ours / it)",
        ],
        [
            [
                row["label"],
                row["floor_label"],
                _value(row, "floor_ms") + _reps(row),
                _value(row, "ours_ms"),
                "n/a" if row["ratio"] is None else f"{row['ratio']:.1f}x",
                row["target"],
                verdict(row["met"]) + (f" ({row['note']})" if row["note"] else ""),
                _sequence(row),
            ]
            for row in rows(r)
        ],
    )


def _over(row: dict[str, Any]) -> str:
    """How many waits exceeded the bound, and when the longest began (newer runs only)."""
    over, n = row.get("waits_over_bound"), (row.get("waits") or {}).get("n")
    if over is None or not n:
        return ""
    at = row.get("wait_max_at_s")
    return f" ({over} of {n} waits over; the longest at {at:.1f} s)" if at is not None else ""


def fairness_table(r: dict[str, Any]) -> Table | None:
    out = [
        [
            row["label"],
            " / ".join(str(g) for g in row["grants"]),
            num(row.get("jain"), 3),
            num(row.get("wait_p50_ms"), 1),
            num(row.get("wait_max_ms"), 1),
            num(row.get("wait_max_over_median"), 2) + _over(row),
            str(len(row.get("errors", []))),
            verdict(row["met"]),
        ]
        for row in headline.fairness_rows(r)
    ]
    header = [
        "primitive",
        "grants per process",
        f"Jain (>= {headline.JAIN_TARGET})",
        "wait p50 ms",
        "wait max ms",
        f"max / median (<= {headline.WAIT_RATIO_TARGET:g})",
        "errors",
        "met?",
    ]
    return Table(header, out) if out else None


def reask_table(r: dict[str, Any]) -> Table | None:
    out = [
        [
            headline.LABELS.get(kind, kind),
            num(s["p50_ms"]),
            num(s["p99_ms"]),
            num(s.get("to_waiter", {}).get("p50_ms")),
            num(s.get("to_releaser", {}).get("p50_ms")),
            f"{s['releaser_won']} of {s['handoffs']}",
        ]
        for kind, s in r.get("reask", {}).items()
    ]
    header = [
        "lock",
        "release -> next grant p50 ms",
        "p99 ms",
        "p50 when the waiter got it",
        "p50 when the releaser got it back",
        "releaser won it back",
    ]
    return Table(header, out) if out else None


def busy_cores(env: dict[str, Any]) -> float | None:
    """Cores other work kept busy during the run, when enough to mention (>= 0.2)."""
    other = env.get("other_load_cores")
    return other if isinstance(other, (int, float)) and other >= 0.2 else None


def line(r: dict[str, Any]) -> dict[str, Any]:
    """One RabbitMQ line's part of the section: its source, verdict count and tables."""
    judged = [x["met"] for x in rows(r) + headline.fairness_rows(r) if x["met"] is not None]
    env = r.get("environment", {})
    return {
        "version": version(r),
        "json_path": r.get("json_path", "?"),
        "date": env.get("date", "?"),
        "quick": bool(r.get("quick")),
        "busy": busy_cores(env),
        "nproc": env.get("nproc", "?"),
        "met": sum(judged),
        "judged": len(judged),
        "targets": targets_table(r),
        "fairness": fairness_table(r),
    }


def context(r: dict[str, Any], also: list[dict[str, Any]]) -> dict[str, Any]:
    """This run's line, the other lines', the fairness plan and the re-ask table."""
    plan = r.get("headline_plan", {})
    return {
        "this": line(r),
        "others": [line(other) for other in also],
        "fair_processes": plan.get("fair_processes", 4),
        "fair_hold_ms": plan.get("fair_hold", 0.005) * 1000,
        "reask": reask_table(r),
    }
