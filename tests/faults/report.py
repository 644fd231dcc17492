"""Measured figures of fault runs, kept for the soak report and docs/failure-semantics.md.

Every scenario appends one JSON line (test id, primitive, verdict, figures) to
``$AMQP_LOCKS_FAULT_RESULTS`` (default ``tests/faults/results/runs.jsonl``, git-ignored).
:func:`markdown` turns such a file into the summary table `scripts/soak` writes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .checker import Verdict

RESULTS = Path(__file__).parent / "results"


def results_file() -> Path:
    path = Path(os.environ.get("AMQP_LOCKS_FAULT_RESULTS") or RESULTS / "runs.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def record(test: str, kind: str, verdict: Verdict, **figures: Any) -> dict[str, Any]:
    """Append one run's verdict and figures (seconds, counts) to the results file."""
    v = asdict(verdict)
    v["min_margin"] = verdict.min_margin
    v["unended"] = len(verdict.unended)
    row = {"time": time.time(), "test": test, "kind": kind, "verdict": v, "figures": figures}
    with results_file().open("a") as f:
        f.write(json.dumps(row, default=float) + "\n")
    return row


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table row per run: the verdict's counts and the scenario's figures."""
    out = [
        "| test | primitive | grants | overlaps | key overlaps | stale accepted | rejected "
        "| regressions | leaked | min margin (s) | figures |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["verdict"]
        figures = ", ".join(f"{k}={_fmt(x)}" for k, x in r["figures"].items())
        margin = "" if v["min_margin"] is None else f"{v['min_margin']:.3f}"
        out.append(
            f"| {r['test']} | {r['kind']} | {v['grants']} | {v['overlaps']} | "
            f"{v['key_overlaps']} | {v['stale_accepted']} | {v['rejected']} | "
            f"{v['token_regressions']} | {v['leaked']} | {margin} | {figures} |"
        )
    return "\n".join(out) + "\n"


def summary(rows: list[dict[str, Any]], *, header: dict[str, Any]) -> str:
    """The soak's markdown report: how it ran, then every run's verdict and figures."""
    lines = ["# Fault soak report", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    failing = [
        r
        for r in rows
        if r["verdict"]["stale_accepted"]
        or r["verdict"]["token_regressions"]
        or r["verdict"]["leaked"]
        or r["figures"].get("promised_overlaps")
    ]
    lines += [f"- runs recorded: {len(rows)}, with (b)/(c)/promised-(a) findings: {len(failing)}"]
    lines += ["", "## By scenario and primitive (min .. max over runs)", "", aggregate(rows)]
    lines += ["## Every run", "", markdown([{**r, "figures": _brief(r["figures"])} for r in rows])]
    return "\n".join(lines)


def aggregate(rows: list[dict[str, Any]]) -> str:
    """One row per (test, primitive): run count, the verdict's worst counts, and the
    numeric figures' ranges."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["test"], r["kind"]), []).append(r)
    out = [
        "| test | primitive | runs | overlaps (max) | stale accepted (max) | regressions (max) "
        "| leaked (max) | min margin (s) | figures (min .. max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (test, kind), group in groups.items():
        vs = [g["verdict"] for g in group]
        margins = [v["min_margin"] for v in vs if v["min_margin"] is not None]
        ranges = []
        for key in group[0]["figures"]:
            values = [g["figures"].get(key) for g in group]
            nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            if key in ("seed", "duration", "holders") or not nums:
                continue
            lo, hi = min(nums), max(nums)
            ranges.append(f"{key}={_fmt(lo)}" if lo == hi else f"{key}={_fmt(lo)}..{_fmt(hi)}")
        out.append(
            f"| {test} | {kind} | {len(group)} | {max(v['overlaps'] for v in vs)} | "
            f"{max(v['stale_accepted'] for v in vs)} | {max(v['token_regressions'] for v in vs)} | "
            f"{max((v['leaked'] or 0) for v in vs)} | "
            f"{_fmt(min(margins)) if margins else ''} | {', '.join(ranges)} |"
        )
    return "\n".join(out) + "\n"


def _brief(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if k != "plan"}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Markdown summary of a fault results file.")
    parser.add_argument("results", type=Path)
    parser.add_argument("--meta", action="append", default=[], help="KEY=VALUE for the header")
    args = parser.parse_args(argv)
    header = dict(m.split("=", 1) for m in args.meta)
    rows = load(args.results) if args.results.exists() else []
    print(summary(rows, header=header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
