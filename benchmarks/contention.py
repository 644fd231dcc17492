"""Many processes contending for few slots: throughput, fairness and release-to-grant handoff.

Each worker is a separate process (``spawn``) with its own Broker, looping acquire ->
release for a fixed time. Workers record, on ``time.monotonic()`` (one system-wide clock on
Linux, so comparable across processes), when ``acquire()`` returned and when they were about
to call ``release()``, with the slot number and fencing token. Tokens rise strictly with
every grant, so per slot the grants are ordered by token and each release is paired with
the next grant of the same slot: the handoff is that grant's time minus the release's.

The fairness loop (``fairness``) runs a few processes on one permit per primitive: Jain's
index over grants per process, and every wait against the median wait.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import queue
import re
import statistics
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from amqp_locks import Broker, PersistentSemaphore, SemaphoreAdmin

from .handoff import HeadlinePlan, _make, context, fresh_lock
from .latency import ProbeCounter, unique_name
from .stats import CpuMeter, fairness_summary, ms, summarize_reps

#: (kind, slot, token, time): kind "A" = acquire returned, "R" = about to release.
Event = tuple[str, int, int, float]


class _WarningTally(logging.Handler):
    """Counts the library's (and aiormq's) warnings in a worker, by message shape.

    Under contention these are findings (connections lost, protocol errors); counting them
    puts them in the report instead of scrolling past on stderr.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = re.sub(r"0x[0-9a-f]+", "0x..", record.getMessage().splitlines()[0])
        text = re.sub(r"\d+(\.\d+)?", "N", text)[:160]
        key = f"{record.name}: {text}"
        self.counts[key] = self.counts.get(key, 0) + 1


@dataclass(frozen=True)
class Plan:
    processes: int
    slots: int
    seconds: float
    hold: float  # seconds a worker holds each grant (0: release at once)
    #: How long after the end of a run a worker may take to return from its last acquire.
    grace: float = 15.0


def _worker(
    idx: int, url: str, name: str, plan: Plan, ready: Any, go: Any, start_at: Any, results: Any
) -> None:
    """One contender. Streams ("grant", idx, (acquired, released)) to ``results`` as it goes,
    so a worker that hangs loses nothing already measured, and ends with
    ("done", idx, error, cpu seconds, warning counts) whatever happens."""
    warnings = _WarningTally()
    logging.getLogger().addHandler(warnings)
    probes = ProbeCounter()  # searches per grant show how many waiters a release sets off
    error: str | None = None
    cpu0 = time.process_time()
    deadline = 0.0
    broker = Broker(url, connection_name=f"amqp-locks bench worker {idx}")
    try:
        broker.connect()
        sem = PersistentSemaphore(broker, name)
        _ready_set_go(sem, idx, ready, go)
        deadline = start_at.value + plan.seconds
        cpu0 = time.process_time()
        with probes.installed():
            while (remaining := deadline - time.monotonic()) > 0:
                lease = sem.acquire(timeout=remaining)
                if lease is None:
                    break
                acquired = ("A", lease.number, lease.fencing_token, time.monotonic())
                if plan.hold:
                    time.sleep(plan.hold)
                released = ("R", lease.number, lease.fencing_token, time.monotonic())
                lease.release()
                results.put(("grant", idx, (acquired, released)))
    except BaseException as exc:  # concurrent.futures.CancelledError is not an Exception
        when = time.monotonic() - deadline if deadline else float("nan")
        what = traceback.format_exception_only(type(exc), exc)[-1].strip()
        error = f"{what} (at {when:+.1f} s from the end of the run)"
    finally:
        # How late the last acquire(timeout=...) returned after the run's end (its timeout).
        late = time.monotonic() - deadline if deadline else float("nan")
        stats = {
            "cpu": time.process_time() - cpu0,
            "late": late,
            "probe_calls": probes.calls,
            "probes": probes.queues,
        }
        results.put(("done", idx, error, stats, warnings.counts))
        broker.close()


def run_once(url: str, plan: Plan, broker_pid: int | None) -> dict[str, Any]:
    """One timed contention run on a fresh semaphore: raw events and CPU seconds spent."""
    ctx = mp.get_context("spawn")
    name = unique_name("contention")
    with Broker(url) as admin_broker:
        admin = SemaphoreAdmin(admin_broker, name)
        admin.create(plan.slots)
        procs, ready, go, start_at, results = _group(ctx, _worker, plan.processes, url, name, plan)
        per_worker: dict[int, list[Event]] = {i: [] for i in range(plan.processes)}
        done: set[int] = set()
        worker_cpu = 0.0
        warned: dict[str, int] = {}
        overruns: list[float] = []
        probe_calls = probes_sent = 0
        broker_cpu = float("nan")
        errors: list[str] = []
        meter = CpuMeter({"broker": broker_pid})
        try:
            _await_ready(ready, procs, 120.0)
            meter.start()
            start_at.value = time.monotonic() + 0.05
            go.set()
            end = start_at.value + plan.seconds
            while len(done) < len(procs) and time.monotonic() < end + plan.grace:
                if math.isnan(broker_cpu) and time.monotonic() >= end:
                    broker_cpu = meter.stop()["broker"]
                try:
                    msg = results.get(timeout=0.2)
                except queue.Empty:
                    continue
                if msg[0] == "grant":
                    per_worker[msg[1]].extend(msg[2])
                    continue
                _, idx, error, stats, counts = msg
                done.add(idx)
                overruns.append(stats["late"])
                worker_cpu += stats["cpu"]
                probe_calls += stats["probe_calls"]
                probes_sent += stats["probes"]
                for text, n in counts.items():
                    warned[text] = warned.get(text, 0) + n
                if error:
                    errors.append(f"worker {idx}: {error}")
            if math.isnan(broker_cpu):
                broker_cpu = meter.stop()["broker"]
            for idx in sorted(set(range(plan.processes)) - done):
                overruns.append(math.inf)
                errors.append(
                    f"worker {idx}: still inside acquire(timeout=...) {plan.grace:.0f} s after the "
                    "end of the run (terminated; its CPU time is not counted)"
                )
        finally:
            _end_group(procs)
            admin.destroy(purge_fence=True)
    if not any(per_worker.values()):
        raise RuntimeError("contention run produced no grants:\n" + "\n".join(errors))
    return {
        "events": per_worker,
        "cpu": {"workers": worker_cpu, "broker": broker_cpu},
        "errors": errors,
        "warnings": warned,
        "timeout_overruns": overruns,
        "probe_calls": probe_calls,
        "probes": probes_sent,
    }


def _ready_set_go(lock: Any, idx: int, ready: Any, go: Any) -> None:
    """A worker's warm-up (the fence check, pooled channels), its "ready", then "go"."""
    lease = lock.acquire(timeout=60)
    if lease is not None:
        lease.release()
    ready.put(idx)
    if not go.wait(120):
        raise RuntimeError("never told to start")


def _group(ctx: Any, target: Any, n: int, *args: Any) -> tuple[list[Any], Any, Any, Any, Any]:
    """``n`` started processes ``target(idx, *args, ready, go, start_at, results)``."""
    ready, results, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(target=target, args=(i, *args, ready, go, start_at, results), daemon=True)
        for i in range(n)
    ]
    for p in procs:
        p.start()
    return procs, ready, go, start_at, results


def _await_ready(ready: Any, procs: list[Any], timeout: float) -> None:
    """Wait for every worker's "ready"; fail fast if one dies first (e.g. import error)."""
    deadline = time.monotonic() + timeout
    pending = len(procs)
    while pending:
        try:
            ready.get(timeout=0.5)
            pending -= 1
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{pending} workers not ready; exit codes {dead}") from None


def _end_group(procs: list[Any]) -> None:
    """A few seconds to close their connections, then the stragglers are stopped (what
    they measured has already been sent)."""
    stop_by = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.1, stop_by - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)


def handoffs(per_worker: dict[int, list[Event]]) -> tuple[list[float], int]:
    """Release -> next grant of the same slot (seconds), and how many went to the releaser."""
    by_slot: dict[int, list[tuple[int, str, float, int]]] = defaultdict(list)
    for worker, events in per_worker.items():
        for kind, slot, token, t in events:
            by_slot[slot].append((token, kind, t, worker))
    out: list[float] = []
    to_self = 0
    for events in by_slot.values():
        # Per token the grant ("A") precedes its release ("R").
        events.sort(key=lambda e: (e[0], e[1] != "A"))
        pending: tuple[float, int] | None = None
        for _token, kind, t, worker in events:
            if kind == "R":
                pending = (t, worker)
            elif pending is not None:
                out.append(t - pending[0])
                to_self += worker == pending[1]
                pending = None
    return out, to_self


def _overrun(lates: list[float]) -> dict[str, Any]:
    """How late workers' final ``acquire(timeout=...)`` returned after the timeout."""
    finite = [x for x in lates if math.isfinite(x)]
    return {
        "workers": len(lates),
        "p50_ms": ms(statistics.median(finite)) if finite else None,
        "max_ms": ms(max(finite)) if finite else None,
        "over_1s": sum(1 for x in lates if x > 1.0),
        "never_returned": sum(1 for x in lates if math.isinf(x)),
    }


def _merge(tallies: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for tally in tallies:
        for msg, n in tally.items():
            out[msg] = out.get(msg, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summarize(runs: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """Medians over runs of throughput and fairness; handoff percentiles over runs."""
    rates: list[float] = []
    fairness: list[dict[str, float]] = []
    hand_reps: list[list[float]] = []
    self_share: list[float] = []
    grants_last: list[int] = []
    cpu_worker: list[float] = []
    cpu_broker: list[float] = []
    calls_per_grant: list[float] = []
    probes_per_grant: list[float] = []
    for run in runs:
        per_worker = run["events"]
        grants = [
            sum(1 for e in per_worker.get(i, []) if e[0] == "A") for i in range(plan.processes)
        ]
        total = sum(grants)
        rates.append(total / plan.seconds)
        if total:
            cpu_worker.append(run["cpu"]["workers"] / total)
            cpu_broker.append(run["cpu"]["broker"] / total)
            calls_per_grant.append(run.get("probe_calls", 0) / total)
            probes_per_grant.append(run.get("probes", 0) / total)
        mean = statistics.fmean(grants)
        fairness.append(
            {
                "min": min(grants),
                "max": max(grants),
                "stddev": statistics.pstdev(grants),
                "cv": statistics.pstdev(grants) / mean if mean else float("nan"),
                "jain": total**2 / (plan.processes * sum(g * g for g in grants))
                if total
                else float("nan"),
            }
        )
        hand, to_self = handoffs(per_worker)
        hand_reps.append(hand)
        self_share.append(to_self / len(hand) if hand else float("nan"))
        grants_last = grants
    med = statistics.median
    return {
        "plan": {
            "processes": plan.processes,
            "slots": plan.slots,
            "seconds": plan.seconds,
            "hold_ms": plan.hold * 1000,
            "grace_s": plan.grace,
        },
        "runs": len(runs),
        "acquisitions_per_s": round(med(rates), 1),
        "acquisitions_per_s_runs": [round(r, 1) for r in rates],
        "grants_per_process": {
            k: round(med([f[k] for f in fairness]), 3)
            for k in ("min", "max", "stddev", "cv", "jain")
        },
        "grants_per_process_last_run": grants_last,
        "handoff": summarize_reps(hand_reps),
        "handoff_to_releaser_share": round(med(self_share), 3),
        "handoff_samples_ms": [ms(x) for r in hand_reps for x in r],
        "handoff_p50_ms_runs": summarize_reps(hand_reps)["p50_reps_ms"],
        "probe_round_trips_per_grant": round(med(calls_per_grant), 1) if calls_per_grant else None,
        "probes_per_grant": round(med(probes_per_grant), 1) if probes_per_grant else None,
        "cpu_per_grant_ms": {
            "workers": ms(med(cpu_worker)) if cpu_worker else None,
            "broker": ms(med(cpu_broker)) if cpu_broker else None,
        },
        "worker_errors": [e for run in runs for e in run.get("errors", [])],
        "worker_warnings": _merge([run.get("warnings", {}) for run in runs]),
        "timeout_overrun": _overrun([x for run in runs for x in run.get("timeout_overruns", [])]),
        "ms_per_grant_per_slot": ms(plan.slots / med(rates)) if med(rates) else None,
    }


# ------------------------------------------------------------------- fairness loop


def _fair_worker(
    idx: int,
    url: str,
    kind: str,
    name: str,
    plan: HeadlinePlan,
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
        _ready_set_go(lock, idx, ready, go)
        deadline = start_at.value + plan.fair_seconds
        while (remaining := deadline - time.monotonic()) > 0:
            t0 = time.monotonic()
            lease = lock.acquire(timeout=remaining)
            if lease is None:
                break
            waits.append((t0, time.monotonic()))
            time.sleep(plan.fair_hold)
            lease.release()
    except BaseException as exc:
        error = repr(exc)
    finally:
        results.put((idx, waits, error))
        broker.close()


def fairness(url: str, plan: HeadlinePlan, log: Callable[[str], None]) -> dict[str, Any]:
    """Per primitive (one permit): ``fair_processes`` processes loop acquire -> hold
    ``fair_hold`` s -> release for ``fair_seconds`` s; Jain's index over grants per
    process, and every wait (``acquire()`` called -> returned) against the median wait."""
    ctx = context()
    out: dict[str, Any] = {}
    for kind in ("token", "token_nofence", "mutex", "semaphore"):
        per: dict[int, list[tuple[float, float]]] = {}
        errors: list[str] = []
        with fresh_lock(url, kind) as name:
            n = plan.fair_processes
            procs, ready, go, start_at, results = _group(
                ctx, _fair_worker, n, url, kind, name, plan
            )
            try:
                _await_ready(ready, procs, 120.0)
                start_at.value = time.monotonic() + 0.05
                go.set()
                end = start_at.value + plan.fair_seconds + plan.fair_grace
                while len(per) < n and time.monotonic() < end:
                    with contextlib.suppress(queue.Empty):
                        idx, waits, error = results.get(timeout=0.5)
                        per[idx] = waits
                        errors += [f"worker {idx}: {error}"] if error else []
                for idx in set(range(n)) - per.keys():
                    errors.append(f"worker {idx}: no report {plan.fair_grace:.0f} s after the end")
            finally:
                _end_group(procs)
        out[kind] = s = fairness_summary([per.get(i, []) for i in range(n)])
        s["errors"] = errors
        s["grants_per_s"] = round(sum(s["grants"]) / plan.fair_seconds, 1)
        log(
            f"  fairness {kind}: grants {s['grants']} Jain {s['jain']}, wait p50 "
            f"{s['wait_p50_ms']} ms max {s['wait_max_ms']} ms ({s['wait_max_over_median']}x, "
            f"{s['waits_over_bound']} waits over 3x the median, the longest "
            f"{s['wait_max_at_s']} s into the run), errors {len(s['errors'])}"
        )
    return out
