"""The ``targets`` scenario: issue 37's floor table with its spread. Only the measurements
the ratio targets need (raw aiormq floors, uncontended acquires, handoffs, re-asks), on one
private node, repeated ``runs`` times in one process; each target's floor, ours and ratio
are given as the range over the runs, with how many runs met it.

A full report (``python -m benchmarks.run``) takes about 20 minutes, mostly the peers;
this takes a few minutes per run, so three runs per RabbitMQ line fit in one sitting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from . import compare, floors, handoff, report

#: The rows judged here (the persistent semaphore's C = 1000 sweep and the head-to-head
#: rows come from the full report).
KINDS = ["semaphore", "mutex", "token", "token_nofence", "token_quorum"]


def measure_once(
    url: str, cfg: dict[str, Any], broker_pid: int | None, log: Callable[[str], None]
) -> dict[str, Any]:
    """One run: what :func:`report.targets` reads, measured as the full report does."""
    pids = {"client": os.getpid(), "broker": broker_pid}
    log("  raw aiormq floors")
    results: dict[str, Any] = {"floors": floors.raw_floors(url, *cfg["raw_floors"])}
    log("  uncontended acquire/release")
    uc = compare.uncontended(list(KINDS), {"amqp": url}, cfg["uncontended"], pids)
    results["uncontended"] = {"semaphore_c1": uc.pop("semaphore"), "mutex": uc.pop("mutex")}
    results["uncontended_tokens"] = uc
    for key in ("handoff", "reask"):
        log(f"  {key}")
        results[key] = getattr(handoff, key)(url, cfg["handoff"])
    return results


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per target: the floor, ours and ratio of every run, and how many runs met it."""
    per_run = [report.targets(r) for r in runs]
    out = []
    for i, first in enumerate(per_run[0]):
        if first["floor_label"] == "its C=1 acquire":
            continue  # the C = 1000 sweep is not measured here
        cells = [rs[i] for rs in per_run]
        out.append(
            {
                "label": first["label"],
                "floor_label": first["floor_label"],
                "target": first["target"],
                "floor_ms": [c["floor_ms"] for c in cells],
                "ours_ms": [c["ours_ms"] for c in cells],
                "ratio": [c["ratio"] for c in cells],
                "met": [c["met"] for c in cells],
                "sequence_ms": [c.get("sequence_ms") for c in cells],
            }
        )
    return out


def _span(xs: list[float | None], fmt: str = "{:.2f}", unit: str = "") -> str:
    got = [x for x in xs if x is not None]
    if not got:
        return "n/a"
    lo, hi = min(got), max(got)
    return fmt.format(lo) + unit if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}{unit}"


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table: ranges over the runs (p50 of each run)."""
    runs_label = f"{len(runs)} run{'s' if len(runs) > 1 else ''}"
    head = (
        f"| operation (p50, {runs_label}) | floor | floor ms | ours ms | ours / floor "
        "| target | runs met | same steps, raw ms |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for row in rows(runs):
        judged = [m for m in row["met"] if m is not None]
        met = f"{sum(judged)} of {len(judged)}" if judged else "-"
        lines.append(
            f"| {row['label']} | {row['floor_label']} | {_span(row['floor_ms'])} "
            f"| {_span(row['ours_ms'])} | {_span(row['ratio'], '{:.1f}', 'x')} "
            f"| {row['target']} | {met} | {_span(row['sequence_ms'])} |"
        )
    return "\n".join(lines)
