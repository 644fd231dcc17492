"""Holder processes for fault runs, and the process faults the test inflicts on them.

A holder is a spawned process with its own `Broker` (so its own connection and I/O thread)
that loops: acquire, record ``grant``, register its fencing token at the protected
resources (the first write), then work in *units* — check ``lease.lost``, work for
``unit`` seconds, write the unit's result with its token — until its hold time is over,
it is told to stop, or the lease is lost; then it records ``release`` and releases.

The write at the end of a unit is deliberately not preceded by a second ``lost`` check:
it is the commit of work done *during* the unit, and a process paused mid-unit resumes
straight into it. That is the case fencing exists for, and the pause scenarios rely on it.

``lost`` is recorded by the lease's ``on_lost`` callback, stamped with the instant the
library marked the lease lost on its I/O thread (seen through `amqp_locks.events`), so
the time is when the application could first know, not when a helper thread got to run.

The parent (:class:`Holder`) pauses (SIGSTOP), resumes (SIGCONT) and kills (SIGKILL) the
process by pid. Before a kill it freezes the holder, records ``killed`` for every grant
the holder still believes in, and only then kills: nothing can be granted in between.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .history import Recorder, load, open_grants


@dataclass(frozen=True)
class HolderSpec:
    worker: str
    url: str
    kind: str
    name: str
    history: str
    #: Addresses of served ProtectedResources; every write goes to each of them.
    resources: tuple[str, ...]
    stop_file: str
    log_file: str
    heartbeat: float = 2.0
    #: Seconds to hold each grant (None: until lost or stopped).
    hold: float | None = None
    #: Grants of this key (slot number) are held until lost or stopped, whatever `hold`
    #: says: a scenario that must find the key held when it strikes.
    hold_key: int | None = None
    #: Grants before exiting by itself (None: until stopped).
    rounds: int | None = None
    unit: float = 0.1
    #: Timeout of each acquire call (None: wait until granted or told to stop).
    acquire_timeout: float | None = None
    #: Pause between a release and the next acquire (lets others in).
    rest: float = 0.0


def holder_main(spec: HolderSpec) -> None:
    """The holder process (spawned): see the module docstring."""
    logging.basicConfig(
        filename=spec.log_file,
        level=logging.INFO,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    try:
        _run(spec)
    except BaseException:
        logging.getLogger("holder").error(
            "holder %s failed:\n%s", spec.worker, traceback.format_exc()
        )
        raise


class _Stop(BaseException):
    """Raised by SIGUSR1 inside a waiting acquire (which cancels the acquire cleanly)."""


def _run(spec: HolderSpec) -> None:
    from amqp_locks import AmqpLocksError, Broker, events

    from . import primitives
    from .resource import ResourceClient

    log = logging.getLogger("holder")
    rec = Recorder(spec.history)
    clients = [ResourceClient(a) for a in spec.resources]
    event_kind = primitives.EVENT_KIND[spec.kind]
    lost_seen: list[float] = []
    flags = {"stop": False, "acquiring": False}

    def on_event(ev: Any) -> None:  # on the I/O thread, right after lease.lost was set
        if ev.type == "lost" and ev.kind == event_kind and ev.name == spec.name:
            lost_seen.append(time.monotonic())

    def on_stop(signum: int, frame: Any) -> None:
        flags["stop"] = True
        if flags["acquiring"]:
            raise _Stop

    events.subscribe(on_event)
    signal.signal(signal.SIGUSR1, on_stop)
    Path(spec.stop_file + ".ready").touch()  # SIGUSR1 is safe to send from now on

    def stopped() -> bool:
        return flags["stop"] or os.path.exists(spec.stop_file)

    def write(gid: str, key: int, token: int) -> None:
        for c in clients:
            c.write(gid, key, token)

    broker = Broker(spec.url, heartbeat=spec.heartbeat)
    lock = primitives.lock(spec.kind, broker, spec.name)
    n = 0
    while not stopped() and (spec.rounds is None or n < spec.rounds):
        failure: AmqpLocksError | None = None
        try:
            flags["acquiring"] = True
            lease = lock.acquire(timeout=spec.acquire_timeout)
        except _Stop:
            break
        except AmqpLocksError as exc:  # broker down or unreachable: try again
            failure = exc
        finally:
            flags["acquiring"] = False
        if failure is not None:
            # Outside the try: a SIGUSR1 here only sets the flag (raising _Stop from an
            # except block's back-off escaped the loop and failed the holder's exit code).
            log.info("acquire failed: %s", failure)
            time.sleep(0.2)
            continue
        if lease is None:
            continue
        gid, key, token = f"{spec.worker}#{n}", lease.number, lease.fencing_token
        n += 1
        granted_at = rec.record("grant", gid, key, token).t

        def lost(
            lease: Any,
            gid: str = gid,
            key: int = key,
            token: int = token,
            since: float = granted_at,
        ) -> None:
            seen = [t for t in lost_seen if t >= since]
            at = seen[0] if seen else time.monotonic()
            rec.record("lost", gid, key, token, str(lease.lost_reason), t=max(at, since))

        lease.on_lost(lost)
        write(gid, key, token)  # register the token at the resource right after the grant
        until = None if spec.hold is None or key == spec.hold_key else time.monotonic() + spec.hold
        while not lease.lost.is_set() and not stopped():
            if until is not None and time.monotonic() >= until:
                break
            time.sleep(spec.unit)  # the work; a pause lands here and resumes into the write
            write(gid, key, token)
        if not lease.lost.is_set():
            rec.record("release", gid, key, token)
        try:
            lease.release()
        except AmqpLocksError as exc:
            log.info("release failed: %s", exc)
        if spec.rest and not stopped():
            time.sleep(spec.rest)
    broker.close()  # also releases a lease an interrupted acquire got after all
    for c in clients:
        c.close()
    rec.close()


@dataclass
class Holder:
    """The parent's handle on one holder process."""

    spec: HolderSpec
    process: Any = None
    paused: bool = False
    faults: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> Holder:
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=holder_main, args=(self.spec,), name=self.spec.worker)
        self.process.start()
        return self

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert isinstance(pid, int)
        return pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def pause(self) -> float:
        """SIGSTOP: the holder freezes mid-whatever (a GC pause, a VM freeze)."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_stopped(self.pid)
        self.paused = True
        t = time.monotonic()
        self.faults.append((t, "pause"))
        return t

    def pause_mid_unit(self, timeout: float = 10.0) -> float:
        """SIGSTOP while the holder's main thread sleeps in a unit of work (read from
        /proc: it is in clock_nanosleep), so it resumes straight into the unit's write."""
        deadline = time.monotonic() + timeout
        while True:
            t = self.pause()
            if _main_thread_sleeping(self.pid):
                return t
            self.resume()
            if time.monotonic() > deadline:
                raise TimeoutError(f"holder {self.spec.worker} never caught mid-unit")
            time.sleep(0.01)

    def resume(self) -> float:
        """SIGCONT; the time is read before the signal, so every write of the resumed
        process is later (read after it, the holder's first write once beat the read:
        rehearsal 18, a refused stale write not counted as stale)."""
        t = time.monotonic()
        os.kill(self.pid, signal.SIGCONT)
        self.paused = False
        self.faults.append((t, "resume"))
        return t

    def kill(self, recorder: Recorder) -> float:
        """Freeze, record ``killed`` for what it believes it holds, SIGKILL, reap."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_stopped(self.pid)
        t = time.monotonic()
        for g in open_grants(load(recorder.path), f"{self.spec.worker}#"):
            recorder.record("killed", g.grant, g.key, g.token, "SIGKILL", t=t)
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)
        self.paused = False
        self.faults.append((t, "kill"))
        return t

    def stop(self) -> None:
        """Ask the holder to release and exit: SIGUSR1 interrupts a waiting acquire; a
        holder sees the flag (and the stop file) between units."""
        Path(self.spec.stop_file).touch()
        if Path(self.spec.stop_file + ".ready").exists():  # else it sees the file first
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGUSR1)
        if self.paused:
            self.resume()

    def join(self, timeout: float) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode  # type: ignore[no-any-return]

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(Path(self.spec.log_file).read_text().splitlines()[-lines:])
        return ""

    def terminate(self) -> None:
        """Last resort at teardown: SIGKILL this holder (by its pid) if still running."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.process.join(10)


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Return once every thread of `pid` is stopped (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [
                (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                for task in Path(f"/proc/{pid}/task").iterdir()
            ]
        except OSError:
            return  # gone
        if all(s in "tTZX" for s in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop within {timeout}s")


#: x86_64 syscall numbers of nanosleep and clock_nanosleep (what time.sleep blocks in).
_SLEEP_SYSCALLS = {"35", "230"}


def _main_thread_sleeping(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] in _SLEEP_SYSCALLS
    except (OSError, IndexError):
        return False
