"""Every plot of docs/benchmarks.md (matplotlib, Agg), each a function of the results JSON
named after its file (``report.PLOTS``) and drawn inside one helper, ``figure``
(``bar_axis`` labels one horizontal bar per row)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from . import report
from .peers.kinds import KINDS

BLUE, LIGHT, GREEN, RED = "#2171b5", "#c6dbef", "#238b45", "#cb181d"
ORANGE, PURPLE, PEER = "#fd8d3c", "#6a51a3", "#9e9ac8"
GROUP_COLORS = {"tuned": GREEN, "default": RED}
LOWER_RIGHT = {"fontsize": 7, "loc": "lower right"}
#: A reference line across a plot: ("v" or "h", value, color, style, label).
Line = tuple[str, float, str, str, str | None]
#: The floors drawn as reference lines, by colour.
FLOORS = {"get_classic": GREEN, "reject_deliver_classic": GREEN, "exclusive_declare": RED}


def floor_lines(
    fl: dict[str, Any], vh: str, *keys: str, fmt: str = "floor: {} p50 {:.2f} ms"
) -> list[Line]:
    """Dashed lines at the p50 of the floors ``keys`` that were measured."""
    return [
        (vh, fl[k]["p50_ms"], FLOORS[k], "--", fmt.format(report.FLOORS[k], fl[k]["p50_ms"]))
        for k in keys
        if k in fl
    ]


@contextmanager
def figure(
    path: Path,
    size: tuple[float, float],
    ncols: int = 1,
    log: str = "",
    grid: str | None = None,
    lines: Sequence[Line] = (),
    legend: dict[str, Any] | None = None,
    **labels: str,
) -> Iterator[Any]:
    """A figure of ``ncols`` axes (yields one axes, or a list): ``labels`` (title, xlabel,
    ylabel), log scales (``log``: "x" and/or "y") and the grid ("both", "x" or "y") on every
    axes; the reference lines and the legend on the first; then saved and closed."""
    fig, axes = plt.subplots(1, ncols, figsize=size)
    every = list(axes) if ncols > 1 else [axes]
    for ax in every:
        ax.set(**labels, **{f"{a}scale": "log" for a in log})
        if grid is not None:
            ax.grid(which="both", alpha=0.3, **({} if grid == "both" else {"axis": grid}))
    yield axes
    for vh, value, color, style, label in lines:
        getattr(every[0], f"ax{vh}line")(value, color=color, linestyle=style, label=label)
    # No legend over no data (a partial run): matplotlib would warn and draw an empty box.
    if legend is not None and ("handles" in legend or every[0].get_legend_handles_labels()[0]):
        every[0].legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_axis(
    ax: Any, labels: list[str], fontsize: float | None, xfmt: str | None, minor_labels: bool = True
) -> list[int]:
    """One horizontal bar per label, the first on top, on a log x axis (tick labels ``xfmt``,
    minor ones unless not ``minor_labels``): their y positions."""
    ys = list(range(len(labels)))[::-1]
    ax.set_yticks(ys, labels, **({"fontsize": fontsize} if fontsize else {}))
    ax.set_xscale("log")
    if xfmt is not None:
        ax.xaxis.set_major_formatter(FormatStrFormatter(xfmt))
    if not minor_labels:
        ax.xaxis.set_minor_formatter(NullFormatter())
    return ys


def _p50_p99_bars(ax: Any, ys: list[int], stats: list[dict[str, Any]]) -> None:
    ax.barh(ys, [s["p99_ms"] for s in stats], color=LIGHT, label="p99")
    ax.barh(ys, [s["p50_ms"] for s in stats], color=BLUE, label="p50")


# ------------------------------------------------------------------------ this run


def uncontended(r: dict[str, Any], path: Path) -> None:
    fl, uc, ut = r["floors"], r["uncontended"], r.get("uncontended_tokens", {})
    items = [("loopback TCP round trip", fl["loopback_tcp"])]
    items += [("broker round trip", fl["broker_round_trip"])]
    ours = (("semaphore_c1", "semaphore C=1"), ("mutex", "mutex"))
    items += [(f"{label}: {op}", uc[k][op]) for k, label in ours for op in ("acquire", "release")]
    tokens = (("token", "token"), ("token_nofence", "token, fencing=False"))
    items += [(f"{label}: acquire", ut[k]["acquire"]) for k, label in tokens if k in ut]
    marks = floor_lines(fl, "v", "get_classic", "exclusive_declare")
    with figure(
        path,
        (7.5, 0.35 * len(items) + 1.5),
        grid="x",
        lines=marks,
        legend=LOWER_RIGHT,
        title="Floors and uncontended operations",
        xlabel="latency (ms, log scale)",
    ) as ax:
        _p50_p99_bars(ax, bar_axis(ax, [x[0] for x in items], None, None), [s for _, s in items])


def latency_vs_slots(r: dict[str, Any], path: Path) -> None:
    rows, rtt = r["search"], r["floors"]["broker_round_trip"]["p50_ms"]
    c1 = [row for row in rows if row["capacity"] == rows[0]["capacity"]]
    marks: list[Line] = [("h", rtt, "grey", ":", f"broker round trip p50 ({rtt:.2f} ms)")]
    marks += floor_lines(r["floors"], "h", "exclusive_declare", fmt="floor: {} p50 ({:.2f} ms)")
    marks += [("h", 3 * c1[0]["p50_ms"], ORANGE, "-.", "target: 3 x C=1 p50")] if c1 else []
    with figure(
        path,
        (7.0, 4.2),
        log="xy",
        grid="both",
        lines=marks,
        legend={"fontsize": 8},
        title="Acquire latency vs number of slots",
        ylabel="acquire latency (ms, log)",
        xlabel="slots C (C-1 held by another connection)",
    ) as ax:
        for position, color in (("last", RED), ("first", BLUE)):
            sel = c1 + [x for x in rows if x["free_slot"] == position and x not in c1]
            sel.sort(key=lambda x: x["capacity"])
            for key, style, alpha in (("p50", "o-", 1.0), ("p99", "o--", 0.5)):
                xs, ys = [x["capacity"] for x in sel], [x[f"{key}_ms"] for x in sel]
                label = f"free slot {position}: {key}"
                ax.plot(xs, ys, style, color=color, alpha=alpha, label=label)


def handoff_cdf(r: dict[str, Any], path: Path) -> None:
    c, plan = r["contention"], r["contention"]["plan"]
    xs = sorted(x for x in c["handoff_samples_ms"] if x > 0)
    title = f"Handoff CDF: {plan['processes']} processes, {plan['slots']} slots, "
    title += f"{c['runs']} x {plan['seconds']:.0f} s"
    with figure(
        path,
        (7.0, 3.8),
        grid="both",
        title=title,
        ylabel="fraction of handoffs",
        xlabel="release -> next grant of the same slot (ms, log)",
    ) as ax:
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=GREEN)
            for q, key in ((0.5, "p50_ms"), (0.99, "p99_ms")):
                v = c["handoff"][key]
                ax.axvline(v, color="grey", linestyle=":")
                ax.text(v, q, f" p{int(q * 100)} {v:.1f} ms", fontsize=8, va="bottom")
            ax.set_xscale("log")


def grants_per_process(r: dict[str, Any], path: Path) -> None:
    c = r["contention"]
    grants = c["grants_per_process_last_run"]
    mean = sum(grants) / len(grants) if grants else 0.0
    marks: list[Line] = [("h", mean, "grey", ":", f"mean {mean:.0f}")] if grants else []
    title = f"Grants per process (last run of {c['runs']})"
    with figure(
        path,
        (7.0, 3.2),
        lines=marks,
        legend={},
        title=title,
        xlabel="process",
        ylabel="grants",
    ) as ax:
        ax.bar(range(1, len(grants) + 1), grants, color=PURPLE)
        ax.set_xticks(range(1, len(grants) + 1))


def handoff_compare(r: dict[str, Any], path: Path) -> None:
    fl = r["floors"]
    rtt = fl["broker_round_trip"]["p50_ms"]
    marks: list[Line] = [("v", rtt, "grey", ":", f"RTT p50 {rtt:.2f} ms")]
    marks += floor_lines(fl, "v", "reject_deliver_classic", "exclusive_declare")
    legend = {"fontsize": 7, "loc": "upper center", "bbox_to_anchor": (0.5, -0.2), "ncol": 2}
    panels = [(r.get("handoff", {}), "release -> blocked waiter holds")]
    panels += [(r.get("crash", {}), "holder kill -9 -> blocked waiter holds")]
    with figure(
        path, (10.0, 4.0), 2, grid="x", lines=marks, legend=legend, xlabel="ms (log scale)"
    ) as axes:
        for ax, (data, title) in zip(axes, panels, strict=True):
            kinds = [k for k in report.HANDOFF_KINDS if k in data]
            names = [report.KIND_LABELS[k].replace(", ", "\n") for k in kinds]
            _p50_p99_bars(ax, bar_axis(ax, names, 8, "%g", False), [data[k] for k in kinds])
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.set_title(title, fontsize=10)
        axes[1].legend(**legend)


def _group_bars(
    ax: Any, ys: list[int], per: list[dict[str, Any]], scale: float, samples: bool
) -> None:
    """Bars at p50 of the tuned (above) and default (below) group per row, with samples."""
    for off, group in ((0.18, "tuned"), (-0.18, "default")):
        color, xs, yy = GROUP_COLORS[group], [], []
        for y, s in ((y, groups.get(group)) for y, groups in zip(ys, per, strict=True)):
            if not s or "error" in s:
                continue
            if s.get("censored"):
                ax.barh(y + off, s["cap_s"] * 1000, height=0.34, color=color, alpha=0.15)
                ax.text(s["cap_s"] * 1000, y + off, " never", fontsize=7, va="center")
            elif s.get("n") != 0:
                alpha = 0.6 if samples else 0.7
                ax.barh(y + off, s["p50_ms"] / scale, height=0.34, color=color, alpha=alpha)
                if samples:
                    xs += [x / scale for x in s["samples_ms"]]
                    yy += [y + off] * len(s["samples_ms"])
                else:
                    ax.scatter(s["samples_ms"], [y + off] * len(s["samples_ms"]), s=8, color=color)
        if xs:
            ax.scatter(xs, yy, s=10, color=color, label=f"{group} settings: samples; bar: p50")


def failover(r: dict[str, Any], path: Path) -> None:
    fo = report.failover(r)
    labels, per = fo["labels"], fo["per"]
    with figure(
        path,
        (8.5, 0.45 * len(labels) + 1.6),
        grid="x",
        title="Locker failover",
        xlabel="master kill -9 -> standby is master (s, log scale)",
        legend=LOWER_RIGHT,
    ) as ax:
        ys = bar_axis(ax, labels, 8, "%g")
        _group_bars(ax, ys, [per[label] for label in labels], 1000, samples=True)


def floors_targets(r: dict[str, Any], also: list[dict[str, Any]], path: Path) -> None:
    """ours / floor per target row (log scale) with the target marked, per RabbitMQ line."""
    runs, first = [r, *also], {x["label"]: x for x in report.target_rows(r)}
    labels = [label for label, x in first.items() if not x.get("higher_is_better")]
    rows = [textwrap.fill(x.replace("`", ""), 34) for x in labels]
    with figure(
        path,
        (9.0, 0.42 * len(rows) + 1.8),
        grid="x",
        legend=LOWER_RIGHT,
        title="Ours against the broker's floor, same run",
        xlabel="ours / floor, p50 (log scale; left of the red mark = target met)",
    ) as ax:
        ys = bar_axis(ax, rows, 7, "%gx", False)
        height = 0.8 / max(1, len(runs))
        for i, run in enumerate(runs):
            by = {x["label"]: x["ratio"] for x in report.target_rows(run)}
            off = [y + 0.4 - height * (i + 0.5) for y in ys]
            bars = [(by.get(x), y) for y, x in zip(off, labels, strict=True)]
            bars = [(x, y) for x, y in bars if x is not None]
            color, label = (BLUE, GREEN, PURPLE)[i % 3], f"RabbitMQ {report.version(run)}"
            ax.barh(
                [y for _, y in bars], [x for x, _ in bars], height=height, color=color, label=label
            )
        for y, label in zip(ys, labels, strict=True):
            if first[label]["target"].startswith("<="):
                t = float(first[label]["target"][2:].strip().rstrip("x"))
                ax.plot([t, t], [y - 0.45, y + 0.45], color=RED, linewidth=2)
        ax.axvline(1.0, color="grey", linestyle=":", label="the floor (1x)")
        ax.plot([], [], color=RED, linewidth=2, label="target")


# ------------------------------------------------------------------------ the peers


def _peer_barh(ax: Any, kinds: list[str], p50: list[float], p99: list[float] | None) -> None:
    ys = bar_axis(ax, [report.plain(k) for k in kinds], 8, "%g")
    colors = [BLUE if KINDS[k].ours else ORANGE if KINDS[k].polls else PEER for k in kinds]
    if p99 is not None:
        ax.barh(ys, p99, color=colors, alpha=0.3)
    ax.barh(ys, p50, color=colors)


def _peer_legend(p99: bool = True) -> dict[str, Any]:
    colors = {BLUE: "amqp-locks", PEER: "peer, pushed wake-ups", ORANGE: "peer, polls"}
    handles = [Patch(color=color, label=label) for color, label in colors.items()]
    handles += [Patch(color="grey", alpha=0.3, label="p99 (light)")] if p99 else []
    return {"handles": handles, **LOWER_RIGHT}


def compare_uncontended(r: dict[str, Any], path: Path) -> None:
    uc = {k: s for k, s in r["peers"].get("uncontended", {}).items() if report.ok(s)}
    rtt, cycles = r["floors"]["broker_round_trip"]["p50_ms"], [s["cycle"] for s in uc.values()]
    with figure(
        path,
        (8, 0.32 * len(uc) + 1.5),
        grid="x",
        lines=[("v", rtt, "grey", ":", None)],
        legend=_peer_legend(),
        xlabel="uncontended acquire + release, ms (log scale)",
    ) as ax:
        ax.set_title("Uncontended acquire + release", fontsize=10)
        _peer_barh(ax, list(uc), [s["p50_ms"] for s in cycles], [s["p99_ms"] for s in cycles])
        ax.text(rtt, len(uc) - 0.5, f" broker RTT {rtt:.2f} ms", fontsize=7)


def compare_handoff(r: dict[str, Any], path: Path) -> None:
    p = r["peers"]
    palette = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i % 2 == 0]
    palette += [c for i, c in enumerate(plt.get_cmap("tab20b").colors) if i % 4 == 0]
    legend = {"fontsize": 7, "ncol": 1, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}
    with figure(
        path,
        (10.5, 4.8),
        log="y",
        grid="both",
        legend=legend,
        xlabel="waiters blocked when the holder releases",
        ylabel="release -> next process holds, p50 ms (log)",
    ) as ax:
        title = "Handoff vs waiters (thick solid: amqp-locks; dashed: polling peers)"
        ax.set_title(title, fontsize=10)
        for i, (k, cells) in enumerate(p.get("handoff", {}).items()):
            pts = sorted((int(n), s["p50_ms"]) for n, s in cells.items() if report.ok(s))
            if pts:
                kind, color = KINDS[k], palette[i % len(palette)]
                style, width = ("o-", 2.5) if kind.ours else ("s--" if kind.polls else "^:", 1.2)
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=color, linewidth=width, label=report.plain(k))
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%d"))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.set_xticks([int(n) for n in p["plan"]["waiters"]])


def compare_throughput(r: dict[str, Any], path: Path) -> None:
    tp = r["peers"].get("throughput", {})
    with figure(
        path,
        (10, 5.0),
        max(1, len(tp)),
        grid="x",
        legend=_peer_legend(p99=False),
        xlabel="grants per second (log); J = Jain fairness",
    ) as axes:
        for ax, (slots, cells) in zip(axes if len(tp) > 1 else [axes], tp.items(), strict=False):
            kinds = [k for k, c in cells.items() if "error" not in c]
            _peer_barh(ax, kinds, [cells[k]["grants_per_s"] for k in kinds], None)
            for y, k in enumerate(reversed(kinds)):
                jain = cells[k]["fairness"]["jain"]
                ax.text(cells[k]["grants_per_s"], y, f" J={jain:.2f}", fontsize=6, va="center")
            processes = r["peers"]["plan"]["processes"]
            ax.set_title(f"{processes} processes, {slots} slot(s)", fontsize=10)


def compare_crash(r: dict[str, Any], path: Path) -> None:
    rows = r["peers"].get("crash", {}).get("rows", {})
    xlabel = "holder kill -9 -> waiter holds, ms (log); bar p50, dots samples"
    labels = [report.plain(k) for k in rows]
    with figure(path, (8.5, 0.42 * len(labels) + 1.6), grid="x", xlabel=xlabel) as ax:
        ys = bar_axis(ax, labels, 8, "%g")
        ax.set_title("Crash failover: default (red) and tuned (green) settings", fontsize=10)
        _group_bars(ax, ys, list(rows.values()), 1, samples=False)


def scale_live_locks(r: dict[str, Any], path: Path) -> None:
    rows = r.get("scale", {}).get("rows", [])
    xs, broker = [row["locks"] for row in rows], [row.get("broker", {}) for row in rows]
    xlabel = "distinct live locks held"
    with figure(path, (10, 3.8), 2, log="x", grid="both", xlabel=xlabel) as (a1, a2):
        a1.plot(xs, [row["acquire"]["p50_ms"] for row in rows], "o-", label="p50")
        a1.plot(xs, [row["acquire"]["p99_ms"] for row in rows], "o--", alpha=0.5, label="p99")
        a1.set_ylabel("mutex acquire, ms")
        a1.set_ylim(bottom=0)
        a1.set_title("Acquire latency vs live locks", fontsize=10)
        memory = [b.get("memory", {}).get("total", math.nan) / 2**20 for b in broker]
        a2.plot(xs, memory, "o-", label="Erlang memory")
        a2.plot(xs, [(b.get("beam_rss") or math.nan) / 2**20 for b in broker], "s--", label="RSS")
        a2.set_ylabel("broker MiB")
        a2.set_title("Broker memory vs live locks", fontsize=10)
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)


def render(r: dict[str, Any], also: list[dict[str, Any]], img_dir: Path) -> None:
    """Every plot of the report into ``img_dir`` (the peers' and the scale run's only when
    they were measured)."""
    img_dir.mkdir(parents=True, exist_ok=True)
    plots = [uncontended, latency_vs_slots, handoff_cdf, grants_per_process, handoff_compare]
    plots += [failover, scale_live_locks] if "scale" in r else [failover]
    peers = [compare_uncontended, compare_handoff, compare_throughput, compare_crash]
    plots += peers if "peers" in r else []
    for plot in plots:
        plot(r, img_dir / report.PLOTS[plot.__name__])
    floors_targets(r, also, img_dir / report.PLOTS["floors_targets"])
