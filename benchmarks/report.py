"""docs/benchmarks.md's data, from the results JSON alone: tables, verdicts and figures for
the template ``templates/benchmarks.md.j2`` (every sentence); ``plots.py`` draws the plots.

Targets (issue 12) are ours / the raw aiormq floor of the same run; comparison ratios are
ours / best peer (times: above 1 we are slower; throughput: below 1 we do less).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
from tabulate import tabulate

from .floors import RAW
from .peers.kinds import KINDS

#: The plots by the template's key, each drawn into bench-KEY.png by ``plots.KEY``.
_PLOTS = """uncontended latency_vs_slots handoff_cdf grants_per_process handoff_compare
failover scale_live_locks floors_targets
compare_uncontended compare_handoff compare_throughput compare_crash"""
PLOTS = {key: f"bench-{key.replace('_', '-')}.png" for key in _PLOTS.split()}
#: The one-permit locks of handoff.py, in report order.
KIND_LABELS = {
    "token": "token semaphore, classic token queue",
    "token_nofence": "token semaphore, classic token queue, fencing=False",
    "token_quorum": "token semaphore, quorum token queue",
    "mutex": "mutex",
    "semaphore": "persistent semaphore, C=1",
}
HANDOFF_KINDS = tuple(KIND_LABELS)
#: The same locks as the targets and the fairness loop name them.
LABELS = {
    **KIND_LABELS,
    "token": "token semaphore (fencing on)",
    "token_nofence": "token semaphore, `fencing=False`",
}
TOKEN_HANDOFF_GOAL_RTT = 3.0  # issue 3: a token handoff within this many broker round trips
#: Grants/s of 16 processes on 4 slots before issue 12 (latest.json of 2026-11-22, RabbitMQ
#: 3.10.8, git aa24dac), the base of the 5x target.
THROUGHPUT_BASELINE = {
    "ours_token": ("token semaphore", 195.0),
    "ours_semaphore": ("persistent semaphore", 48.2),
}
THROUGHPUT_TARGET_X = 5.0
JAIN_TARGET, WAIT_RATIO_TARGET = 0.98, 3.0  # fairness: Jain >= this, max wait <= this x median
VERDICT = {True: "**met**", False: "**not met**", None: "-"}


def num(x: float | None, digits: int = 2, grouped: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.{digits}f}" if grouped else f"{x:.{digits}f}"


def ms(x: float | None) -> str:
    """Milliseconds with sensible digits (0.042, 4.20, 42.0, 4,200)."""
    digits = 3 if x is None or x < 1 else 2 if x < 10 else 1 if x < 100 else 0
    return num(x, digits, True)


def pct(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.{digits}%}"


def times(a: float, b: float | None, digits: int = 1) -> str:
    return "n/a" if not b or math.isnan(b) or math.isnan(a) else f"{a / b:.{digits}f}x"


class Table(NamedTuple):
    """Formatted cells, rendered by the template's ``table`` filter (tabulate's pipe format:
    first column left, the rest right, or one alignment per column)."""

    header: list[str]
    rows: list[list[str]]
    align: list[str] | None = None

    def markdown(self) -> str:
        cols = self.align or ["left"] + ["right"] * (len(self.header) - 1)
        return str(tabulate(self.rows, self.header, "pipe", colalign=cols, disable_numparse=True))


def rows(body: str, header: str, align: str = "right") -> str:
    """The template's table: ``body`` one row a line, cells split at "|" like ``header``'s;
    ``align`` for every column but the first (left), or "|"-split, one per column."""
    head, cols = header.split("|"), align.split("|")
    cols = cols if len(cols) > 1 else ["left"] + cols * (len(head) - 1)
    cells = [line.split("|") for line in body.splitlines() if line]
    return Table(head, cells, cols).markdown() + "\n"


def _get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, or None where a key is missing."""
    return functools.reduce(lambda x, k: x.get(k) if isinstance(x, dict) else None, keys, d)


def _p50(d: Any, *path: str) -> float | None:
    """The p50 at ``path`` (None: not measured, failed or no samples)."""
    cell = _get(d, *path)
    if not isinstance(cell, dict) or "error" in cell or not cell.get("n", 1):
        return None
    v = cell.get("p50_ms")
    return v if isinstance(v, (int, float)) else None


# ------------------------------------------------------------------------ this run


def _us_each(cpu_ms: float, n: int) -> float | None:
    """CPU microseconds per probe, when enough probes (100) were sent to tell."""
    return round(1000 * cpu_ms / n, 1) if n >= 100 else None


def search_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep's rows with the figures derived from them: ratios to C=1 (one slot, first
    and last alike) and to the RTT; client + broker CPU per probe beyond those of the
    free-slot-first cell of the same C (same holders), and holders' CPU per held-slot probe."""
    rows, rtt = r["search"], r["floors"]["broker_round_trip"]["p50_ms"]
    out = []
    for s in rows:
        cpu, ref = s["cpu_per_acquire_ms"], rows[0]
        same_c = [x for x in rows if x["capacity"] == s["capacity"] and x["free_slot"] == "first"]
        base = (same_c or [ref])[0]
        base_cpu = base["cpu_per_acquire_ms"]["client"] + base["cpu_per_acquire_ms"]["broker"]
        extra = s["probes_sent"] - base["probes_sent"]
        out.append(
            {
                **s,
                "p50_x_c1": round(s["p50_ms"] / ref["p50_ms"], 1),
                "p99_x_c1": round(s["p99_ms"] / ref["p99_ms"], 1),
                "p50_x_rtt": round(s["p50_ms"] / rtt, 1),
                "marginal_cpu_per_probe_us": _us_each(
                    cpu["client"] + cpu["broker"] - base_cpu, extra
                ),
                "holder_cpu_per_held_probe_us": _us_each(cpu["holders"], s["held_probes"]),
            }
        )
    return out


def search_cases(r: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worst case of the sweep (largest C, free slot last) and the best at that C."""
    worst = max(r["search"], key=lambda s: s["capacity"] * (s["free_slot"] == "last"))
    same_c = [s for s in r["search"] if s["capacity"] == worst["capacity"]]
    return worst, next((s for s in same_c if s["free_slot"] == "first"), worst)


def token_goal(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 3's goal per token kind measured: handoff p50 within 3 x RTT."""
    rtt, ho = r["floors"]["broker_round_trip"]["p50_ms"], r.get("handoff", {})
    return [
        {
            "label": KIND_LABELS[k],
            "p50": s["p50_ms"],
            "p99": s["p99_ms"],
            "x50": s["p50_ms"] / rtt,
            "x99": s["p99_ms"] / rtt,
            "met": s["p50_ms"] / rtt <= TOKEN_HANDOFF_GOAL_RTT,
        }
        for k in ("token", "token_nofence", "token_quorum")
        if k in ho
        for s in [ho[k]]
    ]


def failover(r: dict[str, Any]) -> dict[str, Any]:
    """The locker failover's results with its locker labels in order, per label {group:
    stats}, the settings groups and every sample's error."""
    fo, per = r.get("failover", {}), {}
    for group, g in fo.get("groups", {}).items():
        for row in g["rows"]:
            per.setdefault(row["locker"], {})[group] = row
    errors = [
        f"{x} ({g}): {e}" for x in per for g, s in per[x].items() for e in s.get("errors", [])
    ]
    return {
        **fo,
        "labels": list(per),
        "per": per,
        "groups": list(fo.get("groups", {})),
        "errors": errors,
    }


# ------------------------------------------------------- floors and targets (issue 12)

FLOORS = {
    "get_classic": "`basic.get`",
    "reject_deliver_classic": "reject -> deliver",
    "get_quorum": "`basic.get` (quorum)",
    "reject_deliver_quorum": "reject -> deliver (quorum)",
    "exclusive_declare": "exclusive declare",
}
#: (label, floor key, where ours is in the results, target ratio (None: information),
#: sequence floor key: raw aiormq doing the same broker steps as ours, shown beside)
_TARGETS: list[tuple[str, str, tuple[str, ...], float | None, str | None]] = [
    (
        "token semaphore (fencing on): uncontended acquire",
        "get_classic",
        ("uncontended_tokens", "token", "acquire"),
        2.0,
        "token_cycle",
    ),
    (
        "token semaphore (fencing on): handoff release -> blocked waiter holds",
        "reject_deliver_classic",
        ("handoff", "token"),
        2.0,
        "token_handoff_tx",
    ),
    (
        "token semaphore, `fencing=False`: uncontended acquire",
        "get_classic",
        ("uncontended_tokens", "token_nofence", "acquire"),
        1.5,
        "token_cycle",
    ),
    (
        "token semaphore, `fencing=False`: handoff",
        "reject_deliver_classic",
        ("handoff", "token_nofence"),
        1.5,
        "token_handoff_plain",
    ),
    (
        "token semaphore, quorum token queue: uncontended acquire",
        "get_quorum",
        ("uncontended_tokens", "token_quorum", "acquire"),
        None,
        None,
    ),
    (
        "token semaphore, quorum token queue: handoff",
        "reject_deliver_quorum",
        ("handoff", "token_quorum"),
        None,
        None,
    ),
    (
        "mutex: uncontended acquire",
        "exclusive_declare",
        ("uncontended", "mutex", "acquire"),
        2.0,
        "mutex_acquire",
    ),
    (
        "mutex: handoff, releaser asking again at once",
        "exclusive_declare",
        ("reask", "mutex"),
        3.0,
        "mutex_handoff",
    ),
    (
        "persistent semaphore, C=1: uncontended acquire",
        "exclusive_declare",
        ("uncontended", "semaphore_c1", "acquire"),
        2.0,
        "semaphore_acquire",
    ),
    (
        "persistent semaphore, C=1: handoff, releaser asking again at once",
        "exclusive_declare",
        ("reask", "semaphore"),
        3.0,
        None,
    ),
]


def _row(
    label: str,
    floor_label: str,
    floor: float | None,
    ours: float | None,
    target: float | None,
    note: str = "",
    sequence: float | None = None,
    judged: bool = True,
    higher_is_better: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """One line of the table: ours / floor against a target ratio (None: information), at
    most it or (``higher_is_better``) at least it; not ``judged``: shown only."""
    ratio = ours / floor if ours is not None and floor else None
    seq_ratio = ours / sequence if ours is not None and sequence else None
    met, sign = None, ">=" if higher_is_better else "<="
    if target is not None and ratio is not None and judged:
        met = ratio >= target if higher_is_better else ratio <= target
    return {
        "label": label,
        "floor_label": floor_label,
        "floor_ms": floor,
        "ours_ms": ours,
        "ratio": None if ratio is None else round(ratio, 2),
        "target": "(information)" if target is None else f"{sign} {target:g}x",
        "met": met,
        "note": note,
        "higher_is_better": higher_is_better,
        "sequence_ms": sequence,
        "sequence_ratio": None if seq_ratio is None else round(seq_ratio, 2),
        **extra,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets judged from one results file: floor and ours p50 (ms), ratio,
    target, ``met`` (None when not measured or information only)."""
    fl, rows = r.get("floors", {}), []
    for label, key, path, target, seq in _TARGETS:
        s = _get(r, *path)
        note = ""
        if path[0] == "reask" and s and s.get("handoffs"):
            note = f"the releaser won it back {s['releaser_won']} times in {s['handoffs']}"
        # A floor whose p50 moved between its repetitions: how far a ratio to it holds.
        reps = _get(fl, key, "p50_reps_ms")
        spread = [min(reps), max(reps)] if isinstance(reps, list) and len(reps) > 1 else None
        floor, ours, sequence = _p50(fl, key), _get(s, "p50_ms"), _p50(fl, seq or "")
        rows.append(
            _row(label, FLOORS[key], floor, ours, target, note, sequence, floor_reps_ms=spread)
        )
    search = r.get("search") or []
    c1 = next((x for x in search if x["capacity"] == 1), None)
    last = [x for x in search if x.get("free_slot") == "last" and x["capacity"] > 1]
    if last:
        worst = max(last, key=lambda x: x["capacity"])
        full = worst["capacity"] >= 1000
        note = "" if full else "smaller C than the target's 1000, not judged"
        label = f"persistent semaphore, C={worst['capacity']}, only the last slot free: acquire"
        floor, ours = _get(c1, "p50_ms"), worst["p50_ms"]
        rows.append(_row(label, "its C=1 acquire", floor, ours, 3.0, note, judged=full))
    return rows


def head_to_head(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The head-to-head targets, from the comparison with the peers in the same run."""
    peers, rows = r.get("peers", {}), []
    waiters = sorted(_get(peers, "handoff", "ours_token") or {}, key=int)
    if waiters:
        n = waiters[0]
        pg, ours = _p50(peers, "handoff", "pg_advisory", n), _p50(peers, "handoff", "ours_token", n)
        floor = "PostgreSQL `pg_advisory_lock`"
        rows.append(_row(f"token handoff, {n} waiters", floor, pg, ours, 1.0))
    redis, ours = (_p50(peers, "uncontended", k, "cycle") for k in ("redis_py", "ours_token"))
    rows.append(_row("token uncontended acquire + release", "redis-py `Lock`", redis, ours, 2.0))
    procs = _get(peers, "plan", "processes")
    note = "" if procs == 16 else "smoke run: not 16 processes, not judged"
    for kind, (name, base) in THROUGHPUT_BASELINE.items():
        cell = _get(peers, "throughput", "4", kind) or {}
        rate = None if "error" in cell else cell.get("grants_per_s")
        label = f"{procs} processes on 4 slots, {name}: grants/s"
        rows.append(
            _row(
                label,
                "grants/s before issue 12",
                base,
                rate,
                THROUGHPUT_TARGET_X,
                note,
                judged=procs == 16,
                higher_is_better=True,
            )
        )
    return rows


def target_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The target rows of a results file (recomputed: older files judge by today's rules)."""
    return targets(r) + head_to_head(r)


def fairness_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per primitive: Jain's index and max wait / median wait against the targets."""
    rows = []
    for kind, s in r.get("fairness", {}).items():
        jain, ratio = s.get("jain"), s.get("wait_max_over_median")
        ok = (
            None
            if jain is None or ratio is None or math.isnan(jain)
            else (jain >= JAIN_TARGET and ratio <= WAIT_RATIO_TARGET and not s.get("errors"))
        )
        rows.append({"kind": kind, "label": LABELS.get(kind, kind), **s, "met": ok})
    return rows


def version(r: dict[str, Any]) -> str:
    return str(_get(r, "environment", "rabbitmq", "version") or "?")


def targets_table(r: dict[str, Any]) -> Table:
    rows = []
    for row in target_rows(r):
        grants = row["higher_is_better"]
        value = (lambda v: "n/a" if v is None else f"{v:.0f} grants/s") if grants else num
        seq, sr, reps = row.get("sequence_ms"), row.get("sequence_ratio"), row.get("floor_reps_ms")
        # The floor's lowest and highest p50 over its repetitions, when a quarter apart.
        moved = reps and reps[0] > 0 and reps[1] / reps[0] > 1.25
        rows.append(
            [
                row["label"],
                row["floor_label"],
                value(row["floor_ms"])
                + (f" (reps {num(reps[0])}-{num(reps[1])})" if moved else ""),
                value(row["ours_ms"]),
                "n/a" if row["ratio"] is None else f"{row['ratio']:.1f}x",
                row["target"],
                VERDICT[row["met"]] + (f" ({row['note']})" if row["note"] else ""),
                "" if seq is None else f"{num(seq)} ({'n/a' if sr is None else f'{sr:.1f}x'})",
            ]
        )
    header = ["operation (p50)", "floor", "floor ms", "ours ms", "ours / floor", "target"]
    return Table([*header, "met?", "same steps, raw: ms (ours / it)"], rows)


def _over(row: dict[str, Any]) -> str:
    """How many waits exceeded the bound, and when the longest began (newer runs only)."""
    over, n, at = row.get("waits_over_bound"), _get(row, "waits", "n"), row.get("wait_max_at_s")
    if over is None or not n or at is None:
        return ""
    return f" ({over} of {n} waits over; the longest at {at:.1f} s)"


def fairness_table(r: dict[str, Any]) -> Table | None:
    rows = [
        [
            row["label"],
            " / ".join(str(g) for g in row["grants"]),
            num(row.get("jain"), 3),
            num(row.get("wait_p50_ms"), 1),
            num(row.get("wait_max_ms"), 1),
            num(row.get("wait_max_over_median"), 2) + _over(row),
            str(len(row.get("errors", []))),
            VERDICT[row["met"]],
        ]
        for row in fairness_rows(r)
    ]
    header = ["primitive", "grants per process", f"Jain (>= {JAIN_TARGET})", "wait p50 ms"]
    header += ["wait max ms", f"max / median (<= {WAIT_RATIO_TARGET:g})", "errors", "met?"]
    return Table(header, rows) if rows else None


def reask_table(r: dict[str, Any]) -> Table | None:
    rows = [
        [
            LABELS.get(kind, kind),
            num(s["p50_ms"]),
            num(s["p99_ms"]),
            num(_get(s, "to_waiter", "p50_ms")),
            num(_get(s, "to_releaser", "p50_ms")),
            f"{s['releaser_won']} of {s['handoffs']}",
        ]
        for kind, s in r.get("reask", {}).items()
    ]
    header = ["lock", "release -> next grant p50 ms", "p99 ms", "p50 when the waiter got it"]
    header += ["p50 when the releaser got it back", "releaser won it back"]
    return Table(header, rows) if rows else None


def busy_cores(env: dict[str, Any]) -> float | None:
    """Cores other work kept busy during the run, when enough to mention (>= 0.2)."""
    other = env.get("other_load_cores")
    return other if isinstance(other, (int, float)) and other >= 0.2 else None


def line(r: dict[str, Any]) -> dict[str, Any]:
    """One RabbitMQ line's part of the section: its source, verdict count and tables."""
    judged = [x["met"] for x in target_rows(r) + fairness_rows(r) if x["met"] is not None]
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


def floors_targets(r: dict[str, Any], also: list[dict[str, Any]]) -> dict[str, Any]:
    """This run's line, the other lines' (each judged against its own floors), the
    fairness plan and the re-ask table."""
    plan = {**r.get("headline_plan", {}), **r.get("handoff_plan", {})}  # older files: both
    return {
        "this": line(r),
        "others": [line(other) for other in also],
        "reask": reask_table(r),
        "fair_processes": plan.get("fair_processes", 4),
        "fair_hold_ms": plan.get("fair_hold", 0.005) * 1000,
    }


# ------------------------------------------------------------------------ the peers


def label(kind: str, bold: bool = True) -> str:
    k = KINDS.get(kind)
    return kind if k is None else (f"**{k.label}**" if k.ours and bold else k.label)


def plain(kind: str) -> str:
    return label(kind, bold=False)


def ok(s: dict[str, Any] | None) -> bool:
    return s is not None and "error" not in s and s.get("n", 1) > 0


def _uc(p: dict[str, Any]) -> dict[str, float]:
    """Uncontended acquire+release cycle p50 per kind."""
    return {k: s["cycle"]["p50_ms"] for k, s in p.get("uncontended", {}).items() if ok(s)}


def _ho(p: dict[str, Any], n: str) -> dict[str, float]:
    return {k: c[n]["p50_ms"] for k, c in p.get("handoff", {}).items() if n in c and ok(c[n])}


def _tp(p: dict[str, Any], slots: str) -> dict[str, float]:
    tp = p.get("throughput", {}).get(slots, {})
    return {k: s["grants_per_s"] for k, s in tp.items() if "error" not in s}


def _cr(p: dict[str, Any], group: str) -> dict[str, float]:
    """Crash p50 per kind; inf when the lock never came free (no expiry)."""
    out: dict[str, float] = {}
    for k, groups in p.get("crash", {}).get("rows", {}).items():
        s = groups.get(group) or (groups.get("default") if KINDS[k].tuned is None else None)
        if s and "error" not in s:
            out[k] = math.inf if s.get("censored") else s["p50_ms"]
    return out


def _best(values: dict[str, float], high: bool = False, ours: bool = False) -> Any:
    """The best (kind, value) of ours or of the peers; None if none measured."""
    vals = [(k, v) for k, v in values.items() if KINDS[k].ours == ours and not math.isnan(v)]
    return (max if high else min)(vals, key=lambda kv: kv[1]) if vals else None


def peers_headline_table(r: dict[str, Any]) -> Table:
    """One row per metric: our best primitive, the best peer, the ratio, win or loss."""
    p, plan = r["peers"], r["peers"]["plan"]
    metrics = [("uncontended acquire + release (p50 ms)", _uc(p), False)]
    metrics += [(f"handoff, {n} waiters (p50 ms)", _ho(p, str(n)), False) for n in plan["waiters"]]
    tp = f"throughput, {plan['processes']} processes / {{}} slot(s)"
    metrics += [(tp.format(s), _tp(p, s), True) for s in p.get("throughput", {})]
    crash = "crash: kill -9 -> waiter holds, {} settings (p50 ms)"
    metrics += [(crash.format(g), _cr(p, g), False) for g in ("default", "tuned") if _cr(p, g)]
    rows = []
    for metric, values, high in metrics:
        bo, bp = _best(values, high, ours=True), _best(values, high)
        if bo and bp:
            fmt = (lambda v: f"{v:,.0f}") if high else ms
            ratio = "n/a" if math.isinf(bp[1]) else times(bo[1], bp[1], 2 if high else 1)
            win = bo[1] >= bp[1] if high else bo[1] <= bp[1]
            cells = [f"{plain(kind)}: {fmt(v)}" for kind, v in (bo, bp)]
            rows.append([metric, *cells, ratio, "**win**" if win else "loss"])
    return Table(["metric", "ours (best primitive)", "best peer", "ours / best peer", ""], rows)


def peer_targets(r: dict[str, Any]) -> dict[str, Any]:
    """The comparison's three targets: handoff and crash >= 10x faster than every polling
    peer with defaults (verdict, factors: peer time / ours), token acquire, search."""
    p, rtt = r["peers"], r["floors"]["broker_round_trip"]["p50_ms"]
    pollers = [k for k in p.get("kinds", []) if KINDS[k].polls]
    checks = [(f"handoff, {n} waiters", _ho(p, str(n))) for n in p["plan"]["waiters"]]
    checks += [("crash, default settings", _cr(p, "default"))] if _cr(p, "default") else []
    rows: list[list[str]] = []
    factors: list[float] = []

    def shown(f: float | None) -> str:  # bold: 10x or more
        text = "n/a" if f is None else "never frees" if math.isinf(f) else f"{f:.1f}x"
        return f"**{text}**" if f is not None and f >= 10 else text

    for metric, vals in checks:
        for ours in (k for k in vals if KINDS[k].ours):
            fs = [
                (vals[k] / vals[ours] if vals[ours] else math.inf) if k in vals else None
                for k in pollers
            ]
            factors += [f for f in fs if f is not None]
            rows.append([metric, f"{plain(ours)} ({ms(vals[ours])} ms)", *map(shown, fs)])
    header = ["metric", "ours"] + [f"vs {plain(k)}" for k in pollers]
    p50 = _p50(p, "uncontended", "ours_token", "acquire")
    token = None if p50 is None else {"p50": p50, "x": p50 / rtt, "met": p50 / rtt <= 3}
    search = r.get("search", [])
    c1 = next((s for s in search if s["capacity"] == 1), None)
    big = [s for s in search if s["capacity"] == max((s["capacity"] for s in search), default=0)]
    at_big = None
    if c1 and big:
        parts = [(s["free_slot"], s["p50_ms"], s["p50_ms"] / c1["p50_ms"]) for s in big]
        at_big = {
            "capacity": big[0]["capacity"],
            "c1": c1["p50_ms"],
            "parts": parts,
            "met": all(x <= 3 for *_, x in parts),
        }
    return {
        "pollers": all(f >= 10 for f in factors) if rows else None,
        "pollers_table": Table(header, rows) if rows else None,
        "token": token,
        "search": at_big,
    }


def peers(r: dict[str, Any]) -> dict[str, Any] | None:
    """The comparison's tables, verdicts and plan for the template (None: not measured)."""
    if "peers" not in r:
        return None
    p = r["peers"]
    tp = p.get("throughput", {})
    bests = {
        "uc": _best(_uc(p)),
        "ho": {n: _best(_ho(p, n)) for n in map(str, p["plan"]["waiters"])},
        "tp": {s: _best(_tp(p, s), high=True) for s in tp},
    }
    return {
        "p": p,
        "headline": peers_headline_table(r),
        "bests": bests,
        "targets": peer_targets(r),
        "crash_wall": p.get("crash", {}).get("wall_s"),
        "tp_kinds": list(dict.fromkeys(k for cells in tp.values() for k in cells)),
    }


# ------------------------------------------------------------------------- render


def context(r: dict[str, Any], also: list[dict[str, Any]], img_rel: str) -> dict[str, Any]:
    """Everything the template reads: the results themselves, tables, verdicts, figures."""
    r = {**r, "search": search_rows(r)}
    env, fl, c = r["environment"], r["floors"], r["contention"]
    worst, best = search_cases(r)
    cr = r.get("crash", {})
    fencing = [v for k, v in r.get("primitives", {}).items() if k.startswith("fencing token")]
    return {
        "r": r,
        "env": env,
        "fl": fl,
        "rtt": fl["broker_round_trip"],
        "c": c,
        "plan": c["plan"],
        "uc": r["uncontended"],
        "ut": r.get("uncontended_tokens", {}),
        "ho": r.get("handoff", {}),
        "cr": cr,
        "handoff_plan": r.get("handoff_plan", {}),
        "img": {key: f"{img_rel}/{name}" for key, name in PLOTS.items()},
        "busy": busy_cores(env),
        "json_path": r.get("json_path", "benchmarks/results/latest.json"),
        "worst": worst,
        "best": best,
        "fencing_token": fencing[0] if fencing else None,
        "crash_errors": [f"{k}: {e}" for k in cr for e in cr[k].get("errors", [])],
        "token_goal": token_goal(r),
        "goal_rtt": TOKEN_HANDOFF_GOAL_RTT,
        "failover": failover(r),
        "floors_targets": floors_targets(r, also),
        "cmp": peers(r),
    }


def environment() -> jinja2.Environment:
    """Strict (a missing value fails the render), with filters for numbers (``num``,
    ``ms``, ``pct``, ``kib``), verdicts and tables."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals.update(labels=KIND_LABELS, kinds=HANDOFF_KINDS, KINDS=KINDS, RAW=RAW, nan=math.nan)
    env.filters.update({f.__name__: f for f in (rows, times, label, plain, ok, num, ms, pct)})
    env.filters.update(kib=lambda x: math.nan if x is None else x / 1024)
    env.filters.update(verdict=VERDICT.get, table=Table.markdown)
    return env
