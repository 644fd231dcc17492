"""Every plot of docs/benchmarks.md (matplotlib, Agg), through one helper, ``figure``.

Each plot reads the results JSON (and the report modules' row data) and writes one PNG.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
from matplotlib.patches import Patch

from . import report
from .peers.kinds import KINDS

FILES = report.PLOTS
#: Plots that need the comparison with the peers (``results["peers"]``).
PEER_PLOTS = ("cmp_uncontended", "cmp_handoff", "cmp_throughput", "cmp_crash")
BLUE, LIGHT, GREEN, RED, ORANGE, PURPLE = (
    "#2171b5",
    "#c6dbef",
    "#238b45",
    "#cb181d",
    "#fd8d3c",
    "#6a51a3",
)
OURS_COLOR, PEER_COLOR, POLL_COLOR = BLUE, "#9e9ac8", ORANGE
GROUP_COLORS = {"tuned": GREEN, "default": RED}
LOWER_RIGHT = {"fontsize": 7, "loc": "lower right"}


class Line(NamedTuple):
    """A reference line (a floor, the RTT, a target) across the plot."""

    value: float
    color: str
    style: str
    label: str | None = None


def floor_lines(
    floors: dict[str, Any], *marks: tuple[str, str, str], fmt: str = "{} p50 {:.2f} ms"
) -> list[Line]:
    """Dashed lines at the p50 of the floors ``(key, color, text)`` that were measured."""
    return [
        Line(floors[key]["p50_ms"], color, "--", fmt.format(text, floors[key]["p50_ms"]))
        for key, color, text in marks
        if key in floors
    ]


@contextmanager
def figure(
    path: Path,
    size: tuple[float, float],
    *,
    ncols: int = 1,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    log: str = "",
    grid: str | None = None,
    vlines: Sequence[Line] = (),
    hlines: Sequence[Line] = (),
    legend: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """A figure of ``ncols`` axes (one axes, or a list): labels, log scales (``log`` holds
    "x" and/or "y"), grid (``grid``: "both", "x" or "y" axis) on every axes; the reference
    lines and the legend on the first; then saved to ``path`` and closed."""
    fig, axes = plt.subplots(1, ncols, figsize=size)
    every = list(axes) if ncols > 1 else [axes]
    for ax in every:
        if title is not None:
            ax.set_title(title)
        if xlabel is not None:
            ax.set_xlabel(xlabel)
        if ylabel is not None:
            ax.set_ylabel(ylabel)
        if "x" in log:
            ax.set_xscale("log")
        if "y" in log:
            ax.set_yscale("log")
        if grid is not None:
            ax.grid(which="both", alpha=0.3, **({} if grid == "both" else {"axis": grid}))
    yield axes
    for line in vlines:
        every[0].axvline(line.value, color=line.color, linestyle=line.style, label=line.label)
    for line in hlines:
        every[0].axhline(line.value, color=line.color, linestyle=line.style, label=line.label)
    if legend is not None:
        every[0].legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextmanager
def bar_rows(
    path: Path,
    labels: list[str],
    size: tuple[float, float, float],
    *,
    fontsize: float | None = None,
    xfmt: str | None = None,
    minor_labels: bool = True,
    **kw: Any,
) -> Iterator[tuple[Any, list[int]]]:
    """``figure`` for horizontal bars, one row per label (the first on top), on a log x
    axis (tick labels formatted with ``xfmt``, minor ones unless not ``minor_labels``);
    ``size``: width, height per row, extra height.
    Yields the axes and the rows' y positions."""
    width, per_row, extra = size
    with figure(path, (width, per_row * len(labels) + extra), grid="x", **kw) as ax:
        ys = rows_of(labels)
        yield ax, ys
        ax.set_yticks(ys, labels, **({"fontsize": fontsize} if fontsize else {}))
        ax.set_xscale("log")
        if xfmt is not None:
            _log_ticks(ax.xaxis, xfmt, minor=not minor_labels)


def rows_of(items: Sequence[Any]) -> list[int]:
    """y positions of one horizontal bar per item, the first item at the top."""
    return list(range(len(items)))[::-1]


def _p50_p99_bars(ax: Any, ys: list[int], stats: list[dict[str, Any]]) -> None:
    ax.barh(ys, [s["p99_ms"] for s in stats], color=LIGHT, label="p99")
    ax.barh(ys, [s["p50_ms"] for s in stats], color=BLUE, label="p50")


def _log_ticks(axis: Any, fmt: str = "%g", minor: bool = False) -> None:
    axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter(fmt))
    if minor:
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


# ------------------------------------------------------------------------ this run


def floors(r: dict[str, Any], path: Path) -> None:
    fl, uc = r["floors"], r["uncontended"]
    items = [
        ("loopback TCP round trip", fl["loopback_tcp"]),
        ("broker round trip", fl["broker_round_trip"]),
        ("semaphore C=1: acquire", uc["semaphore_c1"]["acquire"]),
        ("semaphore C=1: release", uc["semaphore_c1"]["release"]),
        ("mutex: acquire", uc["mutex"]["acquire"]),
        ("mutex: release", uc["mutex"]["release"]),
    ]
    ut = r.get("uncontended_tokens", {})
    for kind, label in (("token", "token"), ("token_nofence", "token, fencing=False")):
        if kind in ut:
            items.append((f"{label}: acquire", ut[kind]["acquire"]))
    marks = floor_lines(
        fl,
        ("get_classic", GREEN, "floor: `basic.get`"),
        ("exclusive_declare", RED, "floor: exclusive declare"),
    )
    with bar_rows(
        path,
        [label for label, _ in items],
        (7.5, 0.35, 1.5),
        title="Floors and uncontended operations",
        xlabel="latency (ms, log scale)",
        vlines=marks,
        legend=LOWER_RIGHT,
    ) as (ax, ys):
        _p50_p99_bars(ax, ys, [s for _, s in items])


def search(r: dict[str, Any], path: Path) -> None:
    rows = r["search"]
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    c1 = [row for row in rows if row["capacity"] == rows[0]["capacity"]]
    marks = [Line(rtt, "grey", ":", f"broker round trip p50 ({rtt:.2f} ms)")]
    marks += floor_lines(
        r["floors"],
        ("exclusive_declare", RED, "floor: exclusive declare"),
        fmt="{} p50 ({:.2f} ms)",
    )
    if c1:
        marks.append(Line(3 * c1[0]["p50_ms"], ORANGE, "-.", "target: 3 x C=1 p50"))
    with figure(
        path,
        (7.0, 4.2),
        title="Acquire latency vs number of slots",
        xlabel="slots C (C-1 held by another connection)",
        ylabel="acquire latency (ms, log)",
        log="xy",
        grid="both",
        hlines=marks,
        legend={"fontsize": 8},
    ) as ax:
        for position, color in (("last", RED), ("first", BLUE)):
            sel = c1 + [x for x in rows if x["free_slot"] == position and x not in c1]
            sel.sort(key=lambda x: x["capacity"])
            cs = [x["capacity"] for x in sel]
            for key, style, alpha in (("p50", "o-", 1.0), ("p99", "o--", 0.5)):
                ys = [x[f"{key}_ms"] for x in sel]
                label = f"free slot {position}: {key}"
                ax.plot(cs, ys, style, color=color, alpha=alpha, label=label)


def handoff(r: dict[str, Any], path: Path) -> None:
    c, plan = r["contention"], r["contention"]["plan"]
    xs = sorted(x for x in c["handoff_samples_ms"] if x > 0)
    with figure(
        path,
        (7.0, 3.8),
        title=f"Handoff CDF: {plan['processes']} processes, {plan['slots']} slots, "
        f"{c['runs']} x {plan['seconds']:.0f} s",
        xlabel="release -> next grant of the same slot (ms, log)",
        ylabel="fraction of handoffs",
        grid="both",
    ) as ax:
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=GREEN)
            for q, key in ((0.5, "p50_ms"), (0.99, "p99_ms")):
                v = c["handoff"][key]
                ax.axvline(v, color="grey", linestyle=":")
                ax.text(v, q, f" p{int(q * 100)} {v:.1f} ms", fontsize=8, va="bottom")
            ax.set_xscale("log")


def fairness(r: dict[str, Any], path: Path) -> None:
    c = r["contention"]
    grants = c["grants_per_process_last_run"]
    mean = sum(grants) / len(grants) if grants else 0.0
    marks = [Line(mean, "grey", ":", f"mean {mean:.0f}")] if grants else []
    with figure(
        path,
        (7.0, 3.2),
        title=f"Grants per process (last run of {c['runs']})",
        xlabel="process",
        ylabel="grants",
        hlines=marks,
        legend={} if grants else None,
    ) as ax:
        ax.bar(range(1, len(grants) + 1), grants, color=PURPLE)
        ax.set_xticks(range(1, len(grants) + 1))


def handoff_compare(r: dict[str, Any], path: Path) -> None:
    fl = r["floors"]
    rtt = fl["broker_round_trip"]["p50_ms"]
    marks = [Line(rtt, "grey", ":", f"RTT p50 {rtt:.2f} ms")]
    marks += floor_lines(
        fl,
        ("reject_deliver_classic", GREEN, "floor: reject -> deliver"),
        ("exclusive_declare", RED, "floor: exclusive declare"),
    )
    legend = {"fontsize": 7, "loc": "upper center", "bbox_to_anchor": (0.5, -0.2), "ncol": 2}
    with figure(
        path, (10.0, 4.0), ncols=2, xlabel="ms (log scale)", grid="x", vlines=marks, legend=legend
    ) as (a1, a2):
        for ax, data, title in (
            (a1, r.get("handoff", {}), "release -> blocked waiter holds"),
            (a2, r.get("crash", {}), "holder kill -9 -> blocked waiter holds"),
        ):
            kinds = [k for k in report.HANDOFF_KINDS if k in data]
            ys = rows_of(kinds)
            _p50_p99_bars(ax, ys, [data[k] for k in kinds])
            labels = [report.KIND_LABELS[k].replace(", ", "\n") for k in kinds]
            ax.set_yticks(ys, labels, fontsize=8)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            _log_ticks(ax.xaxis, minor=True)
            ax.set_title(title, fontsize=10)
        a2.legend(**legend)


def _group_bars(
    ax: Any, ys: list[int], per: list[dict[str, Any]], scale: float, samples: bool
) -> None:
    """Bars at p50 of the tuned (above) and default (below) group per row, with samples."""
    for off, group in ((0.18, "tuned"), (-0.18, "default")):
        color, xs, yy = GROUP_COLORS[group], [], []
        for y, groups in zip(ys, per, strict=True):
            s = groups.get(group)
            if not s or "error" in s:
                continue
            if s.get("censored"):
                ax.barh(y + off, s["cap_s"] * 1000, height=0.34, color=color, alpha=0.15)
                ax.text(s["cap_s"] * 1000, y + off, " never", fontsize=7, va="center")
                continue
            if s.get("n") == 0:
                continue
            ax.barh(
                y + off,
                s["p50_ms"] / scale,
                height=0.34,
                color=color,
                alpha=0.6 if samples else 0.7,
            )
            if samples:
                xs += [x / scale for x in s["samples_ms"]]
                yy += [y + off] * len(s["samples_ms"])
            else:
                ax.scatter(s["samples_ms"], [y + off] * len(s["samples_ms"]), s=8, color=color)
        if xs:
            ax.scatter(xs, yy, s=10, color=color, label=f"{group} settings: samples; bar: p50")


def failover(r: dict[str, Any], path: Path) -> None:
    labels, per = report.failover_rows(r)
    with bar_rows(
        path,
        labels,
        (8.5, 0.45, 1.6),
        fontsize=8,
        xfmt="%g",
        title="Locker failover",
        xlabel="master kill -9 -> standby is master (s, log scale)",
        legend=LOWER_RIGHT,
    ) as (ax, ys):
        _group_bars(ax, ys, [per[label] for label in labels], 1000, samples=True)


def floors_targets(r: dict[str, Any], also: list[dict[str, Any]], path: Path) -> None:
    """ours / floor per target row (log scale) with the target marked, per RabbitMQ line."""
    runs = [r, *also]
    first = {x["label"]: x for x in report.target_rows(r)}
    labels = [label for label, x in first.items() if not x.get("higher_is_better")]
    with bar_rows(
        path,
        [textwrap.fill(x.replace("`", ""), 34) for x in labels],
        (9.0, 0.42, 1.8),
        fontsize=7,
        xfmt="%gx",
        minor_labels=False,
        title="Ours against the broker's floor, same run",
        xlabel="ours / floor, p50 (log scale; left of the red mark = target met)",
        legend=LOWER_RIGHT,
    ) as (ax, ys):
        height = 0.8 / max(1, len(runs))
        for i, run in enumerate(runs):
            by = {x["label"]: x for x in report.target_rows(run)}
            xs, yy = [], []
            for y, label in zip(ys, labels, strict=True):
                row = by.get(label)
                if row is None or row["ratio"] is None:
                    continue
                xs.append(row["ratio"])
                yy.append(y + 0.4 - height * (i + 0.5))
            color = (BLUE, GREEN, PURPLE)[i % 3]
            ax.barh(yy, xs, height=height, color=color, label=f"RabbitMQ {report.version(run)}")
        for y, label in zip(ys, labels, strict=True):
            target = first[label]["target"]
            if target.startswith("<="):
                t = float(target[2:].strip().rstrip("x"))
                ax.plot([t, t], [y - 0.45, y + 0.45], color=RED, linewidth=2)
        ax.axvline(1.0, color="grey", linestyle=":", label="the floor (1x)")
        ax.plot([], [], color=RED, linewidth=2, label="target")


# ------------------------------------------------------------------------ the peers


def _peer_barh(ax: Any, kinds: list[str], p50: list[float], p99: list[float] | None) -> None:
    ys = rows_of(kinds)
    colors = [_color(k) for k in kinds]
    if p99 is not None:
        ax.barh(ys, p99, color=colors, alpha=0.3)
    ax.barh(ys, p50, color=colors)
    ax.set_yticks(ys, [report.plain(k) for k in kinds], fontsize=8)
    ax.set_xscale("log")
    _log_ticks(ax.xaxis)
    ax.grid(axis="x", which="both", alpha=0.3)


def _color(kind: str) -> str:
    k = KINDS[kind]
    return OURS_COLOR if k.ours else POLL_COLOR if k.polls else PEER_COLOR


def _peer_legend(p99: bool = True) -> dict[str, Any]:
    handles = [
        Patch(color=OURS_COLOR, label="amqp-locks"),
        Patch(color=PEER_COLOR, label="peer, pushed wake-ups"),
        Patch(color=POLL_COLOR, label="peer, polls"),
    ]
    if p99:
        handles.append(Patch(color="grey", alpha=0.3, label="p99 (light)"))
    return {"handles": handles, **LOWER_RIGHT}


def cmp_uncontended(r: dict[str, Any], path: Path) -> None:
    uc = {k: s for k, s in r["peers"].get("uncontended", {}).items() if report.ok(s)}
    kinds = list(uc)
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    with figure(
        path,
        (8, 0.32 * len(kinds) + 1.5),
        xlabel="uncontended acquire + release, ms (log scale)",
        vlines=[Line(rtt, "grey", ":")],
        legend=_peer_legend(),
    ) as ax:
        ax.set_title("Uncontended acquire + release", fontsize=10)
        cycles = [uc[k]["cycle"] for k in kinds]
        _peer_barh(ax, kinds, [s["p50_ms"] for s in cycles], [s["p99_ms"] for s in cycles])
        ax.text(rtt, len(kinds) - 0.5, f" broker RTT {rtt:.2f} ms", fontsize=7)


def cmp_handoff(r: dict[str, Any], path: Path) -> None:
    p = r["peers"]
    palette = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i % 2 == 0]
    palette += [c for i, c in enumerate(plt.get_cmap("tab20b").colors) if i % 4 == 0]
    with figure(
        path,
        (10.5, 4.8),
        xlabel="waiters blocked when the holder releases",
        ylabel="release -> next process holds, p50 ms (log)",
        grid="both",
        legend={"fontsize": 7, "ncol": 1, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0)},
    ) as ax:
        ax.set_title(
            "Handoff vs waiters (thick solid: amqp-locks; dashed: polling peers)", fontsize=10
        )
        for i, (k, cells) in enumerate(p.get("handoff", {}).items()):
            pts = sorted((int(n), s["p50_ms"]) for n, s in cells.items() if report.ok(s))
            if not pts:
                continue
            ours = KINDS[k].ours
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                "o-" if ours else ("s--" if KINDS[k].polls else "^:"),
                color=palette[i % len(palette)],
                linewidth=2.5 if ours else 1.2,
                label=report.plain(k),
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _log_ticks(ax.xaxis, "%d")
        _log_ticks(ax.yaxis)
        ax.set_xticks([int(n) for n in p["plan"]["waiters"]])


def cmp_throughput(r: dict[str, Any], path: Path) -> None:
    tp = r["peers"].get("throughput", {})
    with figure(
        path,
        (10, 5.0),
        ncols=max(1, len(tp)),
        xlabel="grants per second (log); J = Jain fairness",
        legend=_peer_legend(p99=False),
    ) as axes:
        for ax, (slots, cells) in zip(axes if len(tp) > 1 else [axes], tp.items(), strict=False):
            kinds = [k for k, c in cells.items() if "error" not in c]
            _peer_barh(ax, kinds, [cells[k]["grants_per_s"] for k in kinds], None)
            for y, k in zip(rows_of(kinds), kinds, strict=True):
                jain = cells[k]["fairness"]["jain"]
                ax.text(cells[k]["grants_per_s"], y, f" J={jain:.2f}", fontsize=6, va="center")
            processes = r["peers"]["plan"]["processes"]
            ax.set_title(f"{processes} processes, {slots} slot(s)", fontsize=10)


def cmp_crash(r: dict[str, Any], path: Path) -> None:
    rows = r["peers"].get("crash", {}).get("rows", {})
    kinds = list(rows)
    with bar_rows(
        path,
        [report.plain(k) for k in kinds],
        (8.5, 0.42, 1.6),
        fontsize=8,
        xfmt="%g",
        xlabel="holder kill -9 -> waiter holds, ms (log); bar p50, dots samples",
    ) as (ax, ys):
        ax.set_title("Crash failover: default (red) and tuned (green) settings", fontsize=10)
        _group_bars(ax, ys, [rows[k] for k in kinds], 1, samples=False)


def scale(r: dict[str, Any], path: Path) -> None:
    rows = r.get("scale", {}).get("rows", [])
    xs = [row["locks"] for row in rows]
    with figure(path, (10, 3.8), ncols=2, xlabel="distinct live locks held", grid="both") as (
        a1,
        a2,
    ):
        a1.plot(xs, [row["acquire"]["p50_ms"] for row in rows], "o-", label="p50")
        a1.plot(xs, [row["acquire"]["p99_ms"] for row in rows], "o--", alpha=0.5, label="p99")
        a1.set_ylabel("mutex acquire, ms")
        a1.set_ylim(bottom=0)
        a1.set_title("Acquire latency vs live locks", fontsize=10)
        broker = [row.get("broker", {}) for row in rows]
        a2.plot(
            xs,
            [b.get("memory", {}).get("total", math.nan) / 2**20 for b in broker],
            "o-",
            label="Erlang memory",
        )
        a2.plot(xs, [(b.get("beam_rss") or math.nan) / 2**20 for b in broker], "s--", label="RSS")
        a2.set_ylabel("broker MiB")
        a2.set_title("Broker memory vs live locks", fontsize=10)
        for ax in (a1, a2):
            ax.set_xscale("log")
            ax.legend(fontsize=8)


PLOTS = {
    "floors": floors,
    "search": search,
    "handoff": handoff,
    "fairness": fairness,
    "handoff_compare": handoff_compare,
    "failover": failover,
    "cmp_uncontended": cmp_uncontended,
    "cmp_handoff": cmp_handoff,
    "cmp_throughput": cmp_throughput,
    "cmp_crash": cmp_crash,
    "scale": scale,
}


def render(r: dict[str, Any], also: list[dict[str, Any]], img_dir: Path) -> None:
    """Every plot of the report into ``img_dir`` (the peers' and the scale run's only when
    they were measured)."""
    img_dir.mkdir(parents=True, exist_ok=True)
    skip = {*(PEER_PLOTS if "peers" not in r else ()), *(("scale",) if "scale" not in r else ())}
    for key, plot in PLOTS.items():
        if key not in skip:
            plot(r, img_dir / FILES[key])
    floors_targets(r, also, img_dir / FILES["floors_targets"])
