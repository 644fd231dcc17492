"""Start a worker process that takes a lock and says so (``HELD <int> ...`` on stdout);
freeze a process and know it is frozen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This environment, with the checkout's ``src`` and root importable."""
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def spawn_held(
    module: str, *args: str, popen: Callable[..., subprocess.Popen[str]] = subprocess.Popen
) -> tuple[subprocess.Popen[str], list[int]]:
    """Run ``python -m module *args`` (stdin and stdout piped) until it prints its first
    line, which must start with ``HELD``; return the process and that line's numbers.
    `popen` starts it (e.g. a partition harness's ``run_in_namespace``); a process that
    does not say ``HELD`` is killed."""
    p = popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline().split()
        assert line[:1] == ["HELD"], line
        return p, [int(x) for x in line[1:]]
    except BaseException:
        p.kill()
        p.wait(30)
        raise


def run_script(
    name: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<name> *args`` to the end (two minutes at most) and return what it
    printed, whatever its exit status."""
    return subprocess.run(
        [str(ROOT / "scripts" / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def stopped(pid: int) -> bool:
    """Every thread of process `pid` is stopped (SIGSTOP: state T)."""
    states = [
        (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        for task in Path(f"/proc/{pid}/task").iterdir()
    ]
    return all(state in "Tt" for state in states)


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process `pid` and wait until every thread of it has stopped: ``kill``
    returns once the signal is queued, and a thread running on the other core (or a
    vCPU the host has descheduled) can go on for a moment. CI, 4.3.6: a holder frozen
    so still answered a "who holds it?" query sent right after the kill."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: stopped(pid), timeout, f"process {pid} stopped")
