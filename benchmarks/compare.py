"""Ours side by side with the peer lock libraries, on the same machine in the same run.

Every lock goes through one adapter interface (:mod:`benchmarks.peers`), so each
measurement is the same code for all of them:

- uncontended acquire + release, back to back in this process (and our lockers'
  ``start()`` / ``stop()``);
- handoff: N waiters blocked, the holder releases; time until the next process holds it
  (N = 2, 8, 32);
- throughput: P processes looping acquire -> release on 1 and on 4 slots: grants per
  second and their spread over the processes;
- crash: the holder is killed with SIGKILL; time until a blocked waiter holds the lock,
  with each library's default and tuned settings.

Workers come from the benchmarks' forkserver (libraries preloaded, so a worker costs a
fork); all of them are killed at the end of each run, as a crash-safe lock must allow.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .handoff import context, fresh_lock
from .latency import Budget, timed_cycles, unique_name
from .peers import worker
from .peers.kinds import KINDS, make, supports
from .stats import fairness, ms, summarize_reps

Log = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    waiters: tuple[int, ...]  # handoff: processes blocked when the holder releases
    handoff_samples: int
    #: Seconds each holder keeps the lock, uniformly random: waiters queue up meanwhile, and a
    #: polling waiter is caught at a random phase of its poll interval.
    handoff_hold: tuple[float, float]
    handoff_seconds: float  # cap per cell
    processes: int  # throughput contenders
    slot_counts: tuple[int, ...]
    seconds: float  # throughput run length
    crash_groups: dict[str, int]  # settings group -> samples
    crash_settle: tuple[float, float] = (0.2, 1.2)
    never_cap: float = 10.0  # how long to show that a lock with no expiry stays held


# ------------------------------------------------------------------------ plumbing


@contextlib.contextmanager
def _lock(kind: str, slots: int, targets: dict[str, str], tag: str) -> Iterator[str]:
    """A fresh lock name (created first and removed after for ours)."""
    if not KINDS[kind].ours:
        yield unique_name(f"{tag}-{kind.replace('_', '-')}")
        return
    with fresh_lock(targets["amqp"], kind, slots, tag) as name:
        yield name


class _Crew:
    """Worker processes of one run, their messages, and their end (always SIGKILL)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.sync = worker.Sync(
            out=ctx.Queue(),
            go=ctx.Event(),
            stop=ctx.Event(),
            start_at=ctx.Value("d", 0.0),
            grants=ctx.Value("i", 0),
            changed=ctx.Condition(),
        )
        self.procs: dict[int, Any] = {}
        self.inbox: list[tuple[Any, ...]] = []

    def spawn(self, job: worker.Job, idx: int) -> None:
        p = self.ctx.Process(target=worker.main, args=(job, idx, self.sync), daemon=True)
        p.start()
        self.procs[idx] = p

    def get(self, timeout: float) -> tuple[Any, ...] | None:
        try:
            msg: tuple[Any, ...] = self.sync.out.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if msg[0] == "error":
            raise RuntimeError(f"worker {msg[1]}: {msg[2]}")
        return msg

    def expect(self, what: str, idx: int | None, timeout: float) -> tuple[Any, ...] | None:
        """The next ``what`` message (of worker ``idx``); others are kept in ``inbox``."""
        for i, msg in enumerate(self.inbox):
            if msg[0] == what and (idx is None or msg[1] == idx):
                return self.inbox.pop(i)
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            msg = self.get(min(left, 0.5))
            if msg is None:
                dead = [i for i, p in self.procs.items() if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"worker(s) {dead} died (exit {self.procs[dead[0]].exitcode})"
                    )
                continue
            if msg[0] == what and (idx is None or msg[1] == idx):
                return msg
            self.inbox.append(msg)
        return None

    def ready(self, n: int, timeout: float = 120.0) -> None:
        for _ in range(n):
            if self.expect("ready", None, timeout) is None:
                raise RuntimeError(f"workers not ready within {timeout:.0f} s")

    def start(self, delay: float = 0.05) -> float:
        t0 = time.monotonic() + delay
        self.sync.start_at.value = t0
        self.sync.go.set()
        return t0

    def kill(self, idx: int) -> None:
        p = self.procs.pop(idx)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)

    def end(self) -> None:
        self.sync.stop.set()
        for idx in list(self.procs):
            self.kill(idx)


@contextlib.contextmanager
def _crew(ctx: Any) -> Iterator[_Crew]:
    crew = _Crew(ctx)
    try:
        yield crew
    finally:
        crew.end()


# --------------------------------------------------------------------- uncontended


def _cell(
    log: Log, what: str, measure: Callable[[], dict[str, Any]], shown: Callable[[Any], str]
) -> dict[str, Any]:
    """``measure()``, or its error (the run goes on; ``run.problems`` reports it); logged."""
    try:
        s = measure()
    except Exception as exc:
        s = {"error": f"{type(exc).__name__}: {exc}"[:300], "n": 0}
    log(f"  {what}: {'ERROR ' + s['error'] if 'error' in s else shown(s)}")
    return s


def _uc_shown(s: dict[str, Any]) -> str:
    a, r = s["acquire"]["p50_ms"], s["release"]["p50_ms"]
    return f"acquire p50={a:.2f} ms release p50={r:.2f} ms"


def uncontended(
    kinds: list[str], targets: dict[str, str], budget: Budget, rtt_ms: float, log: Log
) -> dict[str, Any]:
    """Acquire then release, back to back in this process, per lock (connection made first)."""

    def measure(kind: str) -> dict[str, Any]:
        with _lock(kind, 1, targets, "uc") as name:
            lock = make(kind, name, 1, targets)
            try:
                return _cycles(lock.acquire, lock.release, budget, rtt_ms)
            finally:
                lock.close()

    return {k: _cell(log, k, lambda k=k: measure(k), _uc_shown) for k in kinds}


def uncontended_lockers(
    lockers: dict[str, Any], budget: Budget, rtt_ms: float, log: Log
) -> dict[str, Any]:
    """``start()`` + ``stop()`` of each locker (uncontended; the master's path)."""
    out: dict[str, Any] = {}
    for label, lk in lockers.items():
        cycles = lambda lk=lk: _cycles(lambda: lk.start() or True, lk.stop, budget, rtt_ms)  # noqa: E731
        out[label] = _cell(log, label, cycles, _uc_shown)
        with contextlib.suppress(Exception):
            lk.close()
    return out


def _cycles(
    acquire: Callable[[], Any], release: Callable[[], Any], budget: Budget, rtt_ms: float
) -> dict[str, Any]:
    def cycle() -> tuple[float, float]:
        t0 = time.perf_counter()
        if not acquire():
            raise RuntimeError("uncontended acquire failed")
        t1 = time.perf_counter()
        release()
        return t1 - t0, time.perf_counter() - t1

    acq, rel, _ = timed_cycles(cycle, budget)
    stats: dict[str, Any] = {}
    for label, reps in (("acquire", acq), ("release", rel)):
        s = summarize_reps(reps)
        s["p50_x_rtt"] = round(s["p50_ms"] / rtt_ms, 1)
        stats[label] = s
    cycle_reps = [
        [a + r for a, r in zip(ra, rr, strict=True)] for ra, rr in zip(acq, rel, strict=True)
    ]
    stats["cycle"] = summarize_reps(cycle_reps)
    return stats


# ------------------------------------------------------------------------- handoff


def handoff(
    kinds: list[str], targets: dict[str, str], plan: Plan, rtt_ms: float, log: Log
) -> dict[str, Any]:
    """Per lock and per number of waiters: release -> the next process holds it."""
    ctx = context()
    out: dict[str, Any] = {}
    for kind in kinds:
        out[kind] = {}
        for n in plan.waiters:
            out[kind][str(n)] = _cell(
                log,
                f"handoff {kind} waiters={n}",
                lambda k=kind, n=n: _handoff_cell(ctx, k, targets, n, plan, rtt_ms),
                lambda s: (
                    f"p50={s['p50_ms']:.2f} ms p99={s['p99_ms']:.2f} ms n={s['n']} "
                    f"overlaps={s['overlaps']}"
                ),
            )
    return out


def _handoff_cell(
    ctx: Any, kind: str, targets: dict[str, str], n: int, plan: Plan, rtt_ms: float
) -> dict[str, Any]:
    warmup = 2
    with _lock(kind, 1, targets, f"ho{n}") as name, _crew(ctx) as crew:
        job = worker.Job(
            kind, name, 1, targets, "default", "chain", plan.handoff_hold, plan.handoff_seconds
        )
        for i in range(n + 1):
            crew.spawn(job, i)
        crew.ready(n + 1)
        t0 = crew.start()
        grants: list[tuple[float, float, int]] = []
        end = t0 + plan.handoff_seconds
        while len(grants) < plan.handoff_samples + warmup + 1 and time.monotonic() < end:
            msg = crew.get(end - time.monotonic())
            if msg is not None and msg[0] == "grant":
                grants.append((msg[2], msg[3], msg[1]))
        crew.sync.stop.set()
        with crew.sync.changed:
            crew.sync.changed.notify_all()
    grants.sort()
    gaps: list[float] = []
    overlaps = 0
    for (_, r_prev, _who), (a_next, _, _) in itertools.pairwise(grants):
        if a_next < r_prev:
            overlaps += 1  # two holders at once: the lock failed (never seen so far)
        gaps.append(a_next - r_prev)
    gaps = gaps[warmup:]
    if not gaps:
        raise RuntimeError(f"no handoff within {plan.handoff_seconds:.0f} s")
    s = summarize_reps([gaps])
    s["samples_ms"] = [ms(x) for x in gaps]
    s["overlaps"] = overlaps
    s["waiters"] = n
    s["p50_x_rtt"] = round(s["p50_ms"] / rtt_ms, 1)
    return s


# ---------------------------------------------------------------------- throughput


def throughput(kinds: list[str], targets: dict[str, str], plan: Plan, log: Log) -> dict[str, Any]:
    """Per lock and slot count: P processes looping acquire -> release for ``seconds``."""
    ctx = context()
    out: dict[str, Any] = {}
    for slots in plan.slot_counts:
        out[str(slots)] = {}
        for kind in kinds:
            if not supports(kind, slots) or (slots > 1 and kind in ("ours_mutex", "kazoo_lock")):
                continue
            out[str(slots)][kind] = _cell(
                log,
                f"throughput {kind} slots={slots}",
                lambda k=kind, slots=slots: _throughput_cell(ctx, k, targets, slots, plan),
                lambda s: (
                    f"{s['grants_per_s']:.0f} grants/s, Jain {s['fairness']['jain']:.2f}, "
                    f"min/max {s['fairness']['min']}/{s['fairness']['max']}"
                ),
            )
    return out


def _throughput_cell(
    ctx: Any, kind: str, targets: dict[str, str], slots: int, plan: Plan
) -> dict[str, Any]:
    with _lock(kind, slots, targets, f"tp{slots}") as name, _crew(ctx) as crew:
        job = worker.Job(kind, name, slots, targets, "default", "loop", (0.0, 0.0), plan.seconds)
        for i in range(plan.processes):
            crew.spawn(job, i)
        crew.ready(plan.processes)
        t0 = crew.start()
        end = t0 + plan.seconds
        per = [0] * plan.processes
        held: list[tuple[float, float]] = []
        while (left := end + 0.2 - time.monotonic()) > 0:
            msg = crew.get(left)
            if msg is not None and msg[0] == "grant" and t0 <= msg[2] <= end:
                per[msg[1]] += 1
                held.append((msg[2], msg[3]))
    total = sum(per)
    return {
        "slots": slots,
        "processes": plan.processes,
        "seconds": plan.seconds,
        "grants": total,
        "grants_per_s": round(total / plan.seconds, 1),
        "grants_per_process": per,
        "fairness": fairness(per),
        "max_concurrent": _max_concurrent(held),
    }


def _max_concurrent(held: list[tuple[float, float]]) -> int:
    """Most grants held at once (at most the slot count for a correct lock)."""
    events = sorted([(a, 1) for a, _ in held] + [(r, -1) for _, r in held])
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


# --------------------------------------------------------------------------- crash


def crash(kinds: list[str], targets: dict[str, str], plan: Plan, log: Log) -> dict[str, Any]:
    """Holder SIGKILLed -> a blocked waiter holds it, per lock and settings group.

    The fast series run first, one after another; then the series whose lock comes free
    only by expiry (seconds of mostly idle waiting) run concurrently, each on its own lock.
    """
    ctx = context()
    rng = random.Random(6)
    series: list[tuple[str, str, int, int]] = []
    for group, samples in plan.crash_groups.items():
        for kind in kinds:
            k = KINDS[kind]
            if group == "tuned" and k.tuned is None and "default" in plan.crash_groups:
                continue  # nothing to tune: the default row says it all
            series.append((kind, group, samples, rng.randrange(1 << 30)))
    results: dict[tuple[str, str], dict[str, Any]] = {}

    def run(kind: str, group: str, samples: int, seed: int) -> None:
        results[kind, group] = _cell(
            log,
            f"crash {kind} {group}",
            lambda: _crash_series(ctx, kind, group, targets, samples, seed, plan),
            lambda s: (
                f"not free within {s['cap_s']:.0f} s (never expires)"
                if s.get("censored")
                else f"p50={s['p50_ms']:.1f} ms max={s['max_ms']:.1f} ms n={s['n']}"
            ),
        )

    def slow(kind: str, group: str) -> bool:
        expiry = KINDS[kind].expiry[group == "tuned"]
        return expiry is None or expiry >= 1.0

    # The fast ones first, one after another on a quiet machine; then the slow ones
    # together (mostly idle: waiting for expiry).
    started = time.monotonic()
    for s in series:
        if not slow(s[0], s[1]):
            run(*s)
    threads = [
        threading.Thread(target=run, args=s, daemon=True) for s in series if slow(s[0], s[1])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out: dict[str, Any] = {"wall_s": round(time.monotonic() - started, 1), "rows": {}}
    for kind, group, _, _ in series:
        out["rows"].setdefault(kind, {})[group] = results[kind, group]
    return out


def _crash_series(
    ctx: Any,
    kind: str,
    group: str,
    targets: dict[str, str],
    samples: int,
    seed: int,
    plan: Plan,
) -> dict[str, Any]:
    rng = random.Random(seed)
    expiry = KINDS[kind].expiry[group == "tuned"]
    cap = plan.never_cap if expiry is None else 1.5 * expiry + 10.0
    out: list[float] = []
    errors: list[str] = []
    censored = 0
    with _lock(kind, 1, targets, f"cr-{group}") as name, _crew(ctx) as crew:
        job = worker.Job(kind, name, 1, targets, group, "hold")
        crew.spawn(job, 0)
        crew.ready(1)
        if crew.expect("acquired", 0, 60) is None:
            raise RuntimeError("the first holder did not acquire within 60 s")
        for i in range(1, samples + 1):
            crew.spawn(job, i)
            crew.ready(1)
            crew.expect("acquiring", i, 30)
            time.sleep(rng.uniform(*plan.crash_settle))  # the waiter is blocked meanwhile
            if crew.expect("acquired", i, 0) is not None:
                errors.append(f"sample {i}: the waiter acquired while the holder was alive")
                break
            t_kill = time.monotonic()
            crew.kill(i - 1)
            got = crew.expect("acquired", i, cap)
            if got is None:
                censored += 1
                break  # held by a dead process for good: no further samples
            out.append(got[2] - t_kill)
    s: dict[str, Any] = (
        summarize_reps([out]) if out else {"n": 0, "p50_ms": math.nan, "p99_ms": math.nan}
    )
    s["samples_ms"] = [ms(x) for x in out]
    s["censored"] = censored
    s["cap_s"] = cap
    s["errors"] = errors
    s["settings"] = KINDS[kind].settings(group)
    return s
