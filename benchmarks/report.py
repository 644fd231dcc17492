"""docs/benchmarks.md and its plots, rendered from the results JSON alone.

Rendering never measures, so the doc can be regenerated (``--render-only``) after editing
the template (``templates/benchmarks.md.j2``) without another run. This module, like
``report_compare`` and ``report_headline``, only computes data: table rows, verdicts and
figures; every sentence and the layout are the template's, every plot is ``plots.py``'s.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import jinja2

from . import floors, handoff, report_compare, report_headline
from .tables import Table, ms, num, times, verdict

TEMPLATES = Path(__file__).with_name("templates")
TEMPLATE = "benchmarks.md.j2"
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
HANDOFF_KINDS = handoff.KINDS
#: handoff.py's labels without parentheses ("token semaphore, classic token queue").
KIND_LABELS = {k: v.replace(" (", ", ").rstrip(")") for k, v in handoff.LABELS.items()}
#: Issue 3's goal: a token handoff within this many broker round trips.
TOKEN_HANDOFF_GOAL_RTT = 3.0


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
        *[row(f"raw aiormq: {fl[key]['label']}", fl[key]) for key in floors.RAW if key in fl],
        row("semaphore C=1: `acquire()`", uc["semaphore_c1"]["acquire"]),
        row("semaphore C=1: `release()`", uc["semaphore_c1"]["release"]),
        row("mutex: `acquire()`", uc["mutex"]["acquire"]),
        row("mutex: `release()`", uc["mutex"]["release"]),
    ]
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
        rows.append(
            [
                str(s["capacity"]),
                f"{s['free_slot']} ({s['slot']})",
                num(s["p50_ms"]),
                num(s["p99_ms"]),
                f"{s['p50_x_c1']}x",
                f"{s['p99_x_c1']}x",
                f"{s['p50_x_rtt']}x",
                str(s["probes_sent"]),
                f"{num(cpu['client'])} / {num(cpu['broker'])} / {num(cpu['holders'])}",
                num(s.get("marginal_cpu_per_probe_us"), 0),
                num(s.get("holder_cpu_per_held_probe_us"), 0),
                f"{s['n']} ({s['reps']})",
            ]
        )
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
    rows = [
        [
            "acquisitions / s (total, median of runs)",
            f"{c['acquisitions_per_s']:.0f} (runs: {c['acquisitions_per_s_runs']})",
        ],
        ["grants per process: min / max", f"{g['min']:.0f} / {g['max']:.0f}"],
        [
            "grants per process: stddev (coefficient of variation)",
            f"{g['stddev']:.1f} ({g['cv']:.2f})",
        ],
        ["Jain fairness index (1 = equal)", f"{g['jain']:.3f}"],
        ["handoff p50 / p99 (ms)", f"{num(ho['p50_ms'])} / {num(ho['p99_ms'])}"],
        ["handoff p50 / broker round trip", f"{ho['p50_ms'] / rtt:.1f}x"],
        ["handoffs measured", str(ho["n"])],
        ["last `acquire(timeout=...)` of each worker: returned after its timeout by", overrun],
        ["worker errors (listed below the table)", str(len(c.get("worker_errors", [])))],
        [
            "slot searches (probe round trips) per grant, all workers",
            num(c.get("probe_round_trips_per_grant"), 1),
        ],
        [
            "CPU per grant: all workers / broker (ms)",
            f"{num(cpu['workers'])} / {num(cpu['broker'])}",
        ],
        [
            "share of handoffs won by the releasing process itself",
            f"{c['handoff_to_releaser_share']:.0%}",
        ],
    ]
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
        *[
            head(f"{KIND_LABELS[k]}: acquire, uncontended", ut[k]["acquire"])
            for k in ("token", "token_quorum")
            if k in ut
        ],
        *[
            head(f"handoff release -> blocked waiter, {KIND_LABELS[k]}", ho[k])
            for k in HANDOFF_KINDS
            if k in ho
        ],
        *[
            head(f"holder kill -9 -> blocked waiter holds, {KIND_LABELS[k]}", cr[k])
            for k in HANDOFF_KINDS
            if k in cr
        ],
    ]
    return Table(["measurement", "p50 ms", "p99 ms", "p50 / RTT"], rows)


# ------------------------------------------------------- token semaphore, lockers


def token_uncontended_table(r: dict[str, Any]) -> Table:
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    uc, ut = r["uncontended"], r.get("uncontended_tokens", {})
    rows = []
    kinds = [(k, ut.get(k)) for k in ("token", "token_nofence", "token_quorum")]
    kinds += [("semaphore", uc["semaphore_c1"]), ("mutex", uc["mutex"])]
    for k, s in kinds:
        if s is None:
            continue
        a, rel, cpu = s["acquire"], s["release"], s.get("cpu_per_cycle_ms", {})
        rows.append(
            [
                KIND_LABELS[k],
                num(a["p50_ms"]),
                num(a["p99_ms"]),
                times(a["p50_ms"], rtt),
                num(rel["p50_ms"]),
                num(rel["p99_ms"]),
                f"{num(cpu.get('client'))} / {num(cpu.get('broker'))}",
                str(a["n"]),
            ]
        )
    header = ["lock", "acquire p50 ms", "acquire p99 ms", "acquire p50 / RTT", "release p50 ms"]
    return Table([*header, "release p99 ms", "CPU ms per cycle client / broker", "n"], rows)


def handoff_table(r: dict[str, Any]) -> Table:
    rtt, ho = r["floors"]["broker_round_trip"], r.get("handoff", {})
    rows = [
        [
            "broker round trip (RTT), same run",
            num(rtt["p50_ms"], 3),
            num(rtt["p99_ms"], 3),
            "1.0x",
            times(rtt["p99_ms"], rtt["p50_ms"]),
            "",
            f"{rtt['n']}",
        ]
    ]
    rows += [
        [
            KIND_LABELS[k],
            num(ho[k]["p50_ms"]),
            num(ho[k]["p99_ms"]),
            times(ho[k]["p50_ms"], rtt["p50_ms"]),
            times(ho[k]["p99_ms"], rtt["p50_ms"]),
            num(ho[k].get("release_call_p50_ms")),
            f"{ho[k]['n']} ({ho[k]['reps']} reps)",
        ]
        for k in HANDOFF_KINDS
        if k in ho
    ]
    header = ["lock", "p50 ms", "p99 ms", "p50 / RTT", "p99 / RTT", "`release()` call p50 ms"]
    return Table([*header, "n"], rows)


def crash_table(r: dict[str, Any]) -> Table:
    cr = r.get("crash", {})
    rows = [
        [
            KIND_LABELS[k],
            num(cr[k]["p50_ms"], 1),
            num(cr[k]["p99_ms"], 1),
            num(cr[k].get("min_ms"), 1),
            num(cr[k].get("max_ms"), 1),
            str(cr[k]["n"]),
            str(len(cr[k].get("errors", []))),
        ]
        for k in HANDOFF_KINDS
        if k in cr
    ]
    return Table(["lock", "p50 ms", "p99 ms", "min ms", "max ms", "n", "errors"], rows)


def token_goal(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 3's goal per token kind measured: handoff p50 within 3 x RTT."""
    rtt, ho = r["floors"]["broker_round_trip"]["p50_ms"], r.get("handoff", {})
    return [
        {
            "label": KIND_LABELS[k],
            "p50": ho[k]["p50_ms"],
            "p99": ho[k]["p99_ms"],
            "x50": ho[k]["p50_ms"] / rtt,
            "x99": ho[k]["p99_ms"] / rtt,
            "met": ho[k]["p50_ms"] / rtt <= TOKEN_HANDOFF_GOAL_RTT,
        }
        for k in ("token", "token_nofence", "token_quorum")
        if k in ho
    ]


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


# ----------------------------------------------------------------------- context


def context(r: dict[str, Any], also: list[dict[str, Any]], img_rel: str) -> dict[str, Any]:
    """Everything the template reads: the results themselves, tables, verdicts, figures."""
    env, fl, uc, c = r["environment"], r["floors"], r["uncontended"], r["contention"]
    cpu_uc = uc["semaphore_c1"]["cpu_per_cycle_ms"]
    cycle_cpu = cpu_uc["client"] + cpu_uc["broker"]
    grant_cpu = (c["cpu_per_grant_ms"]["workers"] or 0) + (c["cpu_per_grant_ms"]["broker"] or 0)
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
        "busy": report_headline.busy_cores(env),
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
        "cycle_cpu": cycle_cpu,
        "grant_cpu": grant_cpu,
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
        "floors_targets": report_headline.context(r, also),
        "cmp": report_compare.context(r),
        "scale": report_compare.scale(r),
    }


def environment() -> jinja2.Environment:
    """The template's environment: strict (a missing value fails the render), filters for
    numbers (``num``, ``ms``, ``pct``), verdicts and tables."""
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


def render(
    results: dict[str, Any],
    doc: Path,
    img_dir: Path,
    also: list[dict[str, Any]] | None = None,
) -> None:
    """Write the PNGs into ``img_dir`` and the markdown report to ``doc``; ``also``: results
    of other RabbitMQ lines whose floors/targets tables the report shows too."""
    from . import plots

    doc.parent.mkdir(parents=True, exist_ok=True)
    plots.render(results, also or [], img_dir)
    img_rel = Path(os.path.relpath(img_dir, doc.parent)).as_posix()
    ctx = context(results, also or [], img_rel)
    doc.write_text(environment().get_template(TEMPLATE).render(ctx))
