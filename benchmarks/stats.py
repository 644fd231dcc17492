"""How every figure is taken: the timing loop, percentiles and the median over repetitions
of each repetition's p50 / p99, fairness, CPU time (Linux /proc; NaN elsewhere), and the
fresh locks the measurements of ours run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiormq

from amqp_locks import Broker, SemaphoreAdmin, TokenSemaphore
from amqp_locks.names import fence_queue, sentinel_queue, wakeup_queue

from .peers.kinds import OURS


@dataclass
class Budget:
    """How much to measure per cell: repetitions, a sample cap and a time cap per rep."""

    reps: int
    max_samples: int
    seconds: float = math.inf
    warmup: int = 5


def timed(
    sample: Callable[[], Any], budget: Budget, start: Callable[[], Any] | None = None
) -> list[list[Any]]:
    """``budget.warmup`` untimed samples, ``start()``, then ``budget.reps`` repetitions of at
    most ``max_samples`` (at least one; no more once ``seconds`` have passed). ``sample()``
    returns its time(s); None is a miss (e.g. ``basic.get-empty``), taken again."""
    for _ in range(budget.warmup):
        sample()
    if start is not None:
        start()
    out: list[list[Any]] = []
    for _ in range(budget.reps):
        rep: list[Any] = []
        end = time.monotonic() + budget.seconds
        while len(rep) < budget.max_samples and (not rep or time.monotonic() < end):
            if (x := sample()) is not None:
                rep.append(x)
        out.append(rep)
    return out


def clocked(fn: Callable[[], Any]) -> Callable[[], float]:
    """``fn`` as a sample for :func:`timed`: the seconds one call takes."""

    def sample() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return sample


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not samples:
        return math.nan
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded to microseconds (enough for every figure we print)."""
    return round(seconds * 1000.0, 3)


def summarize_reps(reps: Sequence[Sequence[float]], samples: bool = False) -> dict[str, Any]:
    """Repeated latency samples (seconds) in milliseconds: ``p50_ms``/``p99_ms`` are medians
    over the repetitions, ``p50_reps_ms`` their spread; ``samples``: every sample too."""
    reps = [r for r in reps if r]
    pooled = [x for r in reps for x in r]
    out: dict[str, Any] = {"samples_ms": [ms(x) for x in pooled]} if samples else {}
    if not reps:
        return {"n": 0, "reps": 0, "p50_ms": math.nan, "p99_ms": math.nan, **out}
    p50s = [percentile(r, 50) for r in reps]
    return {
        "n": len(pooled),
        "reps": len(reps),
        "p50_ms": ms(statistics.median(p50s)),
        "p99_ms": ms(statistics.median(percentile(r, 99) for r in reps)),
        "p50_reps_ms": [ms(x) for x in p50s],
        "min_ms": ms(min(pooled)),
        "max_ms": ms(max(pooled)),
        **out,
    }


def brief(s: dict[str, Any]) -> str:
    """A log line's worth of a measurement's summary."""
    if "error" in s:
        return f"ERROR {s['error']}"
    if "acquire" in s:
        return f"acquire {brief(s['acquire'])}, release {brief(s['release'])}"
    keys = ("p50_ms", "p99_ms", "n", "grants_per_s", "jain", "overlaps", "censored", "errors")
    return " ".join(
        f"{k}={s[k]:.4g}" if isinstance(s[k], float) else f"{k}={s[k]}" for k in keys if k in s
    )


def fairness(per_process: Sequence[int]) -> dict[str, Any]:
    """How evenly grants were spread: Jain's index (sum x)^2 / (n * sum x^2) is 1 when all got
    the same and 1/n when one got everything; CV is the population stddev over the mean."""
    xs, total = list(per_process), sum(per_process)
    if not xs or total == 0:
        return {"min": 0, "max": 0, "cv": math.nan, "jain": math.nan, "idle": len(xs)}
    return {
        "min": min(xs),
        "max": max(xs),
        "cv": round(statistics.pstdev(xs) / statistics.fmean(xs), 3),
        "jain": round(total**2 / (len(xs) * sum(x * x for x in xs)), 3),
        "idle": xs.count(0),  # processes that never got the lock
    }


def fairness_summary(per_process: list[list[tuple[float, float]]]) -> dict[str, Any]:
    """Jain's index over grants per process; waits (ms, from (called, returned) pairs), the
    max over the median, how many waits exceed 3 x the median and when the worst began
    (seconds into the run: a start-up effect or a stall)."""
    grants = [len(w) for w in per_process]
    waits = [(t1 - t0, t0) for w in per_process for t0, t1 in w]
    out = {"grants": grants, **fairness(grants), "waits": summarize_reps([[w for w, _ in waits]])}
    if not waits:
        keys = ("wait_p50_ms", "wait_max_ms", "wait_max_over_median", "waits_over_bound")
        return {**out, **dict.fromkeys(keys), "wait_max_at_s": None}
    med, (worst, worst_at) = statistics.median(w for w, _ in waits), max(waits, key=lambda x: x[0])
    return {
        **out,
        "wait_p50_ms": ms(med),
        "wait_max_ms": ms(worst),
        "wait_max_over_median": round(worst / med, 2) if med > 0 else None,
        "waits_over_bound": sum(1 for w, _ in waits if w > 3 * med),
        "wait_max_at_s": round(worst_at - min(t0 for _, t0 in waits), 3),
    }


# ----------------------------------------------------------------------------- CPU

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int, first: int, last: int) -> float | None:
    """CPU seconds in fields ``first``..``last`` (0-based after the state field) of
    /proc/PID/stat: 11-12 utime and stime, 13-14 the reaped children's; None if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(x) for x in fields[first : last + 1]) / _TICK


def process_cpu(pid: int | None) -> float:
    """User+system CPU seconds of process ``pid`` (all threads), NaN if unknown."""
    if pid == os.getpid():
        return time.process_time()
    cpu = None if pid is None else _stat(pid, 11, 12)
    return math.nan if cpu is None else cpu


@dataclass
class CpuMeter:
    """CPU seconds spent by a few processes between :meth:`start` and :meth:`stop`."""

    pids: dict[str, int | None]

    def start(self) -> None:
        self.t0 = {k: process_cpu(p) for k, p in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {k: process_cpu(p) - self.t0[k] for k, p in self.pids.items()}


def system_busy() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat), NaN if unknown."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return math.nan
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
    return (sum(v[:8]) - v[3] - v[4]) / _TICK


def own_cpu() -> float:
    """CPU seconds of this process, its reaped children (tools) and of the forkserver's
    workers: they are not our children, but the forkserver reaps them."""
    me, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    try:
        from multiprocessing import forkserver

        pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        pid = None
    workers = (_stat(pid, 11, 14) or 0.0) if pid else 0.0
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + workers


# ---------------------------------------------------------------------------- locks


def unique_name(kind: str) -> str:
    """A lock name no earlier (possibly crashed) run left queues under."""
    return f"bench-{kind}-{uuid.uuid4().hex[:8]}"


def delete_queues(url: str, names: list[str]) -> None:
    """Remove benchmark leftovers (a mutex's fence queue has no admin API), in raw aiormq."""

    async def delete() -> None:
        conn = await aiormq.connect(url)
        try:
            ch = await conn.channel()
            for name in names:
                try:
                    await ch.queue_delete(name)
                except aiormq.exceptions.AMQPError:  # e.g. another connection's exclusive queue
                    ch = await conn.channel()
        finally:
            await conn.close()

    with contextlib.suppress(Exception):
        asyncio.run(delete())


def leftovers(name: str) -> list[str]:
    """The queues a mutex or persistent semaphore ``name`` leaves besides its own."""
    helpers = [f(name, k) for f in (sentinel_queue, wakeup_queue) for k in ("mutex", "sem")]
    return [name, fence_queue(name), *helpers]


@contextlib.contextmanager
def fresh_lock(url: str, kind: str, slots: int = 1, tag: str = "ho") -> Iterator[str]:
    """A new lock name for ``kind``; for ours (``*token*``, ``*semaphore``, else a mutex;
    ``*quorum``: a quorum token queue) the lock is created with ``slots`` permits first, and
    its queues removed afterwards."""
    name = unique_name(f"{tag}-{kind.replace('_', '-')}")
    ours = kind in OURS or kind.startswith("ours_")
    token, quorum, sem = "token" in kind, kind.endswith("quorum"), kind.endswith("semaphore")
    if ours and (token or sem):
        with Broker(url) as broker:
            if token:
                TokenSemaphore(broker, name, quorum=quorum).setup(slots)
            else:
                SemaphoreAdmin(broker, name).create(slots)
    try:
        yield name
    finally:
        if ours:
            with contextlib.suppress(Exception), Broker(url) as broker:
                if token:
                    TokenSemaphore(broker, name, quorum=quorum).destroy()
                elif sem:
                    SemaphoreAdmin(broker, name).destroy(purge_fence=True)
            delete_queues(url, leftovers(name))
