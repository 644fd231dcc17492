"""Percentiles and the "median over repetitions" summaries every table reports, and the
CPU time of the client, the holders and the broker, so latency can be explained as work.

A single run's p99 is noisy on a shared 2-core machine; each measurement is therefore
repeated and we report the median of the per-repetition p50s and p99s (and keep them all).

On a 2-core machine the broker and the client share the CPUs: a search that sends
thousands of pipelined probes is bounded by the CPU both sides spend per probe, not by
network round trips. CPU figures are Linux-only (/proc); elsewhere they are NaN.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not samples:
        return math.nan
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded to microseconds (enough for every figure we print)."""
    return round(seconds * 1000.0, 3)


def summarize_reps(reps: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Summary of repeated latency samples (seconds in, milliseconds out).

    ``p50_ms``/``p99_ms`` are medians over the repetitions; ``*_reps`` show the spread.
    """
    reps = [r for r in reps if r]
    if not reps:
        return {"n": 0, "reps": 0, "p50_ms": math.nan, "p99_ms": math.nan}
    p50s = [percentile(r, 50) for r in reps]
    p99s = [percentile(r, 99) for r in reps]
    pooled = [x for r in reps for x in r]
    return {
        "n": len(pooled),
        "reps": len(reps),
        "p50_ms": ms(statistics.median(p50s)),
        "p99_ms": ms(statistics.median(p99s)),
        "p50_reps_ms": [ms(x) for x in p50s],
        "p99_reps_ms": [ms(x) for x in p99s],
        "mean_ms": ms(statistics.fmean(pooled)),
        "min_ms": ms(min(pooled)),
        "max_ms": ms(max(pooled)),
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def fairness(per_process: Sequence[int]) -> dict[str, Any]:
    """How evenly grants were spread over processes.

    Jain's index (sum x)^2 / (n * sum x^2) is 1 when all got the same and 1/n when one
    process got everything; CV is the population standard deviation over the mean.
    """
    xs = list(per_process)
    total = sum(xs)
    if not xs or total == 0:
        return {"min": 0, "max": 0, "cv": math.nan, "jain": math.nan, "idle": len(xs)}
    mean = statistics.fmean(xs)
    return {
        "min": min(xs),
        "max": max(xs),
        "cv": round(statistics.pstdev(xs) / mean, 3),
        "jain": round(total**2 / (len(xs) * sum(x * x for x in xs)), 3),
        "idle": sum(1 for x in xs if x == 0),  # processes that never got the lock
    }


def fairness_summary(
    per_process: list[list[tuple[float, float]]], bound_x: float = 3.0
) -> dict[str, Any]:
    """Jain's index over grants per process; waits (ms, from (called, returned) pairs), the
    max over the median, how many waits exceed ``bound_x`` x the median and when the worst
    began (seconds into the run: a start-up effect or a stall)."""
    grants = [len(w) for w in per_process]
    waits = [t1 - t0 for w in per_process for t0, t1 in w]
    if not waits:
        none = dict.fromkeys(("wait_p50_ms", "wait_max_ms", "wait_max_over_median"))
        return {
            "grants": grants,
            **fairness(grants),
            **none,
            "waits_over_bound": None,
            "wait_max_at_s": None,
            "waits": summarize_reps([waits]),
        }
    med, worst = statistics.median(waits), max(waits)
    worst_at = next(t0 for w in per_process for t0, t1 in w if t1 - t0 == worst)
    return {
        "grants": grants,
        **fairness(grants),
        "wait_p50_ms": ms(med),
        "wait_max_ms": ms(worst),
        "wait_max_over_median": round(worst / med, 2) if med > 0 else None,
        "waits_over_bound": sum(1 for w in waits if w > bound_x * med),
        "wait_max_at_s": round(worst_at - min(t0 for w in per_process for t0, _ in w), 3),
        "waits": summarize_reps([waits]),
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
    if pid is None:
        return math.nan
    if pid == os.getpid():
        return time.process_time()
    cpu = _stat(pid, 11, 12)
    return math.nan if cpu is None else cpu


@dataclass
class CpuMeter:
    """CPU seconds spent by a few processes between :meth:`start` and :meth:`stop`."""

    pids: dict[str, int | None]

    def start(self) -> None:
        self._t0 = {k: process_cpu(p) for k, p in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {k: process_cpu(p) - self._t0[k] for k, p in self.pids.items()}


def beam_pid(pid_file: Path | None) -> int | None:
    """The RabbitMQ VM's pid from the node's pid file (None for an external broker)."""
    try:
        return int(pid_file.read_text().strip()) if pid_file is not None else None
    except (OSError, ValueError):
        return None


def system_busy() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat), NaN if unknown."""
    try:
        with open("/proc/stat") as f:
            line = f.readline()
    except OSError:
        return math.nan
    if not line.startswith("cpu "):
        return math.nan
    v = [int(x) for x in line.split()[1:]]
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
    return (sum(v[:8]) - v[3] - v[4]) / _TICK


def own_cpu() -> float:
    """CPU seconds of this process and its reaped children (benchmark workers, tools)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def forkserver_cpu() -> float:
    """CPU seconds of the multiprocessing forkserver and the workers it forked and reaped.

    Forkserver workers are not our children, so ``own_cpu`` misses them; their parent
    (the forkserver) reaps them, so its cutime/cstime hold their CPU. 0 if none runs.
    """
    try:
        from multiprocessing import forkserver

        pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return 0.0
    return (_stat(pid, 11, 14) or 0.0) if pid else 0.0
