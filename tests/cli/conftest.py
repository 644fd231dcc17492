"""Helpers for driving the real `amqp-locks` command in subprocesses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from amqp_locks_dev import devbroker

from .. import waiting

CMD = [sys.executable, "-m", "amqp_locks.cli"]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AMQP_URL"}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"  # a child killed by SIGABRT prints every thread's stack
    env.update(extra)
    return env


#: tgkill(2)'s number, by machine (the stdlib sends thread-directed signals to its own
#: process's threads only).
_TGKILL = {"x86_64": 234, "aarch64": 131}


def signal_a_thread(pid: int, sig: int, timeout: float = 10.0) -> int:
    """Send `sig` to one thread of process `pid` other than its main thread, one that does
    not block it (as the kernel may hand a signal sent to the process to such a thread when
    the main thread cannot take it at once); returns that thread's id. Waits up to `timeout`
    for such a thread (one the program is about to start: a service says "master" before
    its work thread runs). The way to show that a program acts on a signal whichever of its
    threads the kernel gives it to."""
    import ctypes
    import errno

    number = _TGKILL.get(os.uname().machine)
    if number is None:
        pytest.skip(f"tgkill's number on {os.uname().machine} is not known here")
    libc = ctypes.CDLL(None, use_errno=True)
    bit = 1 << (sig - 1)

    def signal_one() -> int | None:
        for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
            if tid == pid:
                continue
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except FileNotFoundError:
                continue  # it ended meanwhile
            line = next(x for x in status.splitlines() if x.startswith("SigBlk:"))
            if int(line.split()[1], 16) & bit:
                continue
            if libc.syscall(number, pid, tid, sig) == 0:
                return tid
            if ctypes.get_errno() != errno.ESRCH:  # ESRCH: it ended meanwhile
                raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig})")
        return None

    tid: int = waiting.wait_until(
        signal_one,
        timeout,
        f"a thread of process {pid} besides its main one that takes {sig}",
        step=0.02,
    )
    return tid


@dataclass
class Proc:
    """A running `amqp-locks` with its stdout/stderr lines readable as they come.

    Each stream is read on a thread of its own, so the order in which lines of the two
    streams arrive here is not the order the process wrote them: :meth:`expect` reads one
    stream past a cursor of its own and never consumes the other's lines."""

    popen: subprocess.Popen[str]
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)
    _read: dict[str, int] = field(default_factory=lambda: {"out": 0, "err": 0})
    _arrived: threading.Condition = field(default_factory=threading.Condition)

    def _pump(self, stream: IO[str], which: str) -> None:
        for line in stream:
            with self._arrived:
                (self.out if which == "out" else self.err).append(line.rstrip("\n"))
                self._arrived.notify_all()

    def start_pumps(self) -> None:
        assert self.popen.stdout is not None and self.popen.stderr is not None
        for stream, which in ((self.popen.stdout, "out"), (self.popen.stderr, "err")):
            t = threading.Thread(target=self._pump, args=(stream, which), daemon=True)
            t.start()
            self.pumps.append(t)

    def expect(self, text: str, timeout: float = 20.0, which: str = "out") -> str:
        """Wait for the next line of `which` (stdout by default) containing `text`, after
        those an earlier expect on that stream read; fail after timeout."""
        lines = self.out if which == "out" else self.err
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                while self._read[which] < len(lines):
                    line = lines[self._read[which]]
                    self._read[which] += 1
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no line with {text!r} within {timeout}s; out={self.out} err={self.err}"
                    )
                self._arrived.wait(left)

    def finish(self, timeout: float = 30.0) -> tuple[int, str, str]:
        """Wait for the exit and for EOF on both streams: (status, stdout, stderr). One that
        does not exit in time fails with its stderr and every thread's stack (SIGABRT:
        faulthandler, on in :func:`child_env`), so a hang says where it hung."""
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
            for t in self.pumps:
                t.join(5)
            err = "\n".join(self.err)
            raise AssertionError(
                f"{self.popen.args} did not exit within {timeout}s; its stderr, then its "
                f"threads' stacks (SIGABRT):\n{err}"
            ) from None
        for t in self.pumps:
            t.join(5)
        return rc, "\n".join(self.out), "\n".join(self.err)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


class Cli:
    """Runs `amqp-locks --url URL ...` against the test broker."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.procs: list[Proc] = []

    def argv(self, args: Sequence[str]) -> list[str]:
        # A short heartbeat also shortens Broker.close (its watchdog ticks every
        # heartbeat/10, at most 1 s, and close waits for the tick).
        return [*CMD, "--url", self.url, "--heartbeat", "3", *args]

    def run(
        self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or child_env(),
            stdin=subprocess.DEVNULL,
            **kw,
        )

    def run_many(self, *commands: Sequence[str]) -> list[subprocess.CompletedProcess[str]]:
        """Run independent commands at once (each CLI call costs a process start)."""
        popens = [
            subprocess.Popen(
                self.argv(args),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                env=child_env(),
            )
            for args in commands
        ]
        results = []
        for args, p in zip(commands, popens, strict=True):
            out, err = p.communicate(timeout=60)
            results.append(subprocess.CompletedProcess(args, p.returncode, out, err))
        return results

    def start(self, *args: str, env: dict[str, str] | None = None) -> Proc:
        popen = subprocess.Popen(
            self.argv(args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env or child_env(),
        )
        p = Proc(popen)
        p.start_pumps()
        self.procs.append(p)
        return p

    def cleanup(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def cli(amqp_url: str) -> Iterator[Cli]:
    c = Cli(amqp_url)
    yield c
    c.cleanup()


def close_connections_of(node: devbroker.NodeInfo, pid: int) -> int:
    """Close (from the broker's side) every connection whose name says `pid=<pid>`."""
    listing = devbroker.rabbitmqctl(
        node, "list_connections", "pid", "client_properties", "--no-table-headers", "-q"
    )
    closed = 0
    for line in listing.splitlines():
        if f'pid={pid}"' in line:
            conn = line.split("\t", 1)[0]
            devbroker.rabbitmqctl(node, "close_connection", conn, "test: connection closed")
            closed += 1
    return closed
