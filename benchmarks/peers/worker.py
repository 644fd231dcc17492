"""The process every comparison runs its contenders in, whatever the lock.

A worker builds its adapter (own connection), says ``ready``, waits for ``go`` and then:

- ``chain`` (handoff): acquire, hold a random ``hold`` s, release; then wait until *another*
  process has been granted the lock before asking again, so every release is a handoff
  to one of the N processes that were blocked, never a re-grant to the releaser;
- ``loop`` (throughput): acquire, release at once, again, until the run's deadline;
- ``hold`` (crash): acquire once and keep the lock until killed.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process) and go to
the parent on ``out`` as they happen, so a worker killed at the end (blocked in an acquire
that never returns, by design) loses nothing. Workers are always ended by the parent.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from .kinds import make


@dataclass(frozen=True)
class Job:
    kind: str
    name: str
    slots: int
    targets: dict[str, str]
    group: str  # settings: default | tuned
    mode: str  # chain | loop | hold
    hold: tuple[float, float] = (0.0, 0.0)  # chain: seconds held, uniformly random
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


def _quiet() -> None:
    logging.getLogger().setLevel(logging.ERROR)
    for noisy in ("aiormq", "redis_lock", "kazoo", "tooz", "amqp_locks"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


def main(job: Job, idx: int, sync: Sync) -> None:
    _quiet()
    out = sync.out
    try:
        lock = make(job.kind, job.name, job.slots, job.targets, job.group)
    except BaseException as exc:
        out.put(("error", idx, f"setup: {_what(exc)}"))
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
            return
        rng = random.Random(idx)
        sync.go.wait()
        deadline = sync.start_at.value + job.seconds
        while not sync.stop.is_set() and time.monotonic() < deadline:
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
            out.put(("grant", idx, t_a, t_r))
            if job.mode == "chain":
                with sync.changed:
                    sync.changed.wait_for(
                        lambda m=mine: sync.grants.value > m or sync.stop.is_set(), timeout=120
                    )
        out.put(("done", idx))
    except BaseException as exc:
        out.put(("error", idx, _what(exc)))
    finally:
        lock.close()


def _what(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]
