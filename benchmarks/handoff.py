"""Token semaphore vs mutex vs persistent semaphore: uncontended cost, handoff, crash.

- Uncontended: acquire then release of a one-permit :class:`TokenSemaphore` (classic and
  quorum token queue), back to back, as for the persistent semaphore in ``latency.py``.
- Handoff: two processes (own Broker each) and one permit. The holder notes
  ``time.monotonic()`` just before ``release()``; the waiter has been blocked in
  ``acquire()`` for ``settle`` seconds and notes the time ``acquire()`` returned. Roles
  then swap. ``time.monotonic()`` is CLOCK_MONOTONIC, one clock for all processes.
- Crash: the holder process is killed with SIGKILL while a waiter in another process is
  blocked in ``acquire()``; measured from just before ``os.kill`` (in the parent) to the
  waiter's ``acquire()`` returning. The waiter has waited a random 0.1-2.5 s before the
  kill, so a waiter that falls back to polling is caught at a random point of its back-off.
- Re-ask handoff (``reask``): as the handoff, but the holder asks again at once after its
  ``release()``; the report counts how often the releaser won its lock back.

Worker processes come from a ``forkserver`` with the library preloaded, so starting one
costs a fork, not an interpreter start.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_pipes
from typing import Any

from amqp_locks import Broker, Mutex, PersistentSemaphore, SemaphoreAdmin
from amqp_locks.names import fence_queue, sentinel_queue, wakeup_queue
from amqp_locks.tokens import TokenSemaphore

from .latency import Budget, _delete_queues, _uncontended_one, unique_name
from .stats import ms, summarize_reps

#: Lock kinds compared, in report order.
KINDS = ("token", "token_nofence", "token_quorum", "mutex", "semaphore")
PRELOAD = [
    "amqp_locks",
    "amqp_locks.tokens",
    "amqp_locks.lockers",
    "sqlalchemy",
    "benchmarks",
    # The peers compared (benchmarks.compare); a missing one is skipped by the forkserver.
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
    """A forkserver context with the library preloaded (cheap worker starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclass
class Plan:
    reps: int  # handoff repetitions
    samples: int  # handoffs per repetition
    warmup: int  # untimed handoffs first
    settle: float  # seconds the waiter is blocked before the release
    crash_samples: int
    crash_settle: tuple[float, float] = (0.1, 2.5)


# ----------------------------------------------------------------------------- locks


def _make(broker: Broker, kind: str, name: str) -> Any:
    if kind == "token":
        return TokenSemaphore(broker, name)
    if kind == "token_quorum":
        return TokenSemaphore(broker, name, quorum=True)
    if kind == "token_nofence":
        return TokenSemaphore(broker, name, fencing=False)
    if kind == "mutex":
        return Mutex(broker, name)
    if kind == "semaphore":
        return PersistentSemaphore(broker, name)
    raise ValueError(kind)


@contextlib.contextmanager
def fresh_lock(url: str, kind: str, slots: int = 1, tag: str = "ho") -> Iterator[str]:
    """A new lock of ``kind`` (``token*``, ``*semaphore``, else a mutex; ``*quorum``: a quorum
    token queue) with ``slots`` permits, created first; yields its name; removes its queues
    (and the helper queues a mutex or semaphore leaves) afterwards."""
    name = unique_name(f"{tag}-{kind.replace('_', '-')}")
    token, quorum, sem = "token" in kind, kind.endswith("quorum"), kind.endswith("semaphore")
    with Broker(url) as broker:
        if token:
            TokenSemaphore(broker, name, quorum=quorum).setup(slots)
        elif sem:
            SemaphoreAdmin(broker, name).create(slots)
    try:
        yield name
    finally:
        with contextlib.suppress(Exception), Broker(url) as broker:
            with contextlib.suppress(Exception):
                if token:
                    TokenSemaphore(broker, name, quorum=quorum).destroy()
                elif sem:
                    SemaphoreAdmin(broker, name).destroy(purge_fence=True)
            helpers = [f(name, k) for f in (sentinel_queue, wakeup_queue) for k in ("mutex", "sem")]
            _delete_queues(broker, [name, fence_queue(name), *helpers])


# ---------------------------------------------------------------------- uncontended


def uncontended_tokens(
    url: str, budget: Budget, rtt_ms: float, meter_pids: dict[str, int | None]
) -> dict[str, Any]:
    """Uncontended acquire/release of a one-permit token semaphore: classic token queue
    (with and without fencing) and quorum token queue."""
    out: dict[str, Any] = {}
    with Broker(url) as broker:
        for kind in ("token", "token_nofence", "token_quorum"):
            with fresh_lock(url, kind) as name:
                sem = _make(broker, kind, name)
                out[kind] = _uncontended_one(sem.acquire, budget, rtt_ms, meter_pids)
    return out


# --------------------------------------------------------------------------- workers


def _worker(url: str, kind: str, name: str, conn: Connection) -> None:
    """Acquire / release on command, reporting CLOCK_MONOTONIC times."""
    logging.getLogger("aiormq.channel").setLevel(logging.ERROR)
    broker = Broker(url, connection_name=f"amqp-locks bench {kind} {os.getpid()}")
    lease = None
    try:
        broker.connect()
        lock = _make(broker, kind, name)
        conn.send(("ready", os.getpid()))
        while True:
            cmd = conn.recv()
            if cmd == "acquire":
                conn.send(("acquiring", time.monotonic()))
                lease = lock.acquire(timeout=120)
                t = time.monotonic()
                conn.send(("acquired", t, None if lease is None else lease.fencing_token))
            elif cmd == "release":
                t0 = time.monotonic()
                if lease is not None:
                    lease.release()
                lease = None
                conn.send(("released", t0, time.monotonic()))
            elif cmd == "release_acquire":  # release, and ask again at once
                t0 = time.monotonic()
                if lease is not None:
                    lease.release()
                conn.send(("released", t0, time.monotonic()))
                lease = lock.acquire(timeout=120)
                t = time.monotonic()
                conn.send(("acquired", t, None if lease is None else lease.fencing_token))
            else:
                break
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", repr(exc)))
    finally:
        broker.close()


class _Proc:
    def __init__(self, ctx: Any, url: str, kind: str, name: str) -> None:
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(url, kind, name, child), daemon=True)
        self.proc.start()

    def expect(self, what: str, timeout: float = 60.0) -> tuple[Any, ...]:
        if not self.pipe.poll(timeout):
            raise RuntimeError(f"worker {self.proc.pid}: no {what!r} within {timeout:.0f} s")
        msg = self.pipe.recv()
        if msg[0] != what:
            raise RuntimeError(f"worker {self.proc.pid}: expected {what!r}, got {msg!r}")
        return msg

    def send(self, cmd: str) -> None:
        self.pipe.send(cmd)

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.pipe.send("exit")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@contextlib.contextmanager
def _workers(ctx: Any, url: str, kind: str, n: int) -> Iterator[list[_Proc]]:
    """``n`` workers on a fresh one-permit lock of ``kind``, the first of them holding it;
    stopped (and the lock removed) at the end of the block."""
    with fresh_lock(url, kind) as name:
        procs = [_Proc(ctx, url, kind, name) for _ in range(n)]
        try:
            for p in procs:
                p.expect("ready", 120)
            procs[0].send("acquire")
            procs[0].expect("acquiring")
            procs[0].expect("acquired")
            yield procs
        finally:
            for p in procs:
                p.stop()


# --------------------------------------------------------------------------- handoff


def _handoff_one(ctx: Any, url: str, kind: str, plan: Plan) -> dict[str, Any]:
    reps: list[list[float]] = []
    release_calls: list[float] = []
    with _workers(ctx, url, kind, 2) as (holder, waiter):
        for rep in range(plan.reps):
            samples: list[float] = []
            for i in range(plan.samples + (plan.warmup if rep == 0 else 0)):
                waiter.send("acquire")
                waiter.expect("acquiring")
                time.sleep(plan.settle)  # the waiter is now blocked in acquire()
                holder.send("release")
                _, t_rel, t_rel_end = holder.expect("released")
                _, t_acq, _token = waiter.expect("acquired", 120)
                if rep > 0 or i >= plan.warmup:
                    samples.append(t_acq - t_rel)
                    release_calls.append(t_rel_end - t_rel)
                holder, waiter = waiter, holder
            reps.append(samples)
        holder.send("release")
        holder.expect("released")
    s = summarize_reps(reps)
    s["samples_ms"] = [ms(x) for r in reps for x in r]
    s["release_call_p50_ms"] = summarize_reps([release_calls])["p50_ms"]
    return s


def handoff(url: str, plan: Plan, rtt_ms: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Release -> waiter's acquire returned, per lock kind (one permit, two processes)."""
    ctx = context()
    out: dict[str, Any] = {}
    for kind in KINDS:
        s = _handoff_one(ctx, url, kind, plan)
        s["p50_x_rtt"] = round(s["p50_ms"] / rtt_ms, 1)
        s["p99_x_rtt"] = round(s["p99_ms"] / rtt_ms, 1)
        out[kind] = s
        log(
            f"  handoff {kind}: p50={s['p50_ms']:.2f} ms ({s['p50_x_rtt']}x RTT) "
            f"p99={s['p99_ms']:.2f} ms n={s['n']}"
        )
    return out


# ----------------------------------------------------------------------------- crash


def _crash_one(ctx: Any, url: str, kind: str, plan: Plan, rng: random.Random) -> dict[str, Any]:
    samples: list[float] = []
    settles: list[float] = []
    errors: list[str] = []
    with _workers(ctx, url, kind, plan.crash_samples + 1) as procs:
        for holder, waiter in itertools.pairwise(procs):
            waiter.send("acquire")
            waiter.expect("acquiring")
            settle = rng.uniform(*plan.crash_settle)
            time.sleep(settle)
            if waiter.pipe.poll(0):
                early = waiter.pipe.recv()
                errors.append(f"waiter acquired while the holder was alive: {early}")
                break
            t_kill = time.monotonic()
            holder.kill()
            try:
                _, t_acq, _token = waiter.expect("acquired", 90)
            except RuntimeError as exc:
                errors.append(str(exc))
                break
            samples.append(t_acq - t_kill)
            settles.append(settle)
    s = summarize_reps([samples])
    s["samples_ms"] = [ms(x) for x in samples]
    s["waited_before_kill_s"] = [round(x, 2) for x in settles]
    s["errors"] = errors
    return s


def crash(url: str, plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    """kill -9 of the holder -> the blocked waiter's acquire returned, per lock kind."""
    ctx = context()
    rng = random.Random(4)
    out: dict[str, Any] = {}
    for kind in ("token", "mutex", "semaphore"):
        out[kind] = s = _crash_one(ctx, url, kind, plan, rng)
        log(
            f"  crash {kind}: p50={s['p50_ms']:.1f} ms p99={s['p99_ms']:.1f} ms "
            f"n={s['n']} errors={len(s['errors'])}"
        )
    return out


# -------------------------------------------------------------------- re-ask handoff


@dataclass
class HeadlinePlan:
    """The re-ask handoff's and the fairness loop's (``contention.fairness``) sizes."""

    reask_reps: int
    reask_samples: int
    reask_warmup: int
    settle: float  # seconds the waiter is blocked before the holder releases
    fair_processes: int = 4
    fair_hold: float = 0.005
    fair_seconds: float = 10.0
    fair_grace: float = 10.0


def _reask_one(ctx: Any, url: str, kind: str, plan: HeadlinePlan) -> dict[str, Any]:
    reps: list[list[float]] = []
    to: dict[bool, list[float]] = {True: [], False: []}  # the releaser won it back / not
    with _workers(ctx, url, kind, 2) as (holder, waiter):
        waiter.send("acquire")
        waiter.expect("acquiring")
        for rep in range(plan.reask_reps):
            samples: list[float] = []
            for i in range(plan.reask_samples + (plan.reask_warmup if rep == 0 else 0)):
                time.sleep(plan.settle)  # the waiter is blocked in acquire()
                holder.send("release_acquire")
                _, t_rel, _ = holder.expect("released")
                ready = wait_pipes([holder.pipe, waiter.pipe], 120)
                if not ready:
                    raise RuntimeError(f"{kind}: nobody acquired within 120 s of a release")
                winner = holder if holder.pipe in ready else waiter
                _, t_acq, _token = winner.expect("acquired")
                if rep > 0 or i >= plan.reask_warmup:
                    samples.append(t_acq - t_rel)
                    to[winner is holder].append(t_acq - t_rel)
                if winner is waiter:  # the releaser is now the one blocked
                    holder, waiter = waiter, holder
            reps.append(samples)
        holder.send("release")
        holder.expect("released")
        waiter.expect("acquired", 120)
        waiter.send("release")
        waiter.expect("released")
    s = summarize_reps(reps)
    s["samples_ms"] = [ms(x) for r in reps for x in r]
    s["releaser_won"], s["handoffs"] = len(to[True]), len(to[True]) + len(to[False])
    s["to_waiter"], s["to_releaser"] = summarize_reps([to[False]]), summarize_reps([to[True]])
    return s


def reask(url: str, plan: HeadlinePlan, log: Callable[[str], None]) -> dict[str, Any]:
    """Two processes, one permit: the holder releases and asks again at once while the
    other has been blocked in ``acquire()`` for ``settle`` s; timed from just before
    ``release()`` to whichever ``acquire()`` returns first; counts how often the releaser
    won its lock back."""
    ctx = context()
    out: dict[str, Any] = {}
    for kind in ("token", "token_nofence", "mutex", "semaphore"):
        out[kind] = s = _reask_one(ctx, url, kind, plan)
        log(
            f"  re-ask handoff {kind}: p50={s['p50_ms']:.2f} ms p99={s['p99_ms']:.2f} ms; "
            f"the releaser won {s['releaser_won']} of {s['handoffs']}"
        )
    return out
