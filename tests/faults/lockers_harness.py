"""Running master/standby worker processes against a protected resource and judging the run.

A :class:`Run` owns one scenario: the shared history file, the served protected resource,
and the :class:`Worker` processes (``tests/faults/lockers_worker.py``). The test drives
faults by PID (kill, pause, resume) or through a :class:`~tests.faultproxy.FaultProxy`, and
:meth:`Run.finish` stops every worker, loads the history and returns the checker's verdict.

:func:`leak_check` is issue 7's (c): after the run a fresh locker must take the lock within
the locker's documented detection time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from amqp_locks.errors import BrokerError
from amqp_locks.lockers import LockedElsewhere, Locker

from ..waiting import wait_until
from .checker import Verdict, check, intervals
from .history import Event, Recorder, load
from .holders import wait_stopped
from .lockers_worker import make_locker
from .resource import ProtectedResource

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """One worker process and the lines it printed (read on a thread, timestamped)."""

    def __init__(self, run: Run, who: str, cfg: dict[str, Any]) -> None:
        self.run = run
        self.who = who
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
        self.stderr_path = run.dir / f"{who}.log"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in reap()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.lockers_worker", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.pid = self.proc.pid
        self.lines: list[tuple[float, list[str]]] = []
        self._cond = threading.Condition()
        self.current_grant: str | None = None
        self.paused = False
        self.dead = False
        #: (paused at, resumed at) of every pause; resumed at is inf while paused.
        self.pauses: list[tuple[float, float]] = []
        #: Every grant id this process printed.
        self.granted: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"read-{who}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            with self._cond:
                self.lines.append((time.monotonic(), parts))
                if parts and parts[0] == "MASTER":
                    self.current_grant = parts[1]
                    self.granted.append(parts[1])
                elif parts and parts[0] == "DEMOTED":
                    self.current_grant = None
                self._cond.notify_all()
        with self._cond:
            self.lines.append((time.monotonic(), ["EOF"]))
            self._cond.notify_all()

    def count(self, word: str) -> int:
        with self._cond:
            return sum(1 for _, p in self.lines if p and p[0] == word)

    def wait_for(self, word: str, timeout: float, nth: int = 1) -> tuple[float, list[str]]:
        """The `nth` line starting with `word` (time seen, words); AssertionError on timeout
        or if the process ended first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                seen = [(t, p) for t, p in self.lines if p and p[0] == word]
                if len(seen) >= nth:
                    return seen[nth - 1]
                if any(p == ["EOF"] for _, p in self.lines):
                    raise AssertionError(
                        f"{self.who} ended before printing {word} #{nth}: {self.tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{self.who}: no {word} #{nth} within {timeout}s; lines {self.lines}; "
                        f"log: {self.tail()}"
                    )
                self._cond.wait(min(left, 0.1))

    def is_master(self) -> bool:
        with self._cond:
            return self.current_grant is not None

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text(errors="replace")[-n:]
        return ""

    # --- faults (by PID; only our own child) -------------------------------------------

    def kill(self) -> float:
        """SIGKILL; records `killed` for the grant it held. Returns the kill's time."""
        if self.paused:
            os.kill(self.pid, signal.SIGCONT)  # harmless: SIGKILL wins either way
        os.kill(self.pid, signal.SIGKILL)
        t = time.monotonic()
        if self.paused:
            self.pauses[-1] = (self.pauses[-1][0], t)
            self.paused = False
        self.proc.wait(10)
        self.dead = True
        with self._cond:
            grant = self.current_grant
            self.current_grant = None
        if grant is not None:
            self.run.recorder.record("killed", grant, 0, 0, t=t)
        return t

    def pause(self) -> float:
        os.kill(self.pid, signal.SIGSTOP)
        self.paused = True
        t = time.monotonic()
        self.pauses.append((t, float("inf")))
        return t

    def pause_mid_unit(self, timeout: float = 30.0) -> float:
        """Have the master stop itself in the middle of a unit of work, after the unit's
        decision and before its result is written: resumed, it writes before it can notice
        anything, every time. A pause by PID lands anywhere: inside a write's round trip,
        the resumed process checked its stop event next, found it set by its own keep-alive
        and wrote nothing (rehearsal 46: stale_accepted 0 in the unfenced pause). The
        holder scenarios' `pause_mid_unit` (holders.py) finds the moment from outside, in
        /proc; here the unit runs on the service's work thread, so the worker stops itself."""
        assert self.proc.stdin is not None
        asked = self.count("PAUSING")
        self.proc.stdin.write("PAUSE\n")
        self.proc.stdin.flush()
        self.wait_for("PAUSING", timeout, nth=asked + 1)
        wait_stopped(self.pid, timeout)
        self.paused = True
        t = time.monotonic()
        self.pauses.append((t, float("inf")))
        return t

    def resume(self) -> float:
        os.kill(self.pid, signal.SIGCONT)
        self.paused = False
        t = time.monotonic()
        self.pauses[-1] = (self.pauses[-1][0], t)
        return t

    def paused_between(self, start: float, end: float) -> bool:
        return any(p < end and r > start for p, r in self.pauses)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask it to stop cleanly (close stdin) and wait; kill it if it does not."""
        if self.dead:
            return
        if self.paused:
            self.resume()
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.who} did not stop within {timeout}s: {self.tail()}"
            ) from None
        self.dead = True
        self._reader.join(5)

    def reap(self) -> None:
        if not self.dead and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.dead = True
        self._stderr.close()


@dataclass
class Run:
    """One scenario's history, protected resource and workers."""

    dir: Path
    base_cfg: dict[str, Any]
    fencing: bool = True
    workers: list[Worker] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.history = self.dir / "history.jsonl"
        self.recorder = Recorder(self.history)
        self.resource = ProtectedResource(fencing=self.fencing)
        # Unix socket paths are short (108 bytes): not under pytest's deep tmp_path.
        import tempfile

        self._sockdir = tempfile.mkdtemp(prefix="lf-")
        self.address = self.resource.serve(Path(self._sockdir) / "r.sock")

    def spawn(self, who: str, **overrides: Any) -> Worker:
        cfg = {
            **self.base_cfg,
            **overrides,
            "who": who,
            "history": str(self.history),
            "resource": self.address,
        }
        w = Worker(self, who, cfg)
        self.workers.append(w)
        return w

    def master(self, timeout: float, exclude: tuple[Worker, ...] = ()) -> Worker:
        """Wait for one of the live workers (not `exclude`) to be master; return it."""

        def find() -> Worker | None:
            for w in self.workers:
                if w not in exclude and not w.dead and w.is_master():
                    return w
            return None

        found: Worker = wait_until(find, timeout, "a master")
        return found

    def events(self) -> list[Event]:
        """The run's history so far, every worker's, in file order."""
        return load(self.history)

    def grants(self) -> list[Event]:
        return [e for e in self.events() if e.kind == "grant"]

    def losses(self) -> list[float]:
        """When masters learnt they lost the lock (``lost`` events), in time order."""
        return [e.t for e in load(self.history) if e.kind == "lost"]

    def finish(self, leaked: int | None = None) -> Verdict:
        """Stop every worker cleanly, then judge the history and the resource's log."""
        errors: list[str] = []
        for w in self.workers:
            try:
                w.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        for w in self.workers:
            w.reap()
        self.resource.close()
        self.recorder.close()
        assert not errors, errors
        return self.verdict(leaked)

    def verdict(self, leaked: int | None = None) -> Verdict:
        events = load(self.history)
        return check(events, self.resource.log, permits=1, leaked=leaked)

    def close(self) -> None:
        for w in self.workers:
            w.reap()
        self.resource.close()
        self.recorder.close()
        import shutil

        shutil.rmtree(self._sockdir, ignore_errors=True)

    def report(self, label: str, verdict: Verdict, **figures: float | None) -> str:
        """One line per scenario for the log (`pytest -s` or the soak's output)."""
        extra = " ".join(
            f"{k}={'n/a' if v is None else f'{v * 1000:.0f}ms'}" for k, v in figures.items()
        )
        line = f"[{label}] {verdict.summary()} {extra}"
        print(line, flush=True)
        paths = [self.dir.parent / "lockers-faults-report.txt"]
        if os.environ.get("AMQP_LOCKS_FAULT_REPORT"):  # one file for a whole session
            paths.append(Path(os.environ["AMQP_LOCKS_FAULT_REPORT"]))
        for path in paths:
            with open(path, "a") as f:
                f.write(line + "\n")
        return line


@contextlib.contextmanager
def fresh_locker(cfg: dict[str, Any]) -> Iterator[Locker]:
    locker, broker = make_locker({**cfg, "fail_if_locked": True})
    try:
        yield locker
    finally:
        locker.close()
        if broker is not None:
            broker.close()


def lease_holder(cfg: dict[str, Any]) -> str | None:
    """Who the lease row names (lease lockers): None once every holder released it."""
    from sqlalchemy import create_engine, select
    from sqlalchemy.pool import NullPool

    from amqp_locks.lockers.sql import lease_table

    engine = create_engine(cfg["url"], poolclass=NullPool)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                select(lease_table.c.holder).where(lease_table.c.name == cfg["name"])
            ).first()
    finally:
        engine.dispose()
    return None if row is None else row[0]


def leak_check(cfg: dict[str, Any], within: float) -> tuple[int, float | None]:
    """(c): after every holder stopped cleanly, nothing is left held: a lease row names
    nobody, and a fresh locker (fail_if_locked) gets the lock within `within` seconds.

    Returns (leaked, seconds it took): leaked counts what was left held (0 or more).
    """
    leaked = 0
    if cfg["kind"] == "lease" and lease_holder(cfg) is not None:
        leaked += 1  # a clean stop clears the row: it did not
    t0 = time.monotonic()
    deadline = t0 + within
    with fresh_locker(cfg) as locker:
        while True:
            try:
                locker.start()
            except (LockedElsewhere, BrokerError, SQLAlchemyError):
                # Held, or its server not answering yet (a fail_if_locked locker raises
                # that as such): either way not free yet.
                if time.monotonic() > deadline:
                    return leaked + 1, None
                time.sleep(0.02)  # the lock's own detection time, polled
                continue
            took = time.monotonic() - t0
            locker.stop()
            return leaked, took


#: An overlap is excused by a pause of either holder that touched this window around it.
PAUSE_REACH = 5.0


def unexplained_overlaps(events: list[Event], workers: list[Worker]) -> list[str]:
    """Overlapping masterships of which neither holder was paused around the re-grant."""
    spans = intervals(events, max(e.t for e in events))
    owner = {g: w for w in workers for g in w.granted}
    bad = []
    for n, a in enumerate(spans):
        for b in spans[n + 1 :]:
            if b.start >= a.end:
                continue
            window = (b.start - PAUSE_REACH, min(a.end, b.end))
            if not any(owner[g.grant].paused_between(*window) for g in (a, b) if g.grant in owner):
                bad.append(f"{a.grant} [{a.start:.3f}, {a.end:.3f}] & {b.grant} @{b.start:.3f}")
    return bad
