"""Every primitive the cluster tests exercise, by kind: set it up, take it as a holder or
as the waiter behind one (shared by test_node_loss, test_partition and the partition
holder process)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import amqp_locks
from amqp_locks import (
    Broker,
    Lease,
    Mutex,
    ReadWriteLock,
    SemaphoreAdmin,
    TokenSemaphore,
)
from amqp_locks.lockers.amqp import AmqpLocker

KINDS = ["mutex", "semaphore", "token", "read", "write", "election"]
#: What the waiter behind a holder of `kind` asks for (a reader waits behind a writer...).
WAITS = {"read": "write", "write": "read"}


def set_up(broker: Broker, kind: str, name: str) -> None:
    """Create the lock through `broker`: its quorum queues' leaders start on its node."""
    if kind == "token":
        TokenSemaphore(broker, name).setup(permits=1)
    elif kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
    elif kind in ("mutex", "election"):
        Mutex(broker, name).acquire(timeout=30).release()  # type: ignore[union-attr]
    else:
        ReadWriteLock(broker, name).setup()


def lock_of(broker: Any, kind: str, name: str, api: Any = amqp_locks, **rw: Any) -> Any:
    """The lock of `kind` ("read", "write": that side of a ``ReadWriteLock`` made with
    `rw`) from `api`: the package's classes, or their twins in ``amqp_locks.aio``."""
    if kind == "token":
        return api.TokenSemaphore(broker, name)
    if kind == "semaphore":
        return api.PersistentSemaphore(broker, name)
    if kind == "mutex":
        return api.Mutex(broker, name)
    lock = api.ReadWriteLock(broker, name, **rw)
    return lock.read_lock if kind == "read" else lock.write_lock


@dataclass
class Held:
    """A granted lock: its lease (whose loss the tests time), and how to give it back."""

    lease: Lease
    release: Callable[[], None]


def take(broker: Broker, kind: str, name: str, timeout: float, waiter: bool = False) -> Held:
    """Hold the lock (`waiter`: what waits behind a holder of `kind`), or fail the test."""
    if kind == "election":
        locker = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0)
        locker.start()
        assert locker.lease is not None
        return Held(locker.lease, locker.stop)
    lease = lock_of(broker, WAITS.get(kind, kind) if waiter else kind, name).acquire(
        timeout=timeout
    )
    assert lease is not None, f"{kind} not granted within {timeout} s"
    return Held(lease, lease.release)


def start_waiter(
    broker: Broker, kind: str, name: str, timeout: float, box: dict[str, Any]
) -> threading.Thread:
    """A started thread that waits behind a holder of `kind` (:func:`take` as the waiter);
    it puts in `box` when it was granted (``"at"``) and what it holds (``"held"``), or the
    error that ended it (``"error"``, for the test to report)."""

    def wait() -> None:
        try:
            held = take(broker, kind, name, timeout, waiter=True)
            box["at"], box["held"] = time.monotonic(), held
        except BaseException as exc:  # reported by the test
            box["error"] = exc

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def read_line(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """The next line `proc` prints, or None if none comes within `timeout` seconds (a
    holder that is never told must fail the test, not hang it)."""
    assert proc.stdout is not None
    box: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: box.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        return box.get(timeout=timeout)
    except queue.Empty:
        return None


def holder_told(
    holder: subprocess.Popen[str], timeout: float, box: dict[str, Any], cut_at: float
) -> tuple[float, str]:
    """When the holder process (partition_holder.py) said it lost its lock, and why; fails
    the test, saying whether the waiter (its grant time in ``box["at"]``) got the lock
    meanwhile, if no ``LOST`` line comes within `timeout`."""
    lost = (read_line(holder, timeout) or "").split(maxsplit=2)
    granted = f"{box['at'] - cut_at:.2f} s" if "at" in box else "never"
    assert lost[:1] == ["LOST"], (
        f"the holder was never told ({lost}); the waiter was granted: {granted}"
    )
    return float(lost[1]), lost[2] if len(lost) > 2 else ""
