"""Issue 12's headline figures: ours against the broker's floor, measured in the same run.

Most of "ours" is measured elsewhere and only read here (``targets``): uncontended acquires
(``latency.uncontended``, ``handoff.uncontended_tokens``), release -> blocked waiter handoffs
(``handoff.handoff``), the acquire at C = max with only the last slot free
(``latency.search_sweep``) and the head-to-head figures (``compare``). Two measurements are
new and live here:

- **Re-ask handoff** (``reask``): two processes, one permit. The holder is told to release
  and ask again at once (``release_acquire``) while the other has been blocked in
  ``acquire()`` for ``settle`` seconds. Timed from just before ``release()`` to whichever
  ``acquire()`` returns first (CLOCK_MONOTONIC, one clock for all processes); the report
  counts how often the releaser won its lock back over the waiting process.
- **Fairness loop** (``fairness``): ``processes`` processes loop acquire -> hold ``hold``
  s -> release -> acquire on one permit for ``seconds`` s. Per primitive: Jain's index
  over grants per process, and every wait (``acquire()`` called -> returned) against the
  median wait.

The floors (``floors.raw_floors``) are raw aiormq, no library code, on the same broker.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_pipes
from typing import Any

from amqp_locks import Broker

from .handoff import _lock, _make, _start_procs, context
from .stats import fairness as jain_fairness
from .stats import ms, summarize_reps

#: Kinds of the re-ask handoff and the fairness loop, in report order.
REASK_KINDS = ("token", "token_nofence", "mutex", "semaphore")
FAIR_KINDS = ("token", "token_nofence", "mutex", "semaphore")
LABELS = {
    "token": "token semaphore (fencing on)",
    "token_nofence": "token semaphore, `fencing=False`",
    "token_quorum": "token semaphore, quorum token queue",
    "mutex": "mutex",
    "semaphore": "persistent semaphore, C=1",
}

#: Grants/s of 16 processes on 4 slots before issue 12 (benchmarks/results/latest.json of
#: 2026-11-22, RabbitMQ 3.10.8, library at git aa24dac), the base of the 5x target.
THROUGHPUT_BASELINE = {"ours_token": 195.0, "ours_semaphore": 48.2}
THROUGHPUT_TARGET_X = 5.0
#: Fairness targets: Jain's index at least this, no wait longer than this x the median.
JAIN_TARGET = 0.98
WAIT_RATIO_TARGET = 3.0


@dataclass
class Plan:
    reask_reps: int
    reask_samples: int
    reask_warmup: int
    settle: float  # seconds the waiter is blocked before the holder releases
    fair_processes: int = 4
    fair_hold: float = 0.005
    fair_seconds: float = 10.0
    fair_grace: float = 10.0


# ------------------------------------------------------------------ re-ask handoff


def _reask_one(ctx: Any, url: str, broker: Broker, kind: str, plan: Plan) -> dict[str, Any]:
    reps: list[list[float]] = []
    to_waiter: list[float] = []
    to_releaser: list[float] = []
    wins = total = 0
    with _lock(broker, kind) as name:
        procs = _start_procs(ctx, url, kind, name, 2)
        try:
            procs[0].send("acquire")
            procs[0].expect("acquiring")
            procs[0].expect("acquired")
            holder, waiter = procs
            waiter.send("acquire")
            waiter.expect("acquiring")
            for rep in range(plan.reask_reps):
                samples: list[float] = []
                count = plan.reask_samples + (plan.reask_warmup if rep == 0 else 0)
                for i in range(count):
                    time.sleep(plan.settle)  # the waiter is blocked in acquire()
                    holder.send("release_acquire")
                    _, t_rel, _ = holder.expect("released")
                    ready = wait_pipes([holder.pipe, waiter.pipe], 120)
                    if not ready:
                        raise RuntimeError(f"{kind}: nobody acquired within 120 s of a release")
                    winner = holder if holder.pipe in ready else waiter
                    _, t_acq, _token = winner.expect("acquired")
                    if rep > 0 or i >= plan.reask_warmup:
                        samples.append(t_acq - t_rel)
                        total += 1
                        if winner is holder:
                            wins += 1
                            to_releaser.append(t_acq - t_rel)
                        else:
                            to_waiter.append(t_acq - t_rel)
                    if winner is waiter:  # the releaser is now the one blocked
                        holder, waiter = waiter, holder
                reps.append(samples)
            holder.send("release")
            holder.expect("released")
            waiter.expect("acquired", 120)
            waiter.send("release")
            waiter.expect("released")
        finally:
            for p in procs:
                p.stop()
    s = summarize_reps(reps)
    s["samples_ms"] = [ms(x) for r in reps for x in r]
    s["releaser_won"] = wins
    s["handoffs"] = total
    s["to_waiter"] = summarize_reps([to_waiter])
    s["to_releaser"] = summarize_reps([to_releaser])
    return s


def reask(url: str, plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    """Release and ask again at once while another process waits, per lock kind."""
    ctx = context()
    out: dict[str, Any] = {}
    with Broker(url) as broker:
        for kind in REASK_KINDS:
            s = _reask_one(ctx, url, broker, kind, plan)
            out[kind] = s
            log(
                f"  re-ask handoff {kind}: p50={s['p50_ms']:.2f} ms p99={s['p99_ms']:.2f} ms; "
                f"the releaser won {s['releaser_won']} of {s['handoffs']}"
            )
    return out


# ------------------------------------------------------------------- fairness loop


def _fair_worker(
    idx: int,
    url: str,
    kind: str,
    name: str,
    plan: Plan,
    ready: Any,
    go: Any,
    start_at: Any,
    results: Any,
) -> None:
    """Loop acquire -> hold -> release -> acquire until the end of the run; report every
    (acquire called, acquire returned) pair on CLOCK_MONOTONIC."""
    logging.getLogger("aiormq.channel").setLevel(logging.ERROR)
    waits: list[tuple[float, float]] = []
    error: str | None = None
    broker = Broker(url, connection_name=f"amqp-locks bench fairness {kind} {idx}")
    try:
        broker.connect()
        lock = _make(broker, kind, name)
        lease = lock.acquire(timeout=60)  # warm-up: fence check, pooled channels
        if lease is not None:
            lease.release()
        ready.put(idx)
        if not go.wait(120):
            raise RuntimeError("never told to start")
        deadline = start_at.value + plan.fair_seconds
        while (remaining := deadline - time.monotonic()) > 0:
            t0 = time.monotonic()
            lease = lock.acquire(timeout=remaining)
            t1 = time.monotonic()
            if lease is None:
                break
            waits.append((t0, t1))
            time.sleep(plan.fair_hold)
            lease.release()
    except BaseException as exc:
        error = repr(exc)
    finally:
        results.put((idx, waits, error))
        broker.close()


def fairness_summary(per_process: list[list[tuple[float, float]]]) -> dict[str, Any]:
    """Jain's index over grants per process; waits (ms) and the max over the median."""
    grants = [len(w) for w in per_process]
    waits = [t1 - t0 for w in per_process for t0, t1 in w]
    med = statistics.median(waits) if waits else math.nan
    worst = max(waits) if waits else math.nan
    # Where the longest waits were: how many exceed the target's bound, and when the
    # worst began (seconds into the run), to tell a start-up effect from a stall.
    starts = [t0 for w in per_process for t0, _ in w]
    bound = WAIT_RATIO_TARGET * med
    worst_at = next((t0 for w in per_process for t0, t1 in w if t1 - t0 == worst), None)
    return {
        "grants": grants,
        **jain_fairness(grants),
        "wait_p50_ms": ms(med) if waits else None,
        "wait_max_ms": ms(worst) if waits else None,
        "wait_max_over_median": round(worst / med, 2) if waits and med > 0 else None,
        "waits_over_bound": sum(1 for w in waits if w > bound) if waits else None,
        "wait_max_at_s": (
            round(worst_at - min(starts), 3) if waits and worst_at is not None else None
        ),
        "waits": summarize_reps([waits]),
    }


def _fair_one(ctx: Any, url: str, broker: Broker, kind: str, plan: Plan) -> dict[str, Any]:
    with _lock(broker, kind) as name:
        ready, results = ctx.Queue(), ctx.Queue()
        go = ctx.Event()
        start_at = ctx.Value("d", 0.0)
        procs = [
            ctx.Process(
                target=_fair_worker,
                args=(i, url, kind, name, plan, ready, go, start_at, results),
                daemon=True,
            )
            for i in range(plan.fair_processes)
        ]
        for p in procs:
            p.start()
        per: dict[int, list[tuple[float, float]]] = {}
        errors: list[str] = []
        try:
            for _ in procs:
                ready.get(timeout=120)
            start_at.value = time.monotonic() + 0.05
            go.set()
            end = start_at.value + plan.fair_seconds + plan.fair_grace
            while len(per) < len(procs) and time.monotonic() < end:
                try:
                    idx, waits, error = results.get(timeout=0.5)
                except queue.Empty:
                    continue
                per[idx] = waits
                if error:
                    errors.append(f"worker {idx}: {error}")
            for idx in set(range(len(procs))) - per.keys():
                errors.append(f"worker {idx}: no report {plan.fair_grace:.0f} s after the end")
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    with contextlib.suppress(OSError):
                        os.kill(p.pid or 0, 9)
                    p.join(5)
    s = fairness_summary([per.get(i, []) for i in range(len(procs))])
    s["errors"] = errors
    s["grants_per_s"] = round(sum(s["grants"]) / plan.fair_seconds, 1)
    return s


def fairness(url: str, plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    """The fairness loop per primitive (one permit)."""
    ctx = context()
    out: dict[str, Any] = {}
    with Broker(url) as broker:
        for kind in FAIR_KINDS:
            s = _fair_one(ctx, url, broker, kind, plan)
            out[kind] = s
            log(
                f"  fairness {kind}: grants {s['grants']} Jain {s['jain']}, wait p50 "
                f"{s['wait_p50_ms']} ms max {s['wait_max_ms']} ms "
                f"({s['wait_max_over_median']}x, {s['waits_over_bound']} waits over "
                f"{WAIT_RATIO_TARGET:g}x the median, the longest {s['wait_max_at_s']} s into "
                f"the run), errors {len(s['errors'])}"
            )
    return out


# -------------------------------------------------------------------------- targets


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _row(
    group: str,
    label: str,
    floor_label: str,
    floor: float | None,
    ours: float | None,
    target: float | None,
    target_text: str,
    note: str = "",
    sequence: float | None = None,
) -> dict[str, Any]:
    """One line of the table: ours / floor against a target ratio (None: information).
    `sequence`: the raw-aiormq floor of the same broker steps as ours, where measured
    (information: the reason a ratio to the single operation cannot reach its target)."""
    ratio = ours / floor if ours is not None and floor else None
    met = None if target is None or ratio is None else ratio <= target
    seq_ratio = ours / sequence if ours is not None and sequence else None
    return {
        "sequence_ms": sequence,
        "sequence_ratio": None if seq_ratio is None else round(seq_ratio, 2),
        "group": group,
        "label": label,
        "floor_label": floor_label,
        "floor_ms": floor,
        "ours_ms": ours,
        "ratio": None if ratio is None else round(ratio, 2),
        "target": target_text,
        "met": met,
        "note": note,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets judged from one results file (pure: reads the JSON only).

    Every row: floor and ours p50 (ms), ratio, the target as text, and ``met`` (True /
    False, None when not measured or information only)."""
    fl = r.get("floors", {})

    def f50(key: str) -> float | None:
        v = _get(fl, key, "p50_ms")
        return float(v) if isinstance(v, (int, float)) else None

    def spread(key: str) -> list[float] | None:
        """The floor's p50 per repetition, lowest and highest: a floor that moved during
        its own measurement says how far a ratio to it can be trusted."""
        reps = _get(fl, key, "p50_reps_ms")
        return [min(reps), max(reps)] if isinstance(reps, list) and len(reps) > 1 else None

    get_c, get_q = f50("get_classic"), f50("get_quorum")
    rd_c, rd_q = f50("reject_deliver_classic"), f50("reject_deliver_quorum")
    decl = f50("exclusive_declare")
    cycle, mutex_seq = f50("token_cycle"), f50("mutex_handoff")
    tx_handoff = f50("token_handoff_tx")
    ut, uc = r.get("uncontended_tokens", {}), r.get("uncontended", {})
    ho, ra = r.get("handoff", {}), r.get("reask", {})
    fget, frd, fdecl = "`basic.get`", "reject -> deliver", "exclusive declare"
    rows = [
        _row(
            "token",
            "token semaphore (fencing on): uncontended acquire",
            fget,
            get_c,
            _get(ut, "token", "acquire", "p50_ms"),
            2.0,
            "<= 2x",
            sequence=cycle,
        ),
        _row(
            "token",
            "token semaphore (fencing on): handoff release -> blocked waiter holds",
            frd,
            rd_c,
            _get(ho, "token", "p50_ms"),
            2.0,
            "<= 2x",
            sequence=tx_handoff,
        ),
        _row(
            "token",
            "token semaphore, `fencing=False`: uncontended acquire",
            fget,
            get_c,
            _get(ut, "token_nofence", "acquire", "p50_ms"),
            1.5,
            "<= 1.5x",
            sequence=cycle,
        ),
        _row(
            "token",
            "token semaphore, `fencing=False`: handoff",
            frd,
            rd_c,
            _get(ho, "token_nofence", "p50_ms"),
            1.5,
            "<= 1.5x",
        ),
        _row(
            "token",
            "token semaphore, quorum token queue: uncontended acquire",
            f"{fget} (quorum)",
            get_q,
            _get(ut, "token_quorum", "acquire", "p50_ms"),
            None,
            "(information)",
        ),
        _row(
            "token",
            "token semaphore, quorum token queue: handoff",
            f"{frd} (quorum)",
            rd_q,
            _get(ho, "token_quorum", "p50_ms"),
            None,
            "(information)",
        ),
    ]
    for kind, what in (("mutex", "mutex"), ("semaphore", "persistent semaphore, C=1")):
        acq = (
            _get(uc, "mutex", "acquire", "p50_ms")
            if kind == "mutex"
            else _get(uc, "semaphore_c1", "acquire", "p50_ms")
        )
        rows.append(_row(kind, f"{what}: uncontended acquire", fdecl, decl, acq, 2.0, "<= 2x"))
        s = ra.get(kind)
        note = (
            f"the releaser won it back {s['releaser_won']} times in {s['handoffs']}"
            if s and s.get("handoffs")
            else ""
        )
        rows.append(
            _row(
                kind,
                f"{what}: handoff, releaser asking again at once",
                fdecl,
                decl,
                _get(s, "p50_ms"),
                3.0,
                "<= 3x",
                note,
                sequence=mutex_seq if kind == "mutex" else None,
            )
        )
    keys = {fget: "get_classic", frd: "reject_deliver_classic", fdecl: "exclusive_declare"}
    keys |= {f"{fget} (quorum)": "get_quorum", f"{frd} (quorum)": "reject_deliver_quorum"}
    for row in rows:
        key = keys.get(row["floor_label"])
        row["floor_reps_ms"] = spread(key) if key else None
    search = r.get("search") or []
    c1 = next((x for x in search if x["capacity"] == 1), None)
    last = [x for x in search if x.get("free_slot") == "last" and x["capacity"] > 1]
    worst = max(last, key=lambda x: x["capacity"]) if last else None
    if worst is not None:
        full = worst["capacity"] >= 1000
        row = _row(
            "semaphore",
            f"persistent semaphore, C={worst['capacity']}, only the last slot free: acquire",
            "its C=1 acquire",
            _get(c1, "p50_ms"),
            worst["p50_ms"],
            3.0,
            "<= 3x",
            "" if full else "smaller C than the target's 1000, not judged",
        )
        if not full:
            row["met"] = None
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

    handoffs = peers.get("handoff", {})
    waiters = sorted(handoffs.get("ours_token", {}), key=int)
    if waiters:
        n = waiters[0]
        rows.append(
            _row(
                "head to head",
                f"token handoff, {n} waiters",
                "PostgreSQL `pg_advisory_lock`",
                p50(_get(handoffs, "pg_advisory", n)),
                p50(_get(handoffs, "ours_token", n)),
                1.0,
                "<= 1x",
            )
        )
    unc = peers.get("uncontended", {})
    rows.append(
        _row(
            "head to head",
            "token uncontended acquire + release",
            "redis-py `Lock`",
            p50(_get(unc, "redis_py", "cycle")),
            p50(_get(unc, "ours_token", "cycle")),
            2.0,
            "<= 2x",
        )
    )
    plan = peers.get("plan", {})
    slots = "4"
    thr = _get(peers, "throughput", slots) or {}
    procs = plan.get("processes")
    for kind, label in (
        ("ours_token", "token semaphore"),
        ("ours_semaphore", "persistent semaphore"),
    ):
        rate = _get(thr, kind, "grants_per_s")
        base = THROUGHPUT_BASELINE[kind]
        got = None if rate is None or _get(thr, kind, "error") else rate / base
        comparable = procs == 16
        rows.append(
            {
                "group": "head to head",
                "label": f"{procs} processes on {slots} slots, {label}: grants/s",
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


__all__ = [
    "FAIR_KINDS",
    "LABELS",
    "REASK_KINDS",
    "Plan",
    "fairness",
    "fairness_rows",
    "fairness_summary",
    "head_to_head",
    "reask",
    "targets",
]
