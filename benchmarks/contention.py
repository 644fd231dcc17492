"""Many processes contending for few slots of a persistent semaphore: throughput, fairness
and release-to-grant handoff. Workers stream each grant's slot, fencing token and times on
CLOCK_MONOTONIC; tokens rise with every grant, so per slot each release pairs with the next
grant of that slot: the handoff.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from .latency import ProbeCounter
from .peers.kinds import make
from .peers.worker import Crew, Sync, what
from .stats import CpuMeter, fairness, fresh_lock, ms, summarize_reps

#: (kind, slot, token, time): kind "A" = acquire returned, "R" = about to release.
Event = tuple[str, int, int, float]


@dataclass(frozen=True)
class Plan:
    processes: int
    slots: int
    seconds: float
    hold: float  # seconds a worker holds each grant (0: release at once)
    #: How long after the end of a run a worker may take to return from its last acquire.
    grace: float = 15.0


class _WarningTally(logging.Handler):
    """The library's (and aiormq's) warnings in a worker, counted by message shape: under
    contention they are findings (connections lost, protocol errors)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = re.sub(r"0x[0-9a-f]+", "0x..", record.getMessage().splitlines()[0])
        self.counts[f"{record.name}: " + re.sub(r"\d+(\.\d+)?", "N", text)[:160]] += 1


def _worker(job: tuple[str, str, Plan], idx: int, sync: Sync) -> None:
    """One contender: its grants go to the parent as they happen (a worker that hangs loses
    nothing measured); it ends with ("done", idx, error, figures, warnings) whatever happens."""
    url, name, plan = job
    tally, probes = _WarningTally(), ProbeCounter()  # searches per grant: waiters set off
    logging.getLogger().addHandler(tally)
    try:
        lock = make("semaphore", name, plan.slots, {"amqp": url})
        lock.acquire()  # warm-up: the fence check, pooled channels
        lock.release()
    except BaseException as exc:
        sync.out.put(("error", idx, f"setup: {what(exc)}"))
        return
    sync.out.put(("ready", idx))
    error, deadline, cpu0 = None, 0.0, time.process_time()
    try:
        sync.go.wait()
        deadline = sync.start_at.value + plan.seconds
        cpu0 = time.process_time()
        with probes.installed():
            while (left := deadline - time.monotonic()) > 0 and lock.acquire(timeout=left):
                lease, t_a = lock.lease, time.monotonic()
                if plan.hold:
                    time.sleep(plan.hold)
                grant = (lease.number, lease.fencing_token)
                events = [("A", *grant, t_a), ("R", *grant, time.monotonic())]
                lock.release()
                sync.out.put(("grant", idx, events))
    except BaseException as exc:  # concurrent.futures.CancelledError is not an Exception
        error = f"{what(exc)} (at {time.monotonic() - deadline:+.1f} s from the end of the run)"
    finally:
        # How late the last acquire(timeout=...) returned after the run's end (its timeout).
        late = time.monotonic() - deadline if deadline else math.nan
        figures = {"cpu": time.process_time() - cpu0, "late": late, "probe_calls": probes.calls}
        sync.out.put(("done", idx, error, figures, dict(tally.counts)))
        lock.close()


def run_once(url: str, plan: Plan, broker_pid: int | None) -> dict[str, Any]:
    """One timed contention run on a fresh semaphore: raw events and CPU seconds spent."""
    events: dict[int, list[Event]] = {i: [] for i in range(plan.processes)}
    done, errors, overruns, totals, warned = set(), [], [], Counter[str](), Counter[str]()
    meter, broker_cpu = CpuMeter({"broker": broker_pid}), math.nan
    with fresh_lock(url, "semaphore", plan.slots, "contention") as name, Crew(spawn=True) as crew:
        crew.spawn((url, name, plan), plan.processes, target=_worker)
        meter.start()
        end = crew.start() + plan.seconds
        while len(done) < plan.processes and time.monotonic() < end + plan.grace:
            if math.isnan(broker_cpu) and time.monotonic() >= end:
                broker_cpu = meter.stop()["broker"]
            if (msg := crew.get(0.2)) is not None and msg[0] == "grant":
                events[msg[1]].extend(msg[2])
            elif msg is not None:
                _, idx, error, figures, counts = msg
                done.add(idx)
                overruns.append(figures.pop("late"))
                totals.update(figures)
                warned.update(counts)
                errors += [f"worker {idx}: {error}"] if error else []
        if math.isnan(broker_cpu):
            broker_cpu = meter.stop()["broker"]
    for idx in sorted(set(range(plan.processes)) - done):
        overruns.append(math.inf)
        errors.append(
            f"worker {idx}: still inside acquire(timeout=...) {plan.grace:.0f} s after the "
            "end of the run (terminated; its CPU time is not counted)"
        )
    if not any(events.values()):
        raise RuntimeError("contention run produced no grants:\n" + "\n".join(errors))
    return {
        "events": events,
        "cpu": {"workers": totals["cpu"], "broker": broker_cpu},
        "errors": errors,
        "warnings": warned,
        "timeout_overruns": overruns,
        "probe_calls": totals["probe_calls"],
    }


def handoffs(per_worker: dict[int, list[Event]]) -> tuple[list[float], int]:
    """Release -> next grant of the same slot (seconds), and how many went to the releaser."""
    by_slot: dict[int, list[tuple[int, str, float, int]]] = defaultdict(list)
    for worker, events in per_worker.items():
        for kind, slot, token, t in events:
            by_slot[slot].append((token, kind, t, worker))
    pairs = []
    for events in by_slot.values():
        events.sort(key=lambda e: (e[0], e[1] != "A"))  # per token the grant precedes its release
        pairs += [(a, b) for a, b in itertools.pairwise(events) if (a[1], b[1]) == ("R", "A")]
    return [b[2] - a[2] for a, b in pairs], sum(a[3] == b[3] for a, b in pairs)


def summarize(runs: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """Medians over runs of throughput and fairness; handoff percentiles over runs."""
    med = statistics.median
    per_run = []
    for run in runs:
        grants = [sum(e[0] == "A" for e in run["events"].get(i, [])) for i in range(plan.processes)]
        total = sum(grants) or math.nan
        hand, to_self = handoffs(run["events"])
        per_run.append(
            {
                "rate": sum(grants) / plan.seconds,
                "grants": grants,
                "hand": hand,
                "self": to_self / len(hand) if hand else math.nan,
                "fair": {**fairness(grants), "stddev": statistics.pstdev(grants)},
                "workers": run["cpu"]["workers"] / total,
                "broker": run["cpu"]["broker"] / total,
                "calls": run["probe_calls"] / total,
            }
        )

    def median_of(key: str) -> float:
        return float(med([x[key] for x in per_run]))

    rates = [x["rate"] for x in per_run]
    lates = [x for run in runs for x in run["timeout_overruns"]]
    finite = [x for x in lates if math.isfinite(x)]
    warned: Counter[str] = sum((Counter(run["warnings"]) for run in runs), Counter())
    return {
        "plan": {**asdict(plan), "hold_ms": plan.hold * 1000, "grace_s": plan.grace},
        "runs": len(runs),
        "acquisitions_per_s": round(med(rates), 1),
        "acquisitions_per_s_runs": [round(r, 1) for r in rates],
        "grants_per_process": {
            k: round(med([x["fair"][k] for x in per_run]), 3)
            for k in ("min", "max", "stddev", "cv", "jain")
        },
        "grants_per_process_last_run": per_run[-1]["grants"],
        "handoff": summarize_reps([x["hand"] for x in per_run]),
        "handoff_to_releaser_share": round(median_of("self"), 3),
        "handoff_samples_ms": [ms(x) for r in per_run for x in r["hand"]],
        "probe_round_trips_per_grant": round(median_of("calls"), 1),
        "cpu_per_grant_ms": {k: ms(median_of(k)) for k in ("workers", "broker")},
        "worker_errors": [e for run in runs for e in run["errors"]],
        "worker_warnings": dict(warned.most_common()),
        "timeout_overrun": {  # how late workers' final acquire(timeout=...) returned
            "workers": len(lates),
            "p50_ms": ms(med(finite)) if finite else None,
            "max_ms": ms(max(finite)) if finite else None,
            "over_1s": sum(1 for x in lates if x > 1.0),
            "never_returned": sum(1 for x in lates if math.isinf(x)),
        },
    }
