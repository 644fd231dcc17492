"""docs/benchmarks.md's data, from the results JSON alone: the one report pipeline is
results JSON -> ``context`` (this module: table rows, verdicts, figures) -> the Jinja2
template ``templates/benchmarks.md.j2`` (every sentence, the layout) -> ``plots.py`` (every
plot). Rendering never measures: ``python -m benchmarks.run --render-only JSON``.

Targets (issue 12) are ratios of ours to the raw aiormq floor measured in the same run;
comparison ratios are ours / best peer (times: above 1 we are slower; throughput: below 1
we do less).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from tabulate import tabulate

from .floors import RAW
from .peers.kinds import KINDS

TEMPLATES = Path(__file__).with_name("templates")
#: The plots (``plots.py`` draws them) by key, as the template names them.
PLOTS = {
    "floors": "bench-uncontended.png",
    "search": "bench-latency-vs-slots.png",
    "handoff": "bench-handoff-cdf.png",
    "fairness": "bench-grants-per-process.png",
    "handoff_compare": "bench-handoff-compare.png",
    "failover": "bench-failover.png",
    "cmp_uncontended": "bench-compare-uncontended.png",
    "cmp_handoff": "bench-compare-handoff.png",
    "cmp_throughput": "bench-compare-throughput.png",
    "cmp_crash": "bench-compare-crash.png",
    "scale": "bench-scale-live-locks.png",
    "floors_targets": "bench-floors-targets.png",
}
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
#: Issue 3's goal: a token handoff within this many broker round trips.
TOKEN_HANDOFF_GOAL_RTT = 3.0
#: Grants/s of 16 processes on 4 slots before issue 12 (benchmarks/results/latest.json of
#: 2026-11-22, RabbitMQ 3.10.8, library at git aa24dac), the base of the 5x target.
THROUGHPUT_BASELINE = {"ours_token": 195.0, "ours_semaphore": 48.2}
THROUGHPUT_TARGET_X = 5.0
#: Fairness targets: Jain's index at least this, no wait longer than this x the median.
JAIN_TARGET = 0.98
WAIT_RATIO_TARGET = 3.0

# ------------------------------------------------------------------- cells, tables


def num(x: float | None, digits: int = 2, grouped: bool = False) -> str:
    """``x`` with ``digits`` decimals (thousands separated if ``grouped``); n/a for None/NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.{digits}f}" if grouped else f"{x:.{digits}f}"


def ms(x: float | None) -> str:
    """Milliseconds with sensible digits (0.042, 4.20, 42.0, 4,200)."""
    if x is None or math.isnan(x):
        return "n/a"
    return num(x, 3 if x < 1 else 2 if x < 10 else 1 if x < 100 else 0, grouped=True)


def times(a: float, b: float | None, digits: int = 1) -> str:
    """``a / b`` as "1.5x"; n/a when ``b`` is 0, None or NaN."""
    if not b or math.isnan(b) or math.isnan(a):
        return "n/a"
    return f"{a / b:.{digits}f}x"


def verdict(met: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "-"}[met]


@dataclass
class Table:
    """Formatted cells; rendered by the template's ``table`` filter (tabulate, pipe format:
    first column left, the rest ``align``, or one alignment per column)."""

    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    align: str | list[str] = "right"

    def markdown(self) -> str:
        cols = self.align
        if isinstance(cols, str):
            cols = ["left"] + [cols] * (len(self.header) - 1)
        return str(
            tabulate(self.rows, self.header, tablefmt="pipe", colalign=cols, disable_numparse=True)
        )


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


# ------------------------------------------------------------------------ this run


def _code_version(env: dict[str, Any]) -> str:
    """Which library code was measured: the repo's src/ (maybe modified) or a snapshot."""
    if not env.get("amqp_locks_from_repo", True):
        where = env.get("amqp_locks_path")
        return f"{env['amqp_locks']} (from `{where}`; repo at git {env['git_commit']})"
    dirty = ", src/ has uncommitted changes" if env["git_dirty"] else ""
    return f"{env['amqp_locks']} (git {env['git_commit']}{dirty})"


def machine_table(env: dict[str, Any]) -> Table:
    rmq = env["rabbitmq"]
    rows = [
        ["CPU", f"{env['cpu_model']}, {env['nproc']} cores (nproc)"],
        ["RAM", f"{env['ram_gib']} GiB"],
        ["OS", env["kernel"]],
        [
            "Load average (1/5/15 min) before / after",
            f"{env['loadavg_before']} / {env.get('loadavg_after', 'n/a')}",
        ],
        [
            "Cores busy during the run: this run (client, workers, broker) / other work",
            f"{env.get('own_load_cores', 'n/a')} / {env.get('other_load_cores', 'n/a')}",
        ],
        ["Python", env["python"]],
        ["RabbitMQ", f"{rmq['product']} {rmq['version']} on {rmq['platform']}"],
        ["aiormq / pamqp", f"{env['aiormq']} / {env['pamqp']}"],
        ["amqp-locks", _code_version(env)],
        ["Date, duration", f"{env['date']}, {env.get('duration_s', 'n/a')} s"],
    ]
    return Table(["", ""], rows, align="left")


def floors_table(r: dict[str, Any]) -> Table:
    fl, uc = r["floors"], r["uncontended"]
    rtt = fl["broker_round_trip"]["p50_ms"]

    def row(label: str, s: dict[str, Any]) -> list[str]:
        x = [times(s["p50_ms"], rtt), times(s["p99_ms"], rtt)]
        return [label, num(s["p50_ms"], 3), num(s["p99_ms"], 3), *x, f"{s['n']} ({s['reps']} reps)"]

    rows = [
        row("loopback TCP round trip (Python, 2 processes)", fl["loopback_tcp"]),
        row("broker round trip (`Broker.round_trip()`)", fl["broker_round_trip"]),
        *[row(f"raw aiormq: {fl[key]['label']}", fl[key]) for key in RAW if key in fl],
    ]
    for kind, label in (("semaphore_c1", "semaphore C=1"), ("mutex", "mutex")):
        rows += [row(f"{label}: `{op}()`", uc[kind][op]) for op in ("acquire", "release")]
    return Table(["operation", "p50 ms", "p99 ms", "p50 / RTT", "p99 / RTT", "samples"], rows)


def primitives_table(r: dict[str, Any]) -> Table:
    rows = [
        [label, num(p["p50_ms"], 3), num(p["p99_ms"], 3), f"{p['p50_x_rtt']}x"]
        for label, p in r.get("primitives", {}).items()
    ]
    return Table(["step", "p50 ms", "p99 ms", "p50 / RTT"], rows)


def search_table(r: dict[str, Any]) -> Table:
    rows = []
    for s in r["search"]:
        cpu = s["cpu_per_acquire_ms"]
        rows.append([
            str(s["capacity"]), f"{s['free_slot']} ({s['slot']})", num(s["p50_ms"]),
            num(s["p99_ms"]), f"{s['p50_x_c1']}x", f"{s['p99_x_c1']}x", f"{s['p50_x_rtt']}x",
            str(s["probes_sent"]),
            f"{num(cpu['client'])} / {num(cpu['broker'])} / {num(cpu['holders'])}",
            num(s.get("marginal_cpu_per_probe_us"), 0),
            num(s.get("holder_cpu_per_held_probe_us"), 0), f"{s['n']} ({s['reps']})",
        ])  # fmt: skip
    header = ["C", "free slot", "p50 ms", "p99 ms", "p50 / C=1", "p99 / C=1", "p50 / RTT"]
    header += ["probes sent", "CPU ms client / broker / holders"]
    header += ["client + broker CPU us per extra probe", "holders CPU us per held-slot probe"]
    return Table([*header, "n (reps)"], rows)


def contention_table(r: dict[str, Any]) -> Table:
    c = r["contention"]
    g, ho, cpu = c["grants_per_process"], c["handoff"], c["cpu_per_grant_ms"]
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    o = c.get("timeout_overrun")
    overrun = (
        f"p50 {num(o['p50_ms'], 1)} ms, max {num(o['max_ms'], 0)} ms; "
        f"{o['over_1s']} of {o['workers']} more than 1 s late, "
        f"{o['never_returned']} not within {c['plan'].get('grace_s', 15.0):.0f} s"
        if o
        else "n/a"
    )
    runs = f"{c['acquisitions_per_s']:.0f} (runs: {c['acquisitions_per_s_runs']})"
    rows = [
        ["acquisitions / s (total, median of runs)", runs],
        ["grants per process: min / max", f"{g['min']:.0f} / {g['max']:.0f}"],
        ["grants per process: stddev (coefficient of variation)",
         f"{g['stddev']:.1f} ({g['cv']:.2f})"],
        ["Jain fairness index (1 = equal)", f"{g['jain']:.3f}"],
        ["handoff p50 / p99 (ms)", f"{num(ho['p50_ms'])} / {num(ho['p99_ms'])}"],
        ["handoff p50 / broker round trip", f"{ho['p50_ms'] / rtt:.1f}x"],
        ["handoffs measured", str(ho["n"])],
        ["last `acquire(timeout=...)` of each worker: returned after its timeout by", overrun],
        ["worker errors (listed below the table)", str(len(c.get("worker_errors", [])))],
        ["slot searches (probe round trips) per grant, all workers",
         num(c.get("probe_round_trips_per_grant"), 1)],
        ["CPU per grant: all workers / broker (ms)",
         f"{num(cpu['workers'])} / {num(cpu['broker'])}"],
        ["share of handoffs won by the releasing process itself",
         f"{c['handoff_to_releaser_share']:.0%}"],
    ]  # fmt: skip
    return Table(["metric", "value"], rows)


def warnings_table(c: dict[str, Any]) -> Table | None:
    """The library's warnings in the contention workers (the first 8 kinds), if any."""
    rows = [[str(n), f"`{msg}`"] for msg, n in list(c.get("worker_warnings", {}).items())[:8]]
    return Table(["count", "logger: message"], rows, align=["right", "left"]) if rows else None


def search_cases(r: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worst case of the sweep (largest C, free slot last) and the best at that C."""
    worst = max(r["search"], key=lambda s: s["capacity"] * (s["free_slot"] == "last"))
    same_c = [s for s in r["search"] if s["capacity"] == worst["capacity"]]
    return worst, next((s for s in same_c if s["free_slot"] == "first"), worst)


def headline_table(r: dict[str, Any]) -> Table:
    fl, uc, c = r["floors"], r["uncontended"], r["contention"]
    rtt = fl["broker_round_trip"]
    ut, ho, cr = r.get("uncontended_tokens", {}), r.get("handoff", {}), r.get("crash", {})
    worst, best = search_cases(r)
    plan = c["plan"]

    def head(label: str, s: dict[str, Any]) -> list[str]:
        return [label, num(s["p50_ms"]), num(s["p99_ms"]), f"{s['p50_ms'] / rtt['p50_ms']:.1f}x"]

    contended = f"{plan['processes']} processes / {plan['slots']} slots"
    rows = [
        head("broker round trip (RTT)", rtt),
        head("semaphore acquire, C=1, uncontended", uc["semaphore_c1"]["acquire"]),
        head("semaphore release", uc["semaphore_c1"]["release"]),
        head("mutex acquire, uncontended", uc["mutex"]["acquire"]),
        head(f"semaphore acquire, C={worst['capacity']}, only the last slot free", worst),
        head(f"semaphore acquire, C={best['capacity']}, only the first slot free", best),
        head(f"handoff release -> next grant, {contended}", c["handoff"]),
        [f"throughput, {contended}", f"{c['acquisitions_per_s']:.0f} acquisitions/s", "", ""],
    ]
    rows += [
        head(f"{KIND_LABELS[k]}: acquire, uncontended", ut[k]["acquire"])
        for k in ("token", "token_quorum")
        if k in ut
    ]
    for what, data in (
        ("handoff release -> blocked waiter", ho),
        ("holder kill -9 -> blocked waiter holds", cr),
    ):
        rows += [head(f"{what}, {KIND_LABELS[k]}", data[k]) for k in HANDOFF_KINDS if k in data]
    return Table(["measurement", "p50 ms", "p99 ms", "p50 / RTT"], rows)


def token_uncontended_table(r: dict[str, Any]) -> Table:
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    uc, ut = r["uncontended"], r.get("uncontended_tokens", {})
    kinds = [(k, ut.get(k)) for k in ("token", "token_nofence", "token_quorum")]
    kinds += [("semaphore", uc["semaphore_c1"]), ("mutex", uc["mutex"])]
    rows = []
    for k, s in kinds:
        if s is not None:
            a, rel, cpu = s["acquire"], s["release"], s.get("cpu_per_cycle_ms", {})
            rows.append([
                KIND_LABELS[k], num(a["p50_ms"]), num(a["p99_ms"]), times(a["p50_ms"], rtt),
                num(rel["p50_ms"]), num(rel["p99_ms"]),
                f"{num(cpu.get('client'))} / {num(cpu.get('broker'))}", str(a["n"]),
            ])  # fmt: skip
    header = ["lock", "acquire p50 ms", "acquire p99 ms", "acquire p50 / RTT", "release p50 ms"]
    return Table([*header, "release p99 ms", "CPU ms per cycle client / broker", "n"], rows)


def handoff_table(r: dict[str, Any]) -> Table:
    rtt, ho = r["floors"]["broker_round_trip"], r.get("handoff", {})
    rows = [[
        "broker round trip (RTT), same run", num(rtt["p50_ms"], 3), num(rtt["p99_ms"], 3),
        "1.0x", times(rtt["p99_ms"], rtt["p50_ms"]), "", f"{rtt['n']}",
    ]]  # fmt: skip
    rows += [
        [
            KIND_LABELS[k], num(s["p50_ms"]), num(s["p99_ms"]), times(s["p50_ms"], rtt["p50_ms"]),
            times(s["p99_ms"], rtt["p50_ms"]), num(s.get("release_call_p50_ms")),
            f"{s['n']} ({s['reps']} reps)",
        ]
        for k, s in ((k, ho[k]) for k in HANDOFF_KINDS if k in ho)
    ]  # fmt: skip
    header = ["lock", "p50 ms", "p99 ms", "p50 / RTT", "p99 / RTT", "`release()` call p50 ms"]
    return Table([*header, "n"], rows)


def crash_table(r: dict[str, Any]) -> Table:
    cr = r.get("crash", {})
    stats = ("p50_ms", "p99_ms", "min_ms", "max_ms")
    rows = [
        [KIND_LABELS[k], *(num(cr[k].get(x), 1) for x in stats), str(cr[k]["n"]),
         str(len(cr[k].get("errors", [])))]
        for k in HANDOFF_KINDS
        if k in cr
    ]  # fmt: skip
    return Table(["lock", "p50 ms", "p99 ms", "min ms", "max ms", "n", "errors"], rows)


def token_goal(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 3's goal per token kind measured: handoff p50 within 3 x RTT."""
    rtt, ho = r["floors"]["broker_round_trip"]["p50_ms"], r.get("handoff", {})
    return [
        {"label": KIND_LABELS[k], "p50": ho[k]["p50_ms"], "p99": ho[k]["p99_ms"],
         "x50": ho[k]["p50_ms"] / rtt, "x99": ho[k]["p99_ms"] / rtt,
         "met": ho[k]["p50_ms"] / rtt <= TOKEN_HANDOFF_GOAL_RTT}
        for k in ("token", "token_nofence", "token_quorum")
        if k in ho
    ]  # fmt: skip


def failover_rows(r: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Locker labels in order, and per label {group: stats}."""
    per: dict[str, dict[str, Any]] = {}
    for group, g in r.get("failover", {}).get("groups", {}).items():
        for row in g["rows"]:
            per.setdefault(row["locker"], {})[group] = row
    return list(per), per


def failover_tables(r: dict[str, Any]) -> tuple[Table, Table, list[str]]:
    """The headline table (p50 / max), the full table and the failed samples' errors."""
    labels, per = failover_rows(r)
    groups = list(r.get("failover", {}).get("groups", {}))
    head = Table(
        ["locker: failover (kill -9 -> standby is master), s"]
        + [f"{g} settings: p50 / max" for g in groups]
    )
    full = Table(
        ["locker"] + [f"{g}: {c}" for g in groups for c in ("p50 s", "p99 s", "min-max s", "n")]
    )
    errors = []
    for label in labels:
        head.rows.append([label])
        full.rows.append([label])
        for g in groups:
            s = per[label].get(g)
            errors += [f"{label} ({g}): {e}" for e in (s or {}).get("errors", [])]
            if not s or not s.get("n"):
                head.rows[-1].append("n/a")
                full.rows[-1] += ["n/a", "n/a", "n/a", "0"]
                continue
            p50, p99, lo, hi = (num(s[k] / 1000) for k in ("p50_ms", "p99_ms", "min_ms", "max_ms"))
            head.rows[-1].append(f"{p50} / {hi}")
            full.rows[-1] += [p50, p99, f"{lo}-{hi}", str(s["n"])]
    return head, full, errors


# ------------------------------------------------------- floors and targets (issue 12)

_FLOORS = {
    "get_classic": "`basic.get`",
    "reject_deliver_classic": "reject -> deliver",
    "get_quorum": "`basic.get` (quorum)",
    "reject_deliver_quorum": "reject -> deliver (quorum)",
    "exclusive_declare": "exclusive declare",
}
#: (label, floor key, where ours is in the results, target ratio (None: information),
#: sequence floor key: raw aiormq doing the same broker steps as ours, shown beside)
_TARGETS: list[tuple[str, str, tuple[str, ...], float | None, str | None]] = [
    ("token semaphore (fencing on): uncontended acquire", "get_classic",
     ("uncontended_tokens", "token", "acquire"), 2.0, "token_cycle"),
    ("token semaphore (fencing on): handoff release -> blocked waiter holds",
     "reject_deliver_classic", ("handoff", "token"), 2.0, "token_handoff_tx"),
    ("token semaphore, `fencing=False`: uncontended acquire", "get_classic",
     ("uncontended_tokens", "token_nofence", "acquire"), 1.5, "token_cycle"),
    ("token semaphore, `fencing=False`: handoff", "reject_deliver_classic",
     ("handoff", "token_nofence"), 1.5, None),
    ("token semaphore, quorum token queue: uncontended acquire", "get_quorum",
     ("uncontended_tokens", "token_quorum", "acquire"), None, None),
    ("token semaphore, quorum token queue: handoff", "reject_deliver_quorum",
     ("handoff", "token_quorum"), None, None),
    ("mutex: uncontended acquire", "exclusive_declare",
     ("uncontended", "mutex", "acquire"), 2.0, None),
    ("mutex: handoff, releaser asking again at once", "exclusive_declare",
     ("reask", "mutex"), 3.0, "mutex_handoff"),
    ("persistent semaphore, C=1: uncontended acquire", "exclusive_declare",
     ("uncontended", "semaphore_c1", "acquire"), 2.0, None),
    ("persistent semaphore, C=1: handoff, releaser asking again at once", "exclusive_declare",
     ("reask", "semaphore"), 3.0, None),
]  # fmt: skip


def _row(
    label: str, floor_label: str, floor: float | None, ours: float | None,
    target: float | None, note: str = "", sequence: float | None = None, **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """One line of the table: ours / floor against a target ratio (None: information)."""
    ratio = ours / floor if ours is not None and floor else None
    seq_ratio = ours / sequence if ours is not None and sequence else None
    return {
        "sequence_ms": sequence,
        "sequence_ratio": None if seq_ratio is None else round(seq_ratio, 2),
        "label": label,
        "floor_label": floor_label,
        "floor_ms": floor,
        "ours_ms": ours,
        "ratio": None if ratio is None else round(ratio, 2),
        "target": "(information)" if target is None else f"<= {target:g}x",
        "met": None if target is None or ratio is None else ratio <= target,
        "note": note,
        **extra,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets judged from one results file: floor and ours p50 (ms), ratio,
    target, ``met`` (None when not measured or information only)."""
    fl = r.get("floors", {})

    def f50(key: str | None) -> float | None:
        v = _get(fl, key, "p50_ms") if key else None
        return float(v) if isinstance(v, (int, float)) else None

    rows = []
    for label, key, path, target, seq in _TARGETS:
        s = _get(r, *path)
        note = ""
        if path[0] == "reask" and s and s.get("handoffs"):
            note = f"the releaser won it back {s['releaser_won']} times in {s['handoffs']}"
        # The floor's p50 per repetition, lowest and highest: a floor that moved during its
        # own measurement says how far a ratio to it can be trusted.
        reps = _get(fl, key, "p50_reps_ms")
        spread = [min(reps), max(reps)] if isinstance(reps, list) and len(reps) > 1 else None
        ours = _get(s, "p50_ms")
        rows.append(
            _row(label, _FLOORS[key], f50(key), ours, target, note, f50(seq), floor_reps_ms=spread)
        )
    search = r.get("search") or []
    c1 = next((x for x in search if x["capacity"] == 1), None)
    last = [x for x in search if x.get("free_slot") == "last" and x["capacity"] > 1]
    if last:
        worst = max(last, key=lambda x: x["capacity"])
        full = worst["capacity"] >= 1000
        note = "" if full else "smaller C than the target's 1000, not judged"
        label = f"persistent semaphore, C={worst['capacity']}, only the last slot free: acquire"
        row = _row(label, "its C=1 acquire", _get(c1, "p50_ms"), worst["p50_ms"], 3.0, note)
        row["met"] = row["met"] if full else None
        rows.append(row)
    return rows


def head_to_head(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The head-to-head targets, from the comparison with the peers in the same run."""
    peers = r.get("peers", {})
    rows: list[dict[str, Any]] = []

    def p50(cell: Any) -> float | None:
        if not isinstance(cell, dict) or "error" in cell or not cell.get("n", 1):
            return None
        v = cell.get("p50_ms")
        return v if isinstance(v, (int, float)) else None

    ho = peers.get("handoff", {})
    waiters = sorted(ho.get("ours_token", {}), key=int)
    if waiters:
        n = waiters[0]
        pg, ours = p50(_get(ho, "pg_advisory", n)), p50(_get(ho, "ours_token", n))
        rows.append(
            _row(f"token handoff, {n} waiters", "PostgreSQL `pg_advisory_lock`", pg, ours, 1.0)
        )
    unc = peers.get("uncontended", {})
    redis, ours = p50(_get(unc, "redis_py", "cycle")), p50(_get(unc, "ours_token", "cycle"))
    rows.append(_row("token uncontended acquire + release", "redis-py `Lock`", redis, ours, 2.0))
    thr = _get(peers, "throughput", "4") or {}
    procs = peers.get("plan", {}).get("processes")
    for kind, label in (
        ("ours_token", "token semaphore"),
        ("ours_semaphore", "persistent semaphore"),
    ):
        rate, base = _get(thr, kind, "grants_per_s"), THROUGHPUT_BASELINE[kind]
        got = None if rate is None or _get(thr, kind, "error") else rate / base
        comparable = procs == 16
        rows.append(
            {
                "label": f"{procs} processes on 4 slots, {label}: grants/s",
                "floor_label": "grants/s before issue 12",
                "floor_ms": base,
                "ours_ms": rate,
                "ratio": None if got is None else round(got, 2),
                "target": f">= {THROUGHPUT_TARGET_X:g}x",
                "met": (got >= THROUGHPUT_TARGET_X) if got is not None and comparable else None,
                "note": "" if comparable else "smoke run: not 16 processes, not judged",
                "higher_is_better": True,
            }
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
            if jain is None or ratio is None or (isinstance(jain, float) and math.isnan(jain))
            else jain >= JAIN_TARGET and ratio <= WAIT_RATIO_TARGET and not s.get("errors")
        )
        rows.append({"kind": kind, "label": LABELS.get(kind, kind), **s, "met": ok})
    return rows


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


def targets_table(r: dict[str, Any]) -> Table:
    header = ["operation (p50)", "floor", "floor ms", "ours ms", "ours / floor", "target"]
    rows = []
    for row in target_rows(r):
        seq, sr = row.get("sequence_ms"), row.get("sequence_ratio")
        rows.append([
            row["label"], row["floor_label"], _value(row, "floor_ms") + _reps(row),
            _value(row, "ours_ms"), "n/a" if row["ratio"] is None else f"{row['ratio']:.1f}x",
            row["target"], verdict(row["met"]) + (f" ({row['note']})" if row["note"] else ""),
            "" if seq is None else f"{num(seq)} ({'n/a' if sr is None else f'{sr:.1f}x'})",
        ])  # fmt: skip
    return Table([*header, "met?", "same steps, raw: ms (ours / it)"], rows)


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
            row["label"], " / ".join(str(g) for g in row["grants"]), num(row.get("jain"), 3),
            num(row.get("wait_p50_ms"), 1), num(row.get("wait_max_ms"), 1),
            num(row.get("wait_max_over_median"), 2) + _over(row),
            str(len(row.get("errors", []))), verdict(row["met"]),
        ]
        for row in fairness_rows(r)
    ]  # fmt: skip
    header = ["primitive", "grants per process", f"Jain (>= {JAIN_TARGET})", "wait p50 ms"]
    header += ["wait max ms", f"max / median (<= {WAIT_RATIO_TARGET:g})", "errors", "met?"]
    return Table(header, out) if out else None


def reask_table(r: dict[str, Any]) -> Table | None:
    out = [
        [
            LABELS.get(kind, kind), num(s["p50_ms"]), num(s["p99_ms"]),
            num(s.get("to_waiter", {}).get("p50_ms")), num(s.get("to_releaser", {}).get("p50_ms")),
            f"{s['releaser_won']} of {s['handoffs']}",
        ]
        for kind, s in r.get("reask", {}).items()
    ]  # fmt: skip
    header = ["lock", "release -> next grant p50 ms", "p99 ms", "p50 when the waiter got it"]
    header += ["p50 when the releaser got it back", "releaser won it back"]
    return Table(header, out) if out else None


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
    plan = r.get("headline_plan", {})
    return {
        "this": line(r),
        "others": [line(other) for other in also],
        "fair_processes": plan.get("fair_processes", 4),
        "fair_hold_ms": plan.get("fair_hold", 0.005) * 1000,
        "reask": reask_table(r),
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


def versions_table(r: dict[str, Any]) -> Table:
    p = r["peers"]
    servers = {
        "amqp": f"RabbitMQ {r['environment']['rabbitmq']['version']}",
        "redis": f"Redis {p['servers'].get('Redis', '?')}",
        "zookeeper": f"ZooKeeper {p['servers'].get('ZooKeeper', '?')}",
        "postgresql": "PostgreSQL (devdb)",
        None: "local files",
    }
    rows = []
    for k in p.get("kinds", []):
        kind = KINDS[k]
        tuned = ", ".join(f"{a}={v}" for a, v in (kind.tuned or {}).items()) or "as default"
        default = ", ".join(f"{a}={v}" for a, v in kind.default.items()) or "(none)"
        rows.append([
            label(k), p["libraries"].get(k, "?"), servers[kind.server], kind.wait, kind.crash,
            f"`{default}`", f"`{tuned}`" if kind.tuned else tuned,
        ])  # fmt: skip
    header = ["lock", "version", "server", "a blocked acquire learns the lock is free"]
    header += ["a crashed holder's lock is freed by", "default settings", "tuned settings"]
    return Table(header, rows)


def uncontended_table(r: dict[str, Any]) -> Table:
    p, rtt = r["peers"], r["floors"]["broker_round_trip"]["p50_ms"]
    best = _best(_uc(p))

    def row(name: str, s: dict[str, Any], vs_best: str) -> list[str]:
        a, cycle = s["acquire"], s["cycle"]["p50_ms"]
        times_rtt = f"{a['p50_ms'] / rtt:.1f}x"
        return [
            name,
            ms(a["p50_ms"]),
            ms(a["p99_ms"]),
            ms(s["release"]["p50_ms"]),
            ms(cycle),
            times_rtt,
            vs_best,
        ]

    rows = [
        row(label(k), s, times(s["cycle"]["p50_ms"], best[1]) if best else "n/a")
        if ok(s)
        else [label(k), "error", "", "", "", "", ""]
        for k, s in p.get("uncontended", {}).items()
    ]
    lockers = p.get("lockers", {}).items()
    rows += [row(f"locker: {name} (`start()` / `stop()`)", s, "") for name, s in lockers if ok(s)]
    best_txt = f"best peer: {plain(best[0])}" if best else "best peer"
    header = ["lock", "acquire p50 ms", "acquire p99 ms", "release p50 ms", "cycle p50 ms"]
    return Table([*header, "acquire / RTT", f"cycle / {best_txt}"], rows)


def peers_handoff_table(r: dict[str, Any]) -> Table:
    p = r["peers"]
    ns = [str(n) for n in p["plan"]["waiters"]]
    bests = {n: _best(_ho(p, n)) for n in ns}
    rows = []
    for k, cells in p.get("handoff", {}).items():
        row = [label(k)]
        for n in ns:
            s, b = cells.get(n), bests[n]
            if s is None or not ok(s):
                row.append("error")
                continue
            ratio = f" ({times(s['p50_ms'], b[1])})" if KINDS[k].ours and b else ""
            row.append(f"{ms(s['p50_ms'])} / {ms(s['p99_ms'])}{ratio}")
        rows.append(row)
    rows.append(
        ["best peer"] + [f"{plain(b[0])}: {ms(b[1])}" if b else "n/a" for b in bests.values()]
    )
    return Table(["lock"] + [f"{n} waiters: p50 / p99 ms (ours / best peer)" for n in ns], rows)


def throughput_table(r: dict[str, Any]) -> Table:
    p = r["peers"]
    tp = p.get("throughput", {})
    bests = {s: _best(_tp(p, s), high=True) for s in tp}
    rows = []
    for k in dict.fromkeys(k for s in tp for k in tp[s]):
        row = [label(k)]
        for s in tp:
            c, b = tp[s].get(k), bests[s]
            if c is None:
                row += ["-", "-"]
            elif "error" in c:
                row += ["error", ""]
            else:
                f = c["fairness"]
                ratio = f" ({c['grants_per_s'] / b[1]:.2g}x)" if KINDS[k].ours and b else ""
                row += [
                    f"{c['grants_per_s']:,.0f}{ratio}",
                    f"{num(f['jain'])} / {num(f['cv'])} / {f['min']}-{f['max']}",
                ]
        rows.append(row)
    header = ["lock"]
    for s in tp:
        recipe = " (locks-only peers: N locks)" if s != "1" else ""
        header += [f"{s} slot(s){recipe}: grants/s (ours / best peer)", "Jain / CV / min-max"]
    return Table(header, rows)


def _crash_cell(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    if "error" in s:
        return "error"
    if s.get("censored"):
        return f"never (still held after {s['cap_s']:.0f} s)"
    return f"{ms(s['p50_ms'])} / {ms(s['max_ms'])}"


def peers_crash_table(r: dict[str, Any]) -> Table:
    rows = []
    for k, groups in r["peers"].get("crash", {}).get("rows", {}).items():
        d, t = groups.get("default"), groups.get("tuned")
        tuned = "as default" if KINDS[k].tuned is None and t is None else _crash_cell(t)
        n = "/".join(str(g.get("n", 0)) for g in (d, t) if g)
        rows.append([label(k), _crash_cell(d), tuned, n])
    return Table(["lock", "default settings: p50 / max ms", "tuned: p50 / max ms", "n"], rows)


def peers_headline_table(r: dict[str, Any]) -> Table:
    """One row per metric: our best primitive, the best peer, the ratio, win or loss."""
    p = r["peers"]
    rows: list[list[str]] = []

    def add(metric: str, values: dict[str, float], high: bool = False) -> None:
        bo, bp = _best(values, high, ours=True), _best(values, high)
        if not bo or not bp:
            return
        fmt = (lambda v: f"{v:,.0f}") if high else ms
        if high:
            ratio = f"{bo[1] / bp[1]:.2f}x"
        else:
            ratio = "n/a" if math.isinf(bp[1]) else times(bo[1], bp[1])
        win = bo[1] >= bp[1] if high else bo[1] <= bp[1]
        best_ours, best_peer = f"{plain(bo[0])}: {fmt(bo[1])}", f"{plain(bp[0])}: {fmt(bp[1])}"
        rows.append([metric, best_ours, best_peer, ratio, "**win**" if win else "loss"])

    add("uncontended acquire + release (p50 ms)", _uc(p))
    for n in (str(n) for n in p["plan"]["waiters"]):
        add(f"handoff, {n} waiters (p50 ms)", _ho(p, n))
    for s in p.get("throughput", {}):
        add(f"throughput, {p['plan']['processes']} processes / {s} slot(s)", _tp(p, s), True)
    for g in ("default", "tuned"):
        if vals := _cr(p, g):
            add(f"crash: kill -9 -> waiter holds, {g} settings (p50 ms)", vals)
    return Table(["metric", "ours (best primitive)", "best peer", "ours / best peer", ""], rows)


def pollers_verdict(r: dict[str, Any]) -> tuple[bool | None, Table | None]:
    """Target: handoff and crash failover >= 10x faster than every polling peer (defaults).
    The verdict (None: not measured) and the factors (peer time / our time)."""
    p = r["peers"]
    pollers = [k for k in p.get("kinds", []) if KINDS[k].polls]
    checks = [(f"handoff, {n} waiters", _ho(p, str(n))) for n in p["plan"]["waiters"]]
    if _cr(p, "default"):
        checks.append(("crash, default settings", _cr(p, "default")))
    rows: list[list[str]] = []
    met_all = True
    for metric, vals in checks:
        for ours in (k for k in vals if KINDS[k].ours):
            row = [metric, f"{plain(ours)} ({ms(vals[ours])} ms)"]
            for peer in pollers:
                if peer not in vals:
                    row.append("n/a")
                    continue
                factor = vals[peer] / vals[ours] if vals[ours] else math.inf
                met_all &= factor >= 10
                shown = "never frees" if math.isinf(factor) else f"{factor:.1f}x"
                row.append(f"**{shown}**" if factor >= 10 else shown)
            rows.append(row)
    if not rows:
        return None, None
    return met_all, Table(["metric", "ours"] + [f"vs {plain(k)}" for k in pollers], rows)


def peer_targets(r: dict[str, Any]) -> dict[str, Any]:
    """The comparison's three targets: pollers (verdict, table), token acquire, search."""
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    met, table = pollers_verdict(r)
    out: dict[str, Any] = {"pollers": met, "pollers_table": table, "rtt": rtt}
    out.update(token=None, search=None)
    tok = r["peers"].get("uncontended", {}).get("ours_token")
    if tok is not None and ok(tok):
        p50 = tok["acquire"]["p50_ms"]
        out["token"] = {"p50": p50, "x": p50 / rtt, "met": p50 / rtt <= 3}
    rows = r.get("search", [])
    c1 = next((s for s in rows if s["capacity"] == 1), None)
    big = [s for s in rows if s["capacity"] == max((s["capacity"] for s in rows), default=0)]
    if c1 and big:
        parts = [(s["free_slot"], s["p50_ms"], s["p50_ms"] / c1["p50_ms"]) for s in big]
        met = all(x <= 3 for *_, x in parts)
        out["search"] = {
            "capacity": big[0]["capacity"],
            "c1": c1["p50_ms"],
            "parts": parts,
            "met": met,
        }
    return out


def peers(r: dict[str, Any]) -> dict[str, Any] | None:
    """The comparison's tables, verdicts and plan for the template (None: not measured)."""
    if "peers" not in r:
        return None
    p = r["peers"]
    return {
        "p": p,
        "plan": p["plan"],
        "versions": versions_table(r),
        "headline": peers_headline_table(r),
        "targets": peer_targets(r),
        "uncontended": uncontended_table(r),
        "handoff": peers_handoff_table(r),
        "throughput": throughput_table(r),
        "crash": peers_crash_table(r),
        "crash_wall": p.get("crash", {}).get("wall_s"),
    }


# --------------------------------------------------------------------------- scale


def scale_table(r: dict[str, Any]) -> Table:
    rows = []
    for row in r.get("scale", {}).get("rows", []):
        b = row.get("broker", {})
        mem, q = b.get("memory", {}), b.get("queues", {})
        rows.append([
            f"{row['locks']:,}", str(row["connections"]), ms(row["acquire"]["p50_ms"]),
            ms(row["acquire"]["p99_ms"]),
            num(mem.get("total", math.nan) / 2**20, 0, True) if mem else "n/a",
            num((b.get("beam_rss") or math.nan) / 2**20, 0, True),
            f"{sum(x['queues'] for x in q.values()):,}" if q else "n/a",
            f"{b.get('erlang_processes', 0):,}" if b else "n/a",
            str(b.get("fds_used", "n/a")), num(row.get("place_s"), 1, True),
        ])  # fmt: skip
    header = ["live locks", "connections", "acquire p50 ms", "acquire p99 ms"]
    header += ["broker memory MiB (Erlang)", "broker RSS MiB", "queues", "Erlang processes"]
    return Table([*header, "file descriptors", "placed in s"], rows)


def scale(r: dict[str, Any]) -> dict[str, Any]:
    """The scale run's figures: per-lock slopes (KiB), the idle connection, the fence queue."""
    sc = r.get("scale", {})
    sl, ex = sc.get("slopes", {}), sc.get("extras", {})
    rows = sc.get("rows", [])
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    conn, fence = ex.get("connections", {}), ex.get("fence_queues", {})

    def kib(d: dict[str, Any], key: str) -> float:
        return float(d.get(key, math.nan)) / 1024

    return {
        "table": scale_table(r),
        "bytes_lock": kib(sl, "bytes_total"),
        "rss_lock": kib(sl, "bytes_rss"),
        "queue_bytes": kib(sl, "queue_bytes_each"),
        "queues_each": sl.get("queues_each"),
        "procs_each": sl.get("erlang_processes_each"),
        "categories": list(sl.get("bytes_by_category", {}).items())[:6],
        "conn_bytes": kib(conn, "bytes_each"),
        "conn_binary": kib(conn, "binary_bytes_each"),
        "conn_rss": kib(conn, "rss_bytes_each"),
        "conn_procs": conn.get("erlang_processes_each"),
        "fence_quorum": kib(fence, "quorum_bytes_each"),
        "fence_bytes": kib(fence, "bytes_each_total"),
        "fence_queue_bytes": kib(fence, "bytes_each_queue"),
        "fence_procs": fence.get("erlang_processes_each"),
        "fence_first_ms": fence.get("first_acquire_ms"),
        "min": first.get("locks", 0),
        "max": last.get("locks", 0),
        "acq_min": first.get("acquire", {}).get("p50_ms", math.nan),
        "acq_max": last.get("acquire", {}).get("p50_ms", math.nan),
        "per_connection": sc.get("per_connection", "n/a"),
        "wall": sc.get("wall_s"),
    }


# ------------------------------------------------------------------------- render


def context(r: dict[str, Any], also: list[dict[str, Any]], img_rel: str) -> dict[str, Any]:
    """Everything the template reads: the results themselves, tables, verdicts, figures."""
    env, fl, uc, c = r["environment"], r["floors"], r["uncontended"], r["contention"]
    cpu_uc = uc["semaphore_c1"]["cpu_per_cycle_ms"]
    worst, best = search_cases(r)
    cpu_w = worst["cpu_per_acquire_ms"]
    cpu_w_total = cpu_w["client"] + cpu_w["broker"]
    fo_head, fo_table, fo_errors = failover_tables(r)
    cr = r.get("crash", {})
    return {
        "r": r,
        "env": env,
        "fl": fl,
        "rtt": fl["broker_round_trip"],
        "uc": uc,
        "c": c,
        "plan": c["plan"],
        "img": {key: f"{img_rel}/{name}" for key, name in PLOTS.items()},
        "busy": busy_cores(env),
        "json_path": r.get("json_path", "benchmarks/results/latest.json"),
        "tables": {
            "headline": headline_table(r),
            "machine": machine_table(env),
            "floors": floors_table(r),
            "primitives": primitives_table(r),
            "search": search_table(r),
            "contention": contention_table(r),
            "warnings": warnings_table(c),
            "token_uncontended": token_uncontended_table(r),
            "handoff": handoff_table(r),
            "crash": crash_table(r),
        },
        "cycle_cpu": cpu_uc["client"] + cpu_uc["broker"],
        "grant_cpu": (c["cpu_per_grant_ms"]["workers"] or 0)
        + (c["cpu_per_grant_ms"]["broker"] or 0),
        "worst": worst,
        "best": best,
        "worst_client_share": cpu_w["client"] / cpu_w_total if cpu_w_total else None,
        "ho": r.get("handoff", {}),
        "cr": cr,
        "crash_errors": [f"{k}: {e}" for k in cr for e in cr[k].get("errors", [])],
        "token_goal": token_goal(r),
        "goal_rtt": TOKEN_HANDOFF_GOAL_RTT,
        "handoff_plan": r.get("handoff_plan", {}),
        "fencing_token": next(
            (v for k, v in r.get("primitives", {}).items() if k.startswith("fencing token")), None
        ),
        "failover": {
            **r.get("failover", {}),
            "headline": fo_head if fo_head.rows else None,
            "table": fo_table,
            "errors": fo_errors,
        },
        "floors_targets": floors_targets(r, also),
        "cmp": peers(r),
        "scale": scale(r),
    }


def environment() -> jinja2.Environment:
    """Strict (a missing value fails the render), with filters for numbers (``num``,
    ``ms``, ``pct``), verdicts and tables."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters.update(
        num=num,
        ms=ms,
        pct=lambda x, digits=0: "n/a" if x is None or math.isnan(x) else f"{x:.{digits}%}",
        verdict=verdict,
        table=Table.markdown,
    )
    return env
