"""Start a worker process that takes a lock and says so (``HELD <int> ...`` on stdout)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

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
