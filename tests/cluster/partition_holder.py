"""A lock holder beside node 1, inside the partition harness's namespace (its own process).

``python -m tests.cluster.partition_holder URL NAME KIND NET_TICKTIME SETUP``: connects to
node 1 only, in cluster mode, sets the lock up when SETUP is ``1`` (so node 1 leads its
queues), acquires, prints ``HELD <token>``, and when the lease is lost prints
``LOST <CLOCK_MONOTONIC seconds> <reason>`` (one clock for every process on the machine,
whatever its network namespace), then exits.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from amqp_locks import (
    Broker,
    Lease,
    Mutex,
    PersistentSemaphore,
    ReadWriteLock,
    SemaphoreAdmin,
    TokenSemaphore,
)
from amqp_locks.lockers.amqp import AmqpLocker


def set_up(broker: Broker, kind: str, name: str) -> None:
    """Create the lock through `broker` (its queues' leaders: the node it is connected to)."""
    if kind == "token":
        TokenSemaphore(broker, name).setup(permits=1)
    elif kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
    elif kind in ("mutex", "election"):
        Mutex(broker, name).acquire(timeout=30).release()  # type: ignore[union-attr]
    elif kind in ("read", "write"):
        ReadWriteLock(broker, name).setup()


def lock_of(broker: Broker, kind: str, name: str) -> Any:
    if kind == "token":
        return TokenSemaphore(broker, name)
    if kind == "semaphore":
        return PersistentSemaphore(broker, name)
    if kind == "mutex":
        return Mutex(broker, name)
    rw = ReadWriteLock(broker, name)
    return rw.read_lock if kind == "read" else rw.write_lock


def main(url: str, name: str, kind: str, net_ticktime: str, setup: str) -> None:
    broker = Broker(url, cluster=True, heartbeat=5, net_ticktime=float(net_ticktime))
    if setup == "1":
        set_up(broker, kind, name)
    lease: Lease | None
    if kind == "election":
        locker = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0)
        locker.start()
        lease = locker.lease
    else:
        lease = lock_of(broker, kind, name).acquire(timeout=60)
    assert lease is not None
    told = threading.Event()
    lease.on_lost(lambda _l: told.set())
    print(f"HELD {lease.fencing_token}", flush=True)
    lease.lost.wait()
    at = time.monotonic()
    print(f"LOST {at:.6f} {lease.lost_reason}", flush=True)
    told.wait(5)
    broker.close()


if __name__ == "__main__":
    main(*sys.argv[1:6])
