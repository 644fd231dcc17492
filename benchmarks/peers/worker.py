"""The contender process of every multi-process measurement, whatever the lock (its
``kinds.make`` adapter, own connection), and the parent's side of it, :class:`Crew`.

Modes: ``chain`` (handoff: ask again only once *another* process got the lock), ``loop``
(until the deadline), ``hold`` (acquire once, keep it until killed). Each grant goes to the
parent as it happens, on CLOCK_MONOTONIC: ("grant", idx, acquire called, acquired, release
called, released). Workers are always ended with SIGKILL, as a crash-safe lock must allow.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from ..stats import summarize_reps
from .kinds import make

PRELOAD = [
    "amqp_locks",
    "amqp_locks.tokens",
    "amqp_locks.lockers",
    "sqlalchemy",
    "benchmarks",
    "benchmarks.peers.worker",
    "redis",
    "redis_lock",
    "kazoo.client",
    "kazoo.recipe.lock",
    "tooz.coordination",
    "tooz.drivers.redis",
    "tooz.drivers.pgsql",
    "tooz.drivers.zookeeper",
    "tooz.drivers.file",
    "psycopg",
    "filelock",
]


def context() -> Any:
    """The forkserver every worker comes from (a preload that is missing is skipped)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclass(frozen=True)
class Job:
    kind: str
    name: str
    slots: int
    targets: dict[str, str]
    group: str = "default"  # settings: default | tuned
    mode: str = "loop"  # chain | loop | hold
    hold: tuple[float, float] = (0.0, 0.0)  # seconds held, uniformly random
    seconds: float = 0.0


@dataclass
class Sync:
    """Shared between the parent and a run's workers (multiprocessing objects)."""

    out: Any  # Queue of messages to the parent
    go: Any  # Event: start
    stop: Any  # Event: stop asking
    start_at: Any  # Value("d"): monotonic start time, set before go
    grants: Any  # Value("i"): grants so far (chain)
    changed: Any  # Condition: grants changed (chain)


def quiet() -> None:
    logging.getLogger().setLevel(logging.ERROR)
    for noisy in ("aiormq", "redis_lock", "kazoo", "tooz", "amqp_locks"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


def what(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]


def main(job: Job, idx: int, sync: Sync) -> None:
    quiet()
    out = sync.out
    try:
        lock = make(job.kind, job.name, job.slots, job.targets, job.group)
        if job.mode != "hold":  # connections, channels and fence checks warmed up
            lock.acquire()
            lock.release()
    except BaseException as exc:
        out.put(("error", idx, f"setup: {what(exc)}"))
        return
    out.put(("ready", idx))
    try:
        if job.mode == "hold":
            out.put(("acquiring", idx, time.monotonic()))
            lock.acquire()
            out.put(("acquired", idx, time.monotonic()))
            # Hold until killed. Not on a multiprocessing Event: a process killed while
            # waiting on one would block the parent's next set() for ever.
            threading.Event().wait()
        rng = random.Random(idx)
        sync.go.wait()
        time.sleep(max(0.0, sync.start_at.value - time.monotonic()))
        deadline = sync.start_at.value + job.seconds
        while not sync.stop.is_set() and time.monotonic() < deadline:
            t_c = time.monotonic()
            lock.acquire()
            t_a = time.monotonic()
            if job.mode == "chain":
                with sync.changed:
                    sync.grants.value += 1
                    mine = sync.grants.value
                    sync.changed.notify_all()
            if job.hold[1]:
                time.sleep(rng.uniform(*job.hold))  # the work done under the lock
            t_r = time.monotonic()
            lock.release()
            out.put(("grant", idx, t_c, t_a, t_r, time.monotonic()))
            if job.mode == "chain":
                with sync.changed:
                    sync.changed.wait_for(
                        lambda m=mine: sync.grants.value > m or sync.stop.is_set(), timeout=120
                    )
        out.put(("done", idx))
    except BaseException as exc:
        out.put(("error", idx, what(exc)))
    finally:
        lock.close()


class Crew:
    """The worker processes of one run (from the forkserver, or ``spawn``: fresh
    interpreters), their messages, and their end (SIGKILL)."""

    def __init__(self, spawn: bool = False) -> None:
        ctx = self.ctx = mp.get_context("spawn") if spawn else context()
        values = (ctx.Value("d", 0.0), ctx.Value("i", 0), ctx.Condition())
        self.sync = Sync(ctx.Queue(), ctx.Event(), ctx.Event(), *values)
        self.procs: dict[int, Any] = {}
        self.inbox: list[tuple[Any, ...]] = []
        self.started = 0

    def __enter__(self) -> Crew:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync.stop.set()
        for idx in list(self.procs):
            self.kill(idx)

    def spawn(self, job: Any, n: int = 1, target: Any = main, ready: bool = True) -> None:
        """``n`` more workers ``target(job, idx, sync)``, then (``ready``) their "ready"."""
        for idx in range(self.started, self.started + n):
            p = self.ctx.Process(target=target, args=(job, idx, self.sync), daemon=True)
            p.start()
            self.procs[idx] = p
        self.started += n
        for _ in range(n if ready else 0):
            if self.expect("ready", None, 120) is None:
                raise RuntimeError("workers not ready within 120 s")

    def get(self, timeout: float) -> tuple[Any, ...] | None:
        """The next message (None on timeout); a worker's error raises."""
        try:
            msg: tuple[Any, ...] = self.sync.out.get(timeout=max(0.0, timeout))
        except queue.Empty:
            dead = [p.exitcode for p in self.procs.values() if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a worker died (exit {dead[0]})") from None
            return None
        if msg[0] == "error":
            raise RuntimeError(f"worker {msg[1]}: {msg[2]}")
        return msg

    def expect(self, what: str, idx: int | None, timeout: float) -> tuple[Any, ...] | None:
        """The next ``what`` message (of worker ``idx``); others are kept in ``inbox``."""
        end = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self.inbox):
                if msg[0] == what and (idx is None or msg[1] == idx):
                    return self.inbox.pop(i)
            if (left := end - time.monotonic()) <= 0:
                return None
            if (got := self.get(min(left, 0.5))) is not None:
                self.inbox.append(got)

    def start(self, delay: float = 0.05) -> float:
        self.sync.start_at.value = t0 = time.monotonic() + delay
        self.sync.go.set()
        return t0

    def grants(self, end: float, n: float = float("inf")) -> list[tuple[Any, ...]]:
        """Grant messages until ``n`` of them or the monotonic time ``end``."""
        out: list[tuple[Any, ...]] = []
        while len(out) < n and (left := end - time.monotonic()) > 0:
            msg = self.get(min(left, 0.5))
            if msg is not None and msg[0] == "grant":
                out.append(msg)
        return out

    def kill(self, idx: int) -> None:
        p = self.procs.pop(idx)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)


def kill_series(
    job: Any,
    samples: int,
    settle: tuple[float, float],
    seed: int,
    cap: float,
    target: Any = main,
    steps: tuple[str, str] = ("acquiring", "acquired"),
) -> dict[str, Any]:
    """``samples`` times: a new worker says ``steps[0]`` (it waits), a random ``settle`` s
    later the holder gets SIGKILL; from just before ``os.kill`` to its ``steps[1]`` (it holds).
    None within ``cap`` s is "censored"; that, like any error, ends the series."""
    rng, out, errors, censored = random.Random(seed), [], [], 0
    wait, took = steps
    with Crew() as crew:
        try:
            crew.spawn(job, target=target, ready=False)
            if crew.expect(took, 0, max(60.0, cap)) is None:
                raise RuntimeError(f"worker 0 not {took} within {max(60.0, cap):.0f} s")
            for i in range(1, samples + 1):
                crew.spawn(job, target=target, ready=False)
                if crew.expect(wait, i, 60) is None:
                    raise RuntimeError(f"worker {i} not {wait} within 60 s")
                time.sleep(rng.uniform(*settle))  # the waiter is blocked meanwhile
                if crew.expect(took, i, 0.01) is not None:
                    raise RuntimeError(f"sample {i}: {took} while the holder was alive")
                t_kill = time.monotonic()
                crew.kill(i - 1)
                if (got := crew.expect(took, i, cap)) is None:
                    censored = 1  # held by a dead process: no further samples
                    break
                out.append(got[2] - t_kill)
        except Exception as exc:  # a series must not take the others down
            errors.append(str(exc))
    return {**summarize_reps([out], samples=True), "censored": censored, "errors": errors}
