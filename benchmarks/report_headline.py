"""The "Floors and targets" section of docs/benchmarks.md and its plot (issue 12).

Rendered from results JSON alone: this run's, and those of the other RabbitMQ lines given
to ``render`` (``--also``), each judged against its own floors, measured in its own run.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

from . import floors, headline

PLOT = "bench-floors-targets.png"
VERDICT = {True: "**met**", False: "**not met**", None: "-"}


def _f(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    rule = "|:---|" + "|".join("---:" for _ in header[1:]) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def headline_floors() -> list[str]:
    """Keys of the raw-aiormq floors in ``results["floors"]``, in table order."""
    return list(floors.RAW)


def rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The target rows of a results file (recomputed: older files judge by today's rules)."""
    return headline.targets(r) + headline.head_to_head(r)


def _value(row: dict[str, Any], key: str) -> str:
    v = row[key]
    if row.get("higher_is_better"):
        return "n/a" if v is None else f"{v:.0f} grants/s"
    return _f(v)


def targets_table(r: dict[str, Any]) -> str:
    out = []
    for row in rows(r):
        ratio = row["ratio"]
        out.append(
            [
                row["label"],
                row["floor_label"],
                _value(row, "floor_ms"),
                _value(row, "ours_ms"),
                "n/a" if ratio is None else f"{ratio:.1f}x",
                row["target"],
                VERDICT[row["met"]] + (f" ({row['note']})" if row["note"] else ""),
            ]
        )
    return _table(
        ["operation (p50)", "floor", "floor ms", "ours ms", "ours / floor", "target", "met?"], out
    )


def fairness_table(r: dict[str, Any]) -> str:
    out = []
    for row in headline.fairness_rows(r):
        out.append(
            [
                row["label"],
                " / ".join(str(g) for g in row["grants"]),
                _f(row.get("jain"), 3),
                _f(row.get("wait_p50_ms"), 1),
                _f(row.get("wait_max_ms"), 1),
                _f(row.get("wait_max_over_median"), 2),
                str(len(row.get("errors", []))),
                VERDICT[row["met"]],
            ]
        )
    if not out:
        return "The fairness loop was not measured in this run."
    return _table(
        [
            "primitive",
            "grants per process",
            f"Jain (>= {headline.JAIN_TARGET})",
            "wait p50 ms",
            "wait max ms",
            f"max / median (<= {headline.WAIT_RATIO_TARGET:g})",
            "errors",
            "met?",
        ],
        out,
    )


def reask_table(r: dict[str, Any]) -> str:
    ra = r.get("reask", {})
    out = []
    for kind, s in ra.items():
        out.append(
            [
                headline.LABELS.get(kind, kind),
                _f(s["p50_ms"]),
                _f(s["p99_ms"]),
                _f(s.get("to_waiter", {}).get("p50_ms")),
                _f(s.get("to_releaser", {}).get("p50_ms")),
                f"{s['releaser_won']} of {s['handoffs']}",
            ]
        )
    if not out:
        return "Not measured in this run."
    return _table(
        [
            "lock",
            "release -> next grant p50 ms",
            "p99 ms",
            "p50 when the waiter got it",
            "p50 when the releaser got it back",
            "releaser won it back",
        ],
        out,
    )


def _summary(r: dict[str, Any]) -> str:
    judged = [x["met"] for x in rows(r) + headline.fairness_rows(r) if x["met"] is not None]
    return f"{sum(judged)} of {len(judged)} targets met"


def _source(r: dict[str, Any]) -> str:
    env = r.get("environment", {})
    rmq = env.get("rabbitmq", {})
    other = env.get("other_load_cores")
    busy = (
        f"; other work kept {other} of {env.get('nproc', '?')} cores busy"
        if isinstance(other, (int, float)) and other >= 0.2
        else ""
    )
    smoke = ", **smoke run (`--quick`)**" if r.get("quick") else ""
    return (
        f"RabbitMQ {rmq.get('version', '?')}, `{r.get('json_path', '?')}`, "
        f"{env.get('date', '?')}{smoke}{busy}"
    )


def section(r: dict[str, Any], also: list[dict[str, Any]]) -> str:
    """This run's tables, then a compact one per other RabbitMQ line."""
    parts = [
        f"### RabbitMQ {r.get('environment', {}).get('rabbitmq', {}).get('version', '?')} "
        f"(this run): {_summary(r)}",
        targets_table(r),
        "Fairness: "
        f"{r.get('headline_plan', {}).get('fair_processes', 4)} processes loop acquire -> "
        f"hold {r.get('headline_plan', {}).get('fair_hold', 0.005) * 1000:.0f} ms -> release "
        "-> acquire on one permit; a wait is `acquire()` called -> returned.",
        fairness_table(r),
    ]
    for other in also:
        parts += [
            f"### {_source(other)}: {_summary(other)}",
            targets_table(other),
            fairness_table(other),
        ]
    return "\n\n".join(parts)


def plot(r: dict[str, Any], also: list[dict[str, Any]], path: Path) -> None:
    """ours / floor per target row (log scale) with the target marked, per RabbitMQ line."""
    runs = [r, *also]
    labels = [x["label"] for x in rows(r) if not x.get("higher_is_better")]
    fig, ax = plt.subplots(figsize=(9.0, 0.42 * len(labels) + 1.8))
    ys = list(range(len(labels)))[::-1]
    height = 0.8 / max(1, len(runs))
    colors = ["#2171b5", "#238b45", "#6a51a3"]
    for i, run in enumerate(runs):
        by = {x["label"]: x for x in rows(run)}
        version = run.get("environment", {}).get("rabbitmq", {}).get("version", "?")
        xs, yy = [], []
        for y, label in zip(ys, labels, strict=True):
            row = by.get(label)
            if row is None or row["ratio"] is None:
                continue
            xs.append(row["ratio"])
            yy.append(y + 0.4 - height * (i + 0.5))
        ax.barh(yy, xs, height=height, color=colors[i % len(colors)], label=f"RabbitMQ {version}")
    first = {x["label"]: x for x in rows(r)}
    for y, label in zip(ys, labels, strict=True):
        target = first[label]["target"]
        if target.startswith("<="):
            t = float(target[2:].strip().rstrip("x"))
            ax.plot([t, t], [y - 0.45, y + 0.45], color="#cb181d", linewidth=2)
    ax.axvline(1.0, color="grey", linestyle=":", label="the floor (1x)")
    ax.plot([], [], color="#cb181d", linewidth=2, label="target")
    ax.set_yticks(ys, [textwrap.fill(label.replace("`", ""), 34) for label in labels], fontsize=7)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("ours / floor, p50 (log scale; left of the red mark = target met)")
    ax.set_title("Ours against the broker's floor, same run")
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(
    r: dict[str, Any], also: list[dict[str, Any]], img_dir: Path, img_rel: str
) -> dict[str, str]:
    plot(r, also, img_dir / PLOT)
    return {
        "targets_section": section(r, also),
        "reask_table": reask_table(r),
        "img_floors_targets": f"{img_rel}/{PLOT}",
    }
