"""CPU time of the client, the holders and the broker, so latency can be explained as work.

On a 2-core machine the broker and the client share the CPUs: a search that sends
thousands of pipelined probes is bounded by the CPU both sides spend per probe, not by
network round trips. Linux-only (/proc); elsewhere the figures are NaN.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu(pid: int | None) -> float:
    """User+system CPU seconds of process ``pid`` (all threads), NaN if unknown."""
    if pid is None:
        return math.nan
    if pid == os.getpid():
        return time.process_time()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _TICK


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
    if pid_file is None:
        return None
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def system_busy() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat), NaN if unknown."""
    line = _read_first_line("/proc/stat")
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


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline()
    except OSError:
        return ""


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
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime stime cutime cstime: fields 14-17.
    return sum(int(x) for x in fields[11:15]) / _TICK
