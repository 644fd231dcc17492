"""The primitives under test, behind one small interface: set up, a lock to acquire, and
the capacity check that measures leaks (c) after a run.

Kinds: ``semaphore`` (persistent semaphore), ``token`` (token semaphore, classic token
queue), ``token-quorum`` (quorum token queue), ``mutex``. A lease's ``number`` is the key the
fencing token orders (slot, permit id, 1 for a mutex).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from amqp_locks import (
    Broker,
    Mutex,
    PersistentSemaphore,
    QueueNotFound,
    SemaphoreAdmin,
    TokenSemaphore,
)
from amqp_locks.names import fence_queue, sentinel_queue, token_queue, wakeup_queue
from amqp_locks.tokens import ledger_queue

KINDS = ("semaphore", "token", "token-quorum", "mutex")
#: The kind `amqp_locks.events` reports for each primitive.
EVENT_KIND = {"semaphore": "semaphore", "token": "token", "token-quorum": "token", "mutex": "mutex"}


def setup(kind: str, broker: Broker, name: str, permits: int) -> None:
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(permits)
    elif kind in ("token", "token-quorum"):
        TokenSemaphore(broker, name, quorum=kind == "token-quorum").setup(permits)
    elif kind == "mutex":
        if permits != 1:
            raise ValueError("a mutex has one permit")
    else:
        raise ValueError(f"unknown kind {kind!r}")


def lock(kind: str, broker: Broker, name: str) -> Any:
    """Something with ``acquire(blocking=True, timeout=None) -> Lease | None``."""
    if kind == "semaphore":
        return PersistentSemaphore(broker, name, max_races=1000)
    if kind in ("token", "token-quorum"):
        return TokenSemaphore(broker, name)
    if kind == "mutex":
        return Mutex(broker, name)
    raise ValueError(f"unknown kind {kind!r}")


def waiting(kind: str, broker: Broker, name: str, holders: int) -> int:
    """How many acquires are waiting right now: consumers of the queue a waiter is pushed
    from (token queue; sentinel queue of a semaphore or mutex) beyond the `holders`."""
    if kind in ("token", "token-quorum"):
        queue = token_queue(name)
    else:
        queue = sentinel_queue(name, "sem" if kind == "semaphore" else "mutex")

    async def count() -> int:
        session = await broker.core.session()
        try:
            _, consumers = await session.declare_passive_counts(queue)
        except QueueNotFound:
            return 0
        return consumers - holders

    return broker.core.run(count())


def capacity(kind: str, broker: Broker, name: str, permits: int) -> int:
    """How many leases a fresh client gets at once, without waiting (up to permits + 1,
    so a surplus shows). Everything taken is released again."""
    sem = lock(kind, broker, name)
    leases = []
    try:
        for _ in range(permits + 1):
            lease = sem.acquire(blocking=False)
            if lease is None:
                break
            leases.append(lease)
        return len(leases)
    finally:
        for lease in leases:
            lease.release()


def leaked(kind: str, url: str, name: str, permits: int, timeout: float = 15.0) -> int:
    """(c): how far the capacity is from `permits` once the run is over, polled until it
    comes back or `timeout` passes (a dead holder's connection may take the broker a moment).
    Token semaphores are audited too: every ledger id seen exactly once."""
    with Broker(url, heartbeat=5) as broker:
        deadline = time.monotonic() + timeout
        while True:
            got = capacity(kind, broker, name, permits)
            off = abs(permits - got)
            if kind == "semaphore":
                admin = SemaphoreAdmin(broker, name)
                off += len(admin.holders(beyond=permits)) + abs(permits - admin.max_slots())
            elif kind in ("token", "token-quorum"):
                audit = TokenSemaphore(broker, name).audit(timeout=3)
                off += len(audit.missing) + len(audit.surplus) + abs(permits - audit.permits)
            if off == 0 or time.monotonic() >= deadline:
                return off
            time.sleep(0.2)


def cleanup(url: str, name: str) -> None:
    """Delete every queue of lock `name` (best effort: the shared test node stays tidy)."""
    queues = [
        name,
        fence_queue(name),
        token_queue(name),
        ledger_queue(name),
        *(wakeup_queue(name, k) for k in ("sem", "mutex")),
        *(sentinel_queue(name, k) for k in ("sem", "mutex")),
        *(f"{name}-{k}-A" for k in range(1, 17)),
    ]

    async def delete_all(broker: Broker) -> None:
        session = await broker.core.session()
        for q in queues:
            with contextlib.suppress(Exception):
                await session.delete(q)

    with contextlib.suppress(Exception), Broker(url, heartbeat=5) as broker:
        broker.core.run(delete_all(broker))
