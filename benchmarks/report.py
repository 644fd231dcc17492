"""Plots (matplotlib, Agg) and docs/benchmarks.md, rendered from the results JSON alone.

Rendering never measures, so the doc can be regenerated (``--render-only``) after editing
``template.md`` without another run; every number in the doc comes from the JSON.
"""

from __future__ import annotations

import math
import os
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

from . import report_compare, report_headline

TEMPLATE = Path(__file__).with_name("template.md")
PLOTS = {
    "floors": "bench-uncontended.png",
    "search": "bench-latency-vs-slots.png",
    "handoff": "bench-handoff-cdf.png",
    "fairness": "bench-grants-per-process.png",
    "handoff_compare": "bench-handoff-compare.png",
    "failover": "bench-failover.png",
}


def _f(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def _div(a: float, b: float | None) -> float:
    """a / b, NaN when b is 0, None or NaN (e.g. no broker CPU for an external broker)."""
    if b is None or b == 0 or math.isnan(b):
        return math.nan
    return a / b


def _pct(a: float, b: float) -> str:
    q = _div(a, b)
    return "n/a" if math.isnan(q) else f"{q:.0%}"


def _table(header: list[str], rows: list[list[str]], numeric: bool = True) -> str:
    """A markdown table; the first column left-aligned, the rest right if ``numeric``."""
    rest = "---:" if numeric else ":---"
    lines = ["| " + " | ".join(header) + " |", "|:---|" + "|".join(rest for _ in header[1:]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots


def _plot_floors(r: dict[str, Any], path: Path) -> None:
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
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * len(items) + 1.5))
    ys = range(len(items))[::-1]
    p50 = [s["p50_ms"] for _, s in items]
    p99 = [s["p99_ms"] for _, s in items]
    ax.barh(list(ys), p99, color="#c6dbef", label="p99")
    ax.barh(list(ys), p50, color="#2171b5", label="p50")
    ax.set_yticks(list(ys), [label for label, _ in items])
    for key, color, text in (
        ("get_classic", "#238b45", "floor: `basic.get`"),
        ("exclusive_declare", "#cb181d", "floor: exclusive declare"),
    ):
        if key in fl:
            v = fl[key]["p50_ms"]
            ax.axvline(v, color=color, linestyle="--", label=f"{text} p50 {v:.2f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_title("Floors and uncontended operations")
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_search(r: dict[str, Any], path: Path) -> None:
    rows = r["search"]
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    c1 = [row for row in rows if row["capacity"] == rows[0]["capacity"]]
    for position, color in (("last", "#cb181d"), ("first", "#2171b5")):
        sel = c1 + [x for x in rows if x["free_slot"] == position and x not in c1]
        sel.sort(key=lambda x: x["capacity"])
        cs = [x["capacity"] for x in sel]
        for key, style, alpha in (("p50", "o-", 1.0), ("p99", "o--", 0.5)):
            ys = [x[f"{key}_ms"] for x in sel]
            label = f"free slot {position}: {key}"
            ax.plot(cs, ys, style, color=color, alpha=alpha, label=label)
    ax.axhline(rtt, color="grey", linestyle=":", label=f"broker round trip p50 ({rtt:.2f} ms)")
    decl = r["floors"].get("exclusive_declare")
    if decl:
        ax.axhline(
            decl["p50_ms"],
            color="#cb181d",
            linestyle="--",
            label=f"floor: exclusive declare p50 ({decl['p50_ms']:.2f} ms)",
        )
    if c1:
        ax.axhline(
            3 * c1[0]["p50_ms"], color="#fd8d3c", linestyle="-.", label="target: 3 x C=1 p50"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("slots C (C-1 held by another connection)")
    ax.set_ylabel("acquire latency (ms, log)")
    ax.set_title("Acquire latency vs number of slots")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_handoff(r: dict[str, Any], path: Path) -> None:
    c = r["contention"]
    xs = sorted(x for x in c["handoff_samples_ms"] if x > 0)
    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    if xs:
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", color="#238b45")
        for q, key in ((0.5, "p50_ms"), (0.99, "p99_ms")):
            v = c["handoff"][key]
            ax.axvline(v, color="grey", linestyle=":")
            ax.text(v, q, f" p{int(q * 100)} {v:.1f} ms", fontsize=8, va="bottom")
        ax.set_xscale("log")
    plan = c["plan"]
    ax.set_xlabel("release -> next grant of the same slot (ms, log)")
    ax.set_ylabel("fraction of handoffs")
    ax.set_title(
        f"Handoff CDF: {plan['processes']} processes, {plan['slots']} slots, "
        f"{c['runs']} x {plan['seconds']:.0f} s"
    )
    ax.grid(which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_fairness(r: dict[str, Any], path: Path) -> None:
    c = r["contention"]
    grants = c["grants_per_process_last_run"]
    fig, ax = plt.subplots(figsize=(7.0, 3.2))
    ax.bar(range(1, len(grants) + 1), grants, color="#6a51a3")
    if grants:
        mean = sum(grants) / len(grants)
        ax.axhline(mean, color="grey", linestyle=":", label=f"mean {mean:.0f}")
        ax.legend()
    ax.set_xlabel("process")
    ax.set_ylabel("grants")
    ax.set_title(f"Grants per process (last run of {c['runs']})")
    ax.set_xticks(range(1, len(grants) + 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- doc


def _search_notes(rows: list[dict[str, Any]], worst: dict[str, Any], best: dict[str, Any]) -> str:
    """Bullets explaining the sweep, chosen by what the data shows (the window policy is
    the library's and changes; the text must follow it)."""
    c = worst["capacity"]
    existing = 2 * c
    sent = worst["probes_sent"]
    slots = ", ".join(str(n // 2) for n in worst.get("windows", []))
    first = (
        f"- **Probes sent.** To reach slot {c} the client sent {sent} probes (windows of "
        f"{slots} slots) to the {existing} `A`/`B` queues that exist. "
    )
    if sent > 1.2 * existing:
        first += (
            "Windows go out whole, so the last one reaches far past the end of the "
            "semaphore; capping windows at the size last seen would send "
            f"{sent / existing:.1f}x fewer probes here."
        )
    else:
        first += "The window policy keeps the probes past the end of the semaphore few."
    cpu = worst["cpu_per_acquire_ms"]
    per_probe = worst.get("holder_cpu_per_held_probe_us")
    if per_probe is not None and per_probe >= 10:
        holders = (
            "- **Held slots cost their holders CPU.** A holder consumes from its `A[k]` and "
            "`B[k]` to notice their deletion, so probes of a held slot are delivered to that "
            f"holder and discarded there: {_f(per_probe, 0)} us of holder CPU per such probe, "
            f"{_f(cpu['holders'], 0)} ms across the holders for one worst-case acquire at "
            f"C = {c}. Searching is not free for the processes that already hold their slot."
        )
    else:
        holders = (
            f"- **Holders are barely touched.** The {worst['held_probes']} probes of held "
            f"slots cost the holders {_f(cpu['holders'], 1)} ms of CPU in all per worst-case "
            f"acquire at C = {c}, although each holder consumes from its `A[k]` and `B[k]`."
        )
    ref = rows[0]
    if best is worst:
        last = "- Only the worst case was measured at this C."
    elif best["probes_sent"] > 4 * ref["probes_sent"]:
        last = (
            f"- **Free slot first.** Even when slot 1 is free, the client sent "
            f"{best['probes_sent']} probes at C = {c} (windows of "
            f"{', '.join(str(n // 2) for n in best.get('windows', []))} slots): its first "
            "window covers the whole semaphore as last seen. One round trip, but "
            f"{_f(best['p50_ms'])} ms at p50 against {_f(ref['p50_ms'])} ms at C = 1."
        )
    else:
        last = (
            f"- **Free slot first.** One window ({best['probes_sent']} probes) finds it "
            f"whatever C is: {_f(best['p50_ms'])} ms at p50 at C = {c}, against "
            f"{_f(ref['p50_ms'])} ms at C = 1."
        )
    return "\n".join([first, holders, last])


def _herd_note(c: dict[str, Any]) -> str:
    """What the searches per grant say about the waiters (one search is the minimum)."""
    per_grant = c.get("probe_round_trips_per_grant")
    if per_grant is None:
        return ""
    text = (
        f"The workers ran {per_grant:.1f} slot searches per grant (with {c['plan']['slots']} "
        "slots a search is one probe round trip). One is the minimum"
    )
    if c["plan"]["hold_ms"] == 0:
        text += ", and with hold time 0 the releaser's immediate next acquire adds about one"
    return text + (
        "; the rest are waiters' searches that found every slot held (woken, or polling on "
        "their back-off) or lost the race for the exclusive declare, which costs a channel "
        "and a random pause of up to 20 ms."
    )


def _code_note(env: dict[str, Any]) -> str:
    if env.get("amqp_locks_from_repo", True):
        return ""
    return (
        f"\n`PYTHONPATH` pointed at an export of the committed `src/` (`git archive HEAD src`, "
        f"git {env['git_commit']}), so uncommitted edits in the working tree were not measured.\n"
    )


def _noise_note(uncontended: dict[str, Any], c1: dict[str, Any]) -> str:
    """The same operation is measured twice per run: their gap is a noise yardstick."""
    a, b = uncontended["p50_ms"], c1["p50_ms"]
    return (
        f"The same operation, an uncontended C=1 acquire, was measured twice in this run, "
        f"minutes apart: {_f(a)} ms and {_f(b)} ms at p50 ({abs(a - b) / min(a, b):.0%} "
        "apart); read smaller differences between rows as noise."
    )


def _overrun_row(o: dict[str, Any] | None, grace: float) -> list[str]:
    label = "last `acquire(timeout=...)` of each worker: returned after its timeout by"
    if not o:
        return [label, "n/a"]
    return [
        label,
        f"p50 {_f(o['p50_ms'], 1)} ms, max {_f(o['max_ms'], 0)} ms; "
        f"{o['over_1s']} of {o['workers']} more than 1 s late, "
        f"{o['never_returned']} not within {grace:.0f} s",
    ]


def _errors_note(errors: list[str], warnings: dict[str, int]) -> str:
    """Say plainly when workers failed or the library warned: those are findings."""
    parts = []
    if errors:
        shown = "\n".join(f"- `{e[:200]}`" for e in errors[:5])
        parts.append(
            f"**{len(errors)} worker(s) failed**; the grants they made before failing are "
            f"counted, nothing after. Errors (time relative to the end of the run):\n\n{shown}"
        )
    else:
        parts.append("No worker failed.")
    if warnings:
        shown = "\n".join(f"| {n} | `{msg}` |" for msg, n in list(warnings.items())[:8])
        parts.append(
            "Warnings logged in the workers (numbers and addresses folded):\n\n"
            f"| count | logger: message |\n|---:|:---|\n{shown}"
        )
    else:
        parts.append("The workers logged no warnings.")
    return "\n\n".join(parts)


def _code_version(env: dict[str, Any]) -> str:
    """Which library code was measured: the repo's src/ (maybe modified) or a snapshot."""
    if not env.get("amqp_locks_from_repo", True):
        where = env.get("amqp_locks_path")
        return f"{env['amqp_locks']} (from `{where}`; repo at git {env['git_commit']})"
    dirty = ", src/ has uncommitted changes" if env["git_dirty"] else ""
    return f"{env['amqp_locks']} (git {env['git_commit']}{dirty})"


# ------------------------------------------------------- token semaphore, lockers

HANDOFF_KINDS = ("token", "token_nofence", "token_quorum", "mutex", "semaphore")
KIND_LABELS = {
    "token": "token semaphore, classic token queue",
    "token_nofence": "token semaphore, classic token queue, fencing=False",
    "token_quorum": "token semaphore, quorum token queue",
    "mutex": "mutex",
    "semaphore": "persistent semaphore, C=1",
}
#: Issue 3's goal: a token handoff within this many broker round trips.
TOKEN_HANDOFF_GOAL_RTT = 3.0


def _plot_handoff_compare(r: dict[str, Any], path: Path) -> None:
    ho, cr = r.get("handoff", {}), r.get("crash", {})
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10.0, 4.0))
    for ax, data, title in (
        (a1, ho, "release -> blocked waiter holds"),
        (a2, cr, "holder kill -9 -> blocked waiter holds"),
    ):
        kinds = [k for k in HANDOFF_KINDS if k in data]
        ys = list(range(len(kinds)))[::-1]
        ax.barh(ys, [data[k]["p99_ms"] for k in kinds], color="#c6dbef", label="p99")
        ax.barh(ys, [data[k]["p50_ms"] for k in kinds], color="#2171b5", label="p50")
        ax.set_yticks(ys, [KIND_LABELS[k].replace(", ", "\n") for k in kinds], fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("ms (log scale)")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", which="both", alpha=0.3)
    a1.axvline(rtt, color="grey", linestyle=":", label=f"RTT p50 {rtt:.2f} ms")
    fl = r["floors"]
    for key, color, text in (
        ("reject_deliver_classic", "#238b45", "floor: reject -> deliver"),
        ("exclusive_declare", "#cb181d", "floor: exclusive declare"),
    ):
        if key in fl:
            v = fl[key]["p50_ms"]
            a1.axvline(v, color=color, linestyle="--", label=f"{text} p50 {v:.2f} ms")
    for ax in (a1, a2):
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _failover_rows(r: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Locker labels in order, and per label {group: stats}."""
    groups = r.get("failover", {}).get("groups", {})
    labels: list[str] = []
    per: dict[str, dict[str, Any]] = {}
    for group, g in groups.items():
        for row in g["rows"]:
            if row["locker"] not in per:
                labels.append(row["locker"])
                per[row["locker"]] = {}
            per[row["locker"]][group] = row
    return labels, per


def _plot_failover(r: dict[str, Any], path: Path) -> None:
    labels, per = _failover_rows(r)
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(labels) + 1.6))
    ys = list(range(len(labels)))[::-1]
    colors = {"tuned": "#238b45", "default": "#cb181d"}
    for off, group in ((0.18, "tuned"), (-0.18, "default")):
        xs, yy = [], []
        for y, label in zip(ys, labels, strict=True):
            s = per[label].get(group)
            if not s or not s.get("n"):
                continue
            ax.barh(y + off, s["p50_ms"] / 1000, height=0.34, color=colors[group], alpha=0.6)
            for x in s["samples_ms"]:
                xs.append(x / 1000)
                yy.append(y + off)
        if xs:
            ax.scatter(
                xs, yy, s=10, color=colors[group], label=f"{group} settings: samples; bar: p50"
            )
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("master kill -9 -> standby is master (s, log scale)")
    ax.set_title("Locker failover")
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _token_values(r: dict[str, Any]) -> dict[str, str]:
    rtt = r["floors"]["broker_round_trip"]
    rtt_ms = rtt["p50_ms"]
    uc, ut = r["uncontended"], r.get("uncontended_tokens", {})
    ho, cr = r.get("handoff", {}), r.get("crash", {})

    def x(v: float) -> str:
        return f"{v / rtt_ms:.1f}x"

    uc_rows = []
    for label, s in (
        ("token semaphore, classic token queue", ut.get("token")),
        ("token semaphore, classic token queue, fencing=False", ut.get("token_nofence")),
        ("token semaphore, quorum token queue", ut.get("token_quorum")),
        ("persistent semaphore, C=1", uc["semaphore_c1"]),
        ("mutex", uc["mutex"]),
    ):
        if s is None:
            continue
        a, rel = s["acquire"], s["release"]
        cpu = s.get("cpu_per_cycle_ms", {})
        uc_rows.append(
            [
                label,
                _f(a["p50_ms"]),
                _f(a["p99_ms"]),
                x(a["p50_ms"]),
                _f(rel["p50_ms"]),
                _f(rel["p99_ms"]),
                f"{_f(cpu.get('client'))} / {_f(cpu.get('broker'))}",
                str(a["n"]),
            ]
        )
    token_uc_table = _table(
        [
            "lock",
            "acquire p50 ms",
            "acquire p99 ms",
            "acquire p50 / RTT",
            "release p50 ms",
            "release p99 ms",
            "CPU ms per cycle client / broker",
            "n",
        ],
        uc_rows,
    )
    ho_rows = [
        [
            KIND_LABELS[k],
            _f(ho[k]["p50_ms"]),
            _f(ho[k]["p99_ms"]),
            x(ho[k]["p50_ms"]),
            x(ho[k]["p99_ms"]),
            _f(ho[k].get("release_call_p50_ms")),
            f"{ho[k]['n']} ({ho[k]['reps']} reps)",
        ]
        for k in HANDOFF_KINDS
        if k in ho
    ]
    ho_rows.insert(
        0,
        [
            "broker round trip (RTT), same run",
            _f(rtt_ms, 3),
            _f(rtt["p99_ms"], 3),
            "1.0x",
            x(rtt["p99_ms"]),
            "",
            f"{rtt['n']}",
        ],
    )
    handoff_table = _table(
        ["lock", "p50 ms", "p99 ms", "p50 / RTT", "p99 / RTT", "`release()` call p50 ms", "n"],
        ho_rows,
    )
    cr_rows = [
        [
            KIND_LABELS[k],
            _f(cr[k]["p50_ms"], 1),
            _f(cr[k]["p99_ms"], 1),
            _f(cr[k].get("min_ms"), 1),
            _f(cr[k].get("max_ms"), 1),
            str(cr[k]["n"]),
            str(len(cr[k].get("errors", []))),
        ]
        for k in HANDOFF_KINDS
        if k in cr
    ]
    crash_table = _table(["lock", "p50 ms", "p99 ms", "min ms", "max ms", "n", "errors"], cr_rows)
    crash_errors = [f"{k}: {e}" for k in cr for e in cr[k].get("errors", [])]
    # Issue 3's goal, judged from the measurement.
    goal = []
    for k in ("token", "token_nofence", "token_quorum"):
        if k not in ho:
            continue
        ratio = ho[k]["p50_ms"] / rtt_ms
        ratio99 = ho[k]["p99_ms"] / rtt_ms
        met = "**met**" if ratio <= TOKEN_HANDOFF_GOAL_RTT else "**not met**"
        goal.append(
            f"- {KIND_LABELS[k]}: p50 {_f(ho[k]['p50_ms'])} ms = {ratio:.1f} x RTT, p99 "
            f"{_f(ho[k]['p99_ms'])} ms = {ratio99:.1f} x RTT: goal (p50 within "
            f"{TOKEN_HANDOFF_GOAL_RTT:.0f} x RTT) {met}."
        )
    plan = r.get("handoff_plan", {})
    crash_note = ""
    if {"token", "mutex"} <= cr.keys():
        t, m = cr["token"]["p50_ms"], cr["mutex"]["p50_ms"]
        crash_note = (
            f"After a crash the token semaphore hands over in {_f(t, 1)} ms at p50, the mutex "
            f"in {_f(m, 1)} ms"
        )
        if "semaphore" in cr:
            crash_note += f" and the persistent semaphore in {_f(cr['semaphore']['p50_ms'], 1)} ms"
        crash_note += f"; the mutex takes {_f(m / t if t else math.nan, 0)}x as long. "
        if m > 100:
            crash_note += (
                "A crashed holder publishes no release notice: the broker deletes its "
                "exclusive queue when the connection drops, but a mutex or persistent-"
                "semaphore waiter only finds out on its next fallback poll (back-off from "
                "50 ms doubling to 1 s), so the crash handoff is spread over that back-off. "
                "The token semaphore needs no poll: the broker requeues the unacked token "
                "when the connection closes and pushes it to the waiting consumer."
            )
    if crash_errors:
        crash_note += "\n\nErrors:\n\n" + "\n".join(f"- `{e[:200]}`" for e in crash_errors)
    handoff_note = ""
    if {"token", "token_quorum", "mutex"} <= ho.keys():
        fence = next(
            (v for k, v in r.get("primitives", {}).items() if k.startswith("fencing token")), None
        )
        tq, tc = ho["token_quorum"], ho["token"]
        handoff_note = (
            f"A token `release()` call takes {_f(tc.get('release_call_p50_ms'))} ms "
            f"(classic) / {_f(tq.get('release_call_p50_ms'))} ms (quorum) at p50: it cancels "
            "its consumer and waits for the broker's answer (so the token cannot be "
            "redelivered to itself), then rejects the token with requeue, and the broker "
            "pushes it to the waiting consumer. The waiter on a classic token queue then "
            "takes a fencing token from the lock's quorum fence queue"
        )
        if fence is not None:
            handoff_note += f" ({_f(fence['p50_ms'])} ms at p50 on its own in this run)"
        handoff_note += (
            "; on a quorum token queue the fencing token is the message's delivery count, "
            f"with no extra round trip. Classic {_f(tc['p50_ms'])} ms vs quorum "
            f"{_f(tq['p50_ms'])} ms at p50. A mutex or persistent-semaphore waiter is woken "
            "by a release notice and then runs a whole acquire (declare of the exclusive "
            f"queue, watch channel, fencing token): {_f(ho['mutex']['p50_ms'])} ms for the "
            "mutex"
        )
        if "semaphore" in ho:
            handoff_note += f", {_f(ho['semaphore']['p50_ms'])} ms for the semaphore"
        handoff_note += "."
    values = {
        "handoff_note": handoff_note,
        "token_uc_table": token_uc_table,
        "handoff_cmp_table": handoff_table,
        "crash_table": crash_table,
        "token_goal": "\n".join(goal) or "- not measured",
        "crash_note": crash_note,
        "ho_settle_ms": f"{plan.get('settle', math.nan) * 1000:.0f}",
        "crash_settle": (
            f"{plan['crash_settle'][0]:.1f}-{plan['crash_settle'][1]:.1f}"
            if "crash_settle" in plan
            else "n/a"
        ),
    }
    return values


def _token_headline(r: dict[str, Any], head: Callable[..., list[str]]) -> list[list[str]]:
    ut, ho, cr = r.get("uncontended_tokens", {}), r.get("handoff", {}), r.get("crash", {})
    rows = []
    for k in ("token", "token_quorum"):
        if k in ut:
            rows.append(head(f"{KIND_LABELS[k]}: acquire, uncontended", ut[k]["acquire"]))
    for k in HANDOFF_KINDS:
        if k in ho:
            rows.append(head(f"handoff release -> blocked waiter, {KIND_LABELS[k]}", ho[k]))
    for k in HANDOFF_KINDS:
        if k in cr:
            rows.append(head(f"holder kill -9 -> blocked waiter holds, {KIND_LABELS[k]}", cr[k]))
    return rows


def _failover_headline(r: dict[str, Any]) -> str:
    labels, per = _failover_rows(r)
    groups = list(r.get("failover", {}).get("groups", {}))
    if not labels:
        return "Locker failover was not measured."
    rows = []
    for label in labels:
        row = [label]
        for g in groups:
            s = per[label].get(g)
            row.append(
                f"{_f(s['p50_ms'] / 1000)} / {_f(s['max_ms'] / 1000)}"
                if s and s.get("n")
                else "n/a"
            )
        rows.append(row)
    return _table(
        ["locker: failover (kill -9 -> standby is master), s"]
        + [f"{g} settings: p50 / max" for g in groups],
        rows,
    )


def _failover_values(r: dict[str, Any]) -> dict[str, str]:
    fo = r.get("failover", {})
    labels, per = _failover_rows(r)
    groups = list(fo.get("groups", {}))
    header = ["locker"]
    for g in groups:
        header += [f"{g}: p50 s", f"{g}: p99 s", f"{g}: min-max s", f"{g}: n"]
    rows = []
    errors = []
    for label in labels:
        row = [label]
        for g in groups:
            s = per[label].get(g)
            if not s or not s.get("n"):
                row += ["n/a", "n/a", "n/a", "0"]
            else:
                row += [
                    _f(s["p50_ms"] / 1000),
                    _f(s["p99_ms"] / 1000),
                    f"{_f(s['min_ms'] / 1000)}-{_f(s['max_ms'] / 1000)}",
                    str(s["n"]),
                ]
            errors += [f"{label} ({g}): {e}" for e in (s or {}).get("errors", [])]
        rows.append(row)
    table = _table(header, rows)
    settings = fo.get("settings", {})

    def describe(st: dict[str, Any]) -> str:
        lease = st.get("lease")
        return (
            f"`lock_acquire_sleep_interval` {st['interval']:g} s, lease "
            f"{'= interval' if lease is None else f'{lease:g} s'}, keep-alive period "
            f"{st['keep_alive']:g} s ({st['lease_keep_alive']:g} s for the lease locker)"
        )

    notes = list(fo.get("notes", []))
    walls = f"{fo['wall_s']:.0f} s" if "wall_s" in fo else "n/a"
    return {
        "failover_table": table,
        "failover_default": describe(settings["default"]) if "default" in settings else "n/a",
        "failover_tuned": describe(settings["tuned"]) if "tuned" in settings else "n/a",
        "failover_notes": "\n".join(f"- {n}" for n in notes) or "- all lockers measured",
        "failover_errors": (
            "Errors:\n\n" + "\n".join(f"- `{e[:240]}`" for e in errors)
            if errors
            else "No failover sample failed."
        ),
        "failover_busy": f"{fo.get('busy_cores', 'n/a')}",
        "failover_own": f"{fo.get('own_cores', 'n/a')}",
        "failover_walls": walls or "n/a",
        "failover_dbs": ", ".join(fo.get("databases", [])) or "none",
    }


def _values(r: dict[str, Any], img_rel: str) -> dict[str, str]:
    env, fl, uc, c = r["environment"], r["floors"], r["uncontended"], r["contention"]
    rtt = fl["broker_round_trip"]
    loop = fl["loopback_tcp"]
    rmq = env["rabbitmq"]
    machine = _table(
        ["", ""],
        [
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
        ],
        numeric=False,
    )

    def row(label: str, s: dict[str, Any], x_rtt: bool = True) -> list[str]:
        ratio = [f"{s['p50_ms'] / rtt['p50_ms']:.1f}x", f"{s['p99_ms'] / rtt['p50_ms']:.1f}x"]
        return [
            label,
            _f(s["p50_ms"], 3),
            _f(s["p99_ms"], 3),
            *(ratio if x_rtt else ["", ""]),
            f"{s['n']} ({s['reps']} reps)",
        ]

    header = ["operation", "p50 ms", "p99 ms", "p50 / RTT", "p99 / RTT", "samples"]
    floors_table = _table(
        header,
        [
            row("loopback TCP round trip (Python, 2 processes)", loop),
            row("broker round trip (`Broker.round_trip()`)", rtt),
            *[
                row(f"raw aiormq: {fl[key]['label']}", fl[key])
                for key in report_headline.headline_floors()
                if key in fl
            ],
            row("semaphore C=1: `acquire()`", uc["semaphore_c1"]["acquire"]),
            row("semaphore C=1: `release()`", uc["semaphore_c1"]["release"]),
            row("mutex: `acquire()`", uc["mutex"]["acquire"]),
            row("mutex: `release()`", uc["mutex"]["release"]),
        ],
    )
    prim_table = _table(
        ["step", "p50 ms", "p99 ms", "p50 / RTT"],
        [
            [label, _f(p["p50_ms"], 3), _f(p["p99_ms"], 3), f"{p['p50_x_rtt']}x"]
            for label, p in r.get("primitives", {}).items()
        ],
    )
    cpu_uc = uc["semaphore_c1"]["cpu_per_cycle_ms"]
    cpu_mx = uc["mutex"]["cpu_per_cycle_ms"]

    search_rows = []
    for s in r["search"]:
        cpu = s["cpu_per_acquire_ms"]
        search_rows.append(
            [
                str(s["capacity"]),
                f"{s['free_slot']} ({s['slot']})",
                _f(s["p50_ms"]),
                _f(s["p99_ms"]),
                f"{s['p50_x_c1']}x",
                f"{s['p99_x_c1']}x",
                f"{s['p50_x_rtt']}x",
                str(s["probes_sent"]),
                f"{_f(cpu['client'])} / {_f(cpu['broker'])} / {_f(cpu['holders'])}",
                _f(s.get("marginal_cpu_per_probe_us"), 0),
                _f(s.get("holder_cpu_per_held_probe_us"), 0),
                f"{s['n']} ({s['reps']})",
            ]
        )
    search_table = _table(
        [
            "C",
            "free slot",
            "p50 ms",
            "p99 ms",
            "p50 / C=1",
            "p99 / C=1",
            "p50 / RTT",
            "probes sent",
            "CPU ms client / broker / holders",
            "client + broker CPU us per extra probe",
            "holders CPU us per held-slot probe",
            "n (reps)",
        ],
        search_rows,
    )
    worst = max(r["search"], key=lambda s: s["capacity"] * (s["free_slot"] == "last"))
    g = c["grants_per_process"]
    plan = c["plan"]
    contention_table = _table(
        ["metric", "value"],
        [
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
            [
                "handoff p50 / p99 (ms)",
                f"{_f(c['handoff']['p50_ms'])} / {_f(c['handoff']['p99_ms'])}",
            ],
            ["handoff p50 / broker round trip", f"{c['handoff']['p50_ms'] / rtt['p50_ms']:.1f}x"],
            ["handoffs measured", str(c["handoff"]["n"])],
            _overrun_row(c.get("timeout_overrun"), plan.get("grace_s", 15.0)),
            [
                "worker errors (listed below the table)",
                str(len(c.get("worker_errors", []))),
            ],
            [
                "slot searches (probe round trips) per grant, all workers",
                _f(c.get("probe_round_trips_per_grant"), 1),
            ],
            [
                "CPU per grant: all workers / broker (ms)",
                f"{_f(c['cpu_per_grant_ms']['workers'])} / {_f(c['cpu_per_grant_ms']['broker'])}",
            ],
            [
                "share of handoffs won by the releasing process itself",
                f"{c['handoff_to_releaser_share']:.0%}",
            ],
        ],
    )
    sem_acq = uc["semaphore_c1"]["acquire"]
    mx_acq = uc["mutex"]["acquire"]
    worst_cpu = worst["cpu_per_acquire_ms"]
    same_c = [s for s in r["search"] if s["capacity"] == worst["capacity"]]
    best = next((s for s in same_c if s["free_slot"] == "first"), worst)

    def head(label: str, s: dict[str, Any]) -> list[str]:
        return [label, _f(s["p50_ms"]), _f(s["p99_ms"]), f"{s['p50_ms'] / rtt['p50_ms']:.1f}x"]

    headline = _table(
        ["measurement", "p50 ms", "p99 ms", "p50 / RTT"],
        [
            head("broker round trip (RTT)", rtt),
            head("semaphore acquire, C=1, uncontended", sem_acq),
            head("semaphore release", uc["semaphore_c1"]["release"]),
            head("mutex acquire, uncontended", mx_acq),
            head(f"semaphore acquire, C={worst['capacity']}, only the last slot free", worst),
            head(f"semaphore acquire, C={best['capacity']}, only the first slot free", best),
            head(
                f"handoff release -> next grant, {plan['processes']} processes / "
                f"{plan['slots']} slots",
                c["handoff"],
            ),
            [
                f"throughput, {plan['processes']} processes / {plan['slots']} slots",
                f"{c['acquisitions_per_s']:.0f} acquisitions/s",
                "",
                "",
            ],
            *_token_headline(r, head),
        ],
    )
    cycle_cpu = cpu_uc["client"] + cpu_uc["broker"]
    grant_cpu = (c["cpu_per_grant_ms"]["workers"] or 0) + (c["cpu_per_grant_ms"]["broker"] or 0)
    other = env.get("other_load_cores")
    busy_note = (
        f"\n**The machine was busy**: other work on the machine kept "
        f"{other} cores of {env['nproc']} busy on average during this run (load average "
        f"{env['loadavg_before']} before, {env.get('loadavg_after')} after). Every figure "
        "includes that contention; p99s most of all.\n"
        if isinstance(other, (int, float)) and other >= 0.2
        else ""
    )
    return {
        "busy_note": busy_note,
        "json_path": str(r.get("json_path", "benchmarks/results/latest.json")),
        "headline_table": headline,
        "failover_headline": _failover_headline(r),
        "holders_kind": r.get("search_holders", "leases"),
        "nproc": str(env["nproc"]),
        "handoff_x_rtt": f"{c['handoff']['p50_ms'] / rtt['p50_ms']:.0f}",
        "grant_cpu": _f(grant_cpu, 1),
        "cycle_cpu": _f(cycle_cpu, 1),
        "herd_ratio": f"{grant_cpu / cycle_cpu:.1f}" if cycle_cpu else "n/a",
        "herd_note": _herd_note(c),
        "code_note": _code_note(env),
        "noise_note": _noise_note(sem_acq, r["search"][0]),
        "cpu_bound_rate": f"{env['nproc'] * 1000 / grant_cpu:.0f}" if grant_cpu else "n/a",
        "command": env["command"],
        "machine_table": machine,
        "floors_table": floors_table,
        "prim_table": prim_table,
        "search_table": search_table,
        "contention_table": contention_table,
        "img_floors": f"{img_rel}/{PLOTS['floors']}",
        "img_search": f"{img_rel}/{PLOTS['search']}",
        "img_handoff": f"{img_rel}/{PLOTS['handoff']}",
        "img_fairness": f"{img_rel}/{PLOTS['fairness']}",
        "img_handoff_compare": f"{img_rel}/{PLOTS['handoff_compare']}",
        "img_failover": f"{img_rel}/{PLOTS['failover']}",
        **_token_values(r),
        **_failover_values(r),
        "rtt_p50": _f(rtt["p50_ms"], 3),
        "rtt_p99": _f(rtt["p99_ms"], 3),
        "loop_p50": _f(loop["p50_ms"], 3),
        "rtt_x_loop": f"{rtt['p50_ms'] / loop['p50_ms']:.1f}",
        "sem_acq_p50": _f(sem_acq["p50_ms"]),
        "sem_acq_x": f"{sem_acq['p50_x_rtt']}",
        "sem_rel_p50": _f(uc["semaphore_c1"]["release"]["p50_ms"]),
        "sem_rel_x": f"{uc['semaphore_c1']['release']['p50_x_rtt']}",
        "mx_acq_p50": _f(mx_acq["p50_ms"]),
        "mx_acq_x": f"{mx_acq['p50_x_rtt']}",
        "sem_cycle_cpu": f"{_f(cpu_uc['client'])} ms client + {_f(cpu_uc['broker'])} ms broker",
        "mx_cycle_cpu": f"{_f(cpu_mx['client'])} ms client + {_f(cpu_mx['broker'])} ms broker",
        "worst_c": str(worst["capacity"]),
        "worst_p50": _f(worst["p50_ms"], 1),
        "worst_x_c1": f"{worst['p50_x_c1']}",
        "worst_probes": str(worst["probes_sent"]),
        "worst_rts": _f(worst.get("probe_round_trips"), 0),
        "search_notes": _search_notes(r["search"], worst, best),
        "errors_note": _errors_note(c.get("worker_errors", []), c.get("worker_warnings", {})),
        "worst_cpu_probe": _f(worst.get("marginal_cpu_per_probe_us"), 0),
        "worst_client_share": _pct(worst_cpu["client"], worst_cpu["client"] + worst_cpu["broker"]),
        "worst_holders_ms": _f(worst_cpu["holders"], 0),
        "worst_holder_probe": _f(worst.get("holder_cpu_per_held_probe_us"), 0),
        "broker_cycle_cpu": _f(cpu_uc["broker"], 1),
        "broker_ceiling": f"{env['nproc'] * 1000 / cpu_uc['broker']:.0f}"
        if cpu_uc["broker"]
        else "n/a",
        "procs": str(plan["processes"]),
        "slots": str(plan["slots"]),
        "seconds": f"{plan['seconds']:.0f}",
        "runs": str(c["runs"]),
        "rate": f"{c['acquisitions_per_s']:.0f}",
        "handoff_p50": _f(c["handoff"]["p50_ms"]),
        "handoff_p99": _f(c["handoff"]["p99_ms"]),
        "self_share": f"{c['handoff_to_releaser_share']:.0%}",
        "contenders": str(plan["processes"] - plan["slots"] + 1),
        "fair_share": f"{1 / (plan['processes'] - plan['slots'] + 1):.0%}",
        "jain": f"{g['jain']:.3f}",
    }


def render(
    results: dict[str, Any],
    doc: Path,
    img_dir: Path,
    also: list[dict[str, Any]] | None = None,
) -> None:
    """Write the PNGs into ``img_dir`` and the markdown report to ``doc``; ``also``: results
    of other RabbitMQ lines whose floors/targets tables the report shows too."""
    img_dir.mkdir(parents=True, exist_ok=True)
    doc.parent.mkdir(parents=True, exist_ok=True)
    _plot_floors(results, img_dir / PLOTS["floors"])
    _plot_search(results, img_dir / PLOTS["search"])
    _plot_handoff(results, img_dir / PLOTS["handoff"])
    _plot_fairness(results, img_dir / PLOTS["fairness"])
    _plot_handoff_compare(results, img_dir / PLOTS["handoff_compare"])
    _plot_failover(results, img_dir / PLOTS["failover"])
    img_rel = Path(os.path.relpath(img_dir, doc.parent)).as_posix()
    values = _values(results, img_rel)
    values.update(report_compare.render(results, img_dir, img_rel))
    values.update(report_headline.render(results, also or [], img_dir, img_rel))
    text = string.Template(TEMPLATE.read_text()).substitute(values)
    if results.get("quick"):
        text = "> **Smoke run (`--quick`)**: few samples; not the published figures.\n\n" + text
    doc.write_text(text)
