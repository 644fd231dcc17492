"""Ours beside the peer lock libraries in the same run, each against its own private server
and through one interface (``peers/``): uncontended acquire + release (and our lockers'
``start()`` / ``stop()``), handoff with N waiters, throughput and fairness on 1 and 4 slots,
holder SIGKILL -> a waiter holds with default and tuned settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import itertools
import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import failover, stats
from .peers.kinds import KINDS, available, make, supports
from .peers.servers import running
from .peers.worker import Crew, Job, kill_series
from .stats import Budget, CpuMeter, brief, fairness, fresh_lock, ms, summarize_reps, timed

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
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


def cell(log: Log, what: str, measure: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``measure(*args)``, or its error (the run goes on; ``run.problems`` reports it); logged."""
    try:
        s = measure(*args)
    except Exception as exc:
        s = {"error": f"{type(exc).__name__}: {exc}"[:300], "n": 0}
    log(f"  {what}: {brief(s)}")
    return s


def cycles(
    acquire: Callable[[], Any],
    release: Callable[[], Any],
    budget: Budget,
    pids: dict[str, int | None] | None = None,
) -> dict[str, Any]:
    """Acquire then release, back to back in this process: p50/p99 of each and of the cycle
    (and with ``pids`` the CPU per cycle of those processes)."""

    def cycle() -> tuple[float, float]:
        t0 = time.perf_counter()
        if not acquire():
            raise RuntimeError("uncontended acquire failed")
        t1 = time.perf_counter()
        release()
        return t1 - t0, time.perf_counter() - t1

    meter = CpuMeter(pids or {})
    reps = timed(cycle, budget, meter.start)
    out = {
        op: summarize_reps([[x[i] for x in r] for r in reps], samples=True)
        for i, op in enumerate(("acquire", "release"))
    }
    out["cycle"] = summarize_reps([[a + b for a, b in r] for r in reps])
    if pids:
        out["cpu_per_cycle_ms"] = {k: ms(v / out["cycle"]["n"]) for k, v in meter.stop().items()}
    return out


def uncontended(
    kinds: list[str],
    targets: dict[str, str],
    budget: Budget,
    pids: dict[str, int | None] | None = None,
    log: Log = lambda _: None,
) -> dict[str, Any]:
    """Acquire then release, back to back in this process, per lock (connection made first)."""

    def measure(kind: str) -> dict[str, Any]:
        with fresh_lock(targets["amqp"], kind, 1, "uc") as name:
            lock = make(kind, name, 1, targets)
            try:
                return cycles(lock.acquire, lock.release, budget, pids)
            finally:
                lock.close()

    return {k: cell(log, k, measure, k) for k in kinds}


def uncontended_lockers(
    url: str, pg_url: str | None, tmp: Path, budget: Budget, log: Log
) -> dict[str, Any]:
    """``start()`` + ``stop()`` of each of our lockers (uncontended; the master's path)."""
    from amqp_locks import Broker

    specs = failover.specs(
        failover.DEFAULT, "uc", tmp, {"PostgreSQL": pg_url} if pg_url else {}, url
    )
    out: dict[str, Any] = {}
    with Broker(url, connection_name="amqp-locks bench AmqpLocker") as broker:
        for spec in specs:
            lk = failover.locker(spec, broker)
            out[spec.label] = cell(
                log, spec.label, cycles, lambda lk=lk: lk.start() or True, lk.stop, budget
            )
            with contextlib.suppress(Exception):
                lk.close()
    stats.delete_queues(url, stats.leftovers(specs[-1].name))
    return out


def chain(
    kind: str,
    targets: dict[str, str],
    waiters: int,
    hold: tuple[float, float],
    samples: int,
    seconds: float,
    warmup: int = 2,
) -> tuple[list[float], list[float], int]:
    """``waiters`` + 1 processes pass one lock round, each holding it a random ``hold`` s:
    ``samples`` handoffs (release called -> the next process holds it), the ``release()``
    calls' durations, and how often two held it at once (a broken lock)."""
    with fresh_lock(targets["amqp"], kind, 1, f"ho{waiters}") as name, Crew() as crew:
        job = Job(kind, name, 1, targets, mode="chain", hold=hold, seconds=seconds)
        crew.spawn(job, waiters + 1)
        t0 = crew.start()
        grants = sorted(g[3:] for g in crew.grants(t0 + seconds, samples + warmup + 1))
    gaps = [a - r for (_, r, _), (a, _, _) in itertools.pairwise(grants)]
    if len(gaps) <= warmup:
        raise RuntimeError(f"no handoff within {seconds:.0f} s")
    calls = [done - r for _, r, done in grants]
    return gaps[warmup:], calls[warmup:], sum(1 for g in gaps if g < 0)


def loop(
    kind: str,
    targets: dict[str, str],
    slots: int,
    processes: int,
    seconds: float,
    hold: float = 0.0,
    count: float = float("inf"),
) -> list[tuple[Any, ...]]:
    """``processes`` loop acquire -> hold -> release on a fresh lock of ``slots`` for
    ``seconds`` (or ``count`` grants): the grants acquired within them, in order, as
    (process, acquire called, acquired, release called)."""
    with fresh_lock(targets["amqp"], kind, slots, f"tp{slots}") as name, Crew() as crew:
        crew.spawn(Job(kind, name, slots, targets, hold=(hold, hold), seconds=seconds), processes)
        t0 = crew.start()
        grants = crew.grants(t0 + seconds + max(0.2, 2 * hold), count)
    return sorted((g[1:5] for g in grants if t0 <= g[3] <= t0 + seconds), key=lambda g: g[2])


def handoff(kinds: list[str], targets: dict[str, str], plan: Plan, log: Log) -> dict[str, Any]:
    """Per lock and per number of waiters: release -> the next process holds it."""

    def measure(kind: str, n: int) -> dict[str, Any]:
        hold, samples, seconds = plan.handoff_hold, plan.handoff_samples, plan.handoff_seconds
        gaps, _, overlaps = chain(kind, targets, n, hold, samples, seconds)
        return {**summarize_reps([gaps], samples=True), "overlaps": overlaps, "waiters": n}

    return {
        k: {str(n): cell(log, f"handoff {k} waiters={n}", measure, k, n) for n in plan.waiters}
        for k in kinds
    }


def throughput(kinds: list[str], targets: dict[str, str], plan: Plan, log: Log) -> dict[str, Any]:
    """Per lock and slot count: P processes looping acquire -> release for ``seconds``."""

    def measure(kind: str, slots: int) -> dict[str, Any]:
        grants = loop(kind, targets, slots, plan.processes, plan.seconds)
        per = [sum(1 for g in grants if g[0] == i) for i in range(plan.processes)]
        return {
            "slots": slots,
            "processes": plan.processes,
            "seconds": plan.seconds,
            "grants": len(grants),
            "grants_per_s": round(len(grants) / plan.seconds, 1),
            "grants_per_process": per,
            "fairness": fairness(per),
            "max_concurrent": _max_concurrent([g[2:4] for g in grants]),
        }

    return {
        str(s): {
            k: cell(log, f"throughput {k} slots={s}", measure, k, s)
            for k in kinds
            if supports(k, s) and not (s > 1 and k in ("ours_mutex", "kazoo_lock"))
        }
        for s in plan.slot_counts
    }


def _max_concurrent(held: list[tuple[float, float]]) -> int:
    """Most grants held at once (at most the slot count for a correct lock)."""
    now = peak = 0
    for _, d in sorted([(a, 1) for a, _ in held] + [(r, -1) for _, r in held]):
        now += d
        peak = max(peak, now)
    return peak


def crash_series(
    kind: str,
    group: str,
    targets: dict[str, str],
    samples: int,
    seed: int,
    settle: tuple[float, float],
    cap: float,
) -> dict[str, Any]:
    """Holder SIGKILL -> the waiter (blocked a random ``settle`` s) holds (``kill_series``)."""
    with fresh_lock(targets["amqp"], kind, 1, f"cr-{group}") as name:
        job = Job(kind, name, 1, targets, group, "hold")
        return {**kill_series(job, samples, settle, seed, cap), "cap_s": cap}


def crash(kinds: list[str], targets: dict[str, str], plan: Plan, log: Log) -> dict[str, Any]:
    """Per lock and settings group; the series that wait for an expiry run concurrently."""
    rng = random.Random(6)
    series = [
        (kind, group, samples, rng.randrange(1 << 30))
        for group, samples in plan.crash_groups.items()
        for kind in kinds  # nothing to tune: the default row says it all
        if not (group == "tuned" and KINDS[kind].tuned is None and "default" in plan.crash_groups)
    ]
    results: dict[tuple[str, str], dict[str, Any]] = {}

    def expiry(kind: str, group: str) -> float | None:
        return KINDS[kind].expiry[group == "tuned"]

    def run(kind: str, group: str, samples: int, seed: int) -> None:
        cap = plan.never_cap if (e := expiry(kind, group)) is None else 1.5 * e + 10.0
        args = (kind, group, targets, samples, seed, plan.crash_settle, cap)
        results[kind, group] = cell(log, f"crash {kind} {group}", crash_series, *args)
        results[kind, group]["settings"] = KINDS[kind].settings(group)

    slow = [s for s in series if (e := expiry(s[0], s[1])) is None or e >= 1.0]
    started = time.monotonic()
    for s in series:
        if s not in slow:
            run(*s)
    with ThreadPoolExecutor(max(1, len(slow))) as pool:
        list(pool.map(lambda s: run(*s), slow))
    out: dict[str, Any] = {"wall_s": round(time.monotonic() - started, 1), "rows": {}}
    for kind, group, _, _ in series:
        out["rows"].setdefault(kind, {})[group] = results[kind, group]
    return out


def run(url: str, plan: Plan, budget: Budget, log: Log) -> dict[str, Any]:
    """Every comparison, each peer against its own private server (started and stopped here)."""
    needed = {k.server for k in KINDS.values() if k.server and k.server != "amqp"}
    out: dict[str, Any] = {"plan": dataclasses.asdict(plan), "wall_s": {}}
    log(f"peers: starting private {', '.join(sorted(needed))} servers on loopback")
    with (
        tempfile.TemporaryDirectory(prefix="amqp-locks-bench-peers-") as scratch,
        running(needed, log) as srv,
    ):
        tmp = Path(scratch)
        targets = {**srv.urls, "amqp": url, "files": str(tmp / "files")}
        kinds = available(targets)
        out.update(
            servers=srv.versions,
            server_settings=srv.settings,
            missing_servers=srv.missing,
            kinds=kinds,
            libraries={k: version(KINDS[k].library) for k in kinds},
        )
        pg = srv.urls.get("postgresql")
        phases: dict[str, Callable[[], Any]] = {
            "uncontended": lambda: uncontended(kinds, targets, budget, log=log),
            "lockers": lambda: uncontended_lockers(url, pg, tmp, budget, log),
            "handoff": lambda: handoff(kinds, targets, plan, log),
            "throughput": lambda: throughput(kinds, targets, plan, log),
            "crash": lambda: crash(kinds, targets, plan, log),
        }
        for label, phase in phases.items():
            log(f"peers: {label}")
            t0 = time.monotonic()
            out[label] = phase()
            out["wall_s"][label] = round(time.monotonic() - t0, 1)
    return out


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
