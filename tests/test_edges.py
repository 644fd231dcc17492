"""Edge cases found in review: nothing left behind, clean close, quorum slots, deadlines."""

from __future__ import annotations

import threading

import pytest

from amqp_locks import (
    Backoff,
    Broker,
    Lease,
    Mutex,
    PersistentSemaphore,
    PreconditionFailed,
    SemaphoreAdmin,
    SemaphoreNotFound,
)
from amqp_locks.names import quorum_marker, slot_queue
from amqp_locks_dev import devbroker

from .conftest import fence_counter


def _queues(node: devbroker.NodeInfo, prefix: str) -> list[list[str]]:
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "type", "--no-table-headers")
    return sorted(line.split() for line in out.splitlines() if line.startswith(prefix))


def test_acquire_on_a_missing_semaphore_leaves_nothing(
    broker: Broker, name: str, node: devbroker.NodeInfo
) -> None:
    with pytest.raises(SemaphoreNotFound):
        PersistentSemaphore(broker, name).acquire(timeout=1)
    assert _queues(node, name) == []


def test_mutex_on_a_plain_queue_is_refused(broker: Broker, name: str) -> None:
    async def declare() -> None:
        session = await broker.core.session()
        await session.declare(name, durable=True)

    broker.core.run(declare())
    with pytest.raises(PreconditionFailed, match="not exclusive"):
        Mutex(broker, name).acquire(timeout=1)


def test_broker_close_releases_cleanly_and_wakes_waiters(amqp_url: str, name: str) -> None:
    with Broker(amqp_url) as admin_broker:
        SemaphoreAdmin(admin_broker, name).create(1)
        holder_broker = Broker(amqp_url)
        lease = PersistentSemaphore(holder_broker, name).acquire()
        assert lease is not None
        got: list[Lease | None] = []
        slow = PersistentSemaphore(admin_broker, name, backoff=Backoff(30, 30))
        waiter = threading.Thread(target=lambda: got.append(slow.acquire(timeout=60)))
        waiter.start()
        while not admin_broker.core.run(_bound(admin_broker)):
            pass  # wait until the waiter has subscribed (each check is a broker round trip)
        holder_broker.close()
        waiter.join(15)
        assert not waiter.is_alive(), "close() did not publish the release notice"
        assert lease.released and lease.lost_reason is None
        assert got and got[0] is not None
        got[0].release()


async def _bound(broker: Broker) -> bool:
    session = await broker.core.session()
    await session.call(None, lambda ch: ch.exchange_declare("amq.direct", passive=True))
    return any(w.ready for w in session.waiters)


def test_quorum_slots(broker: Broker, name: str, node: devbroker.NodeInfo) -> None:
    admin = SemaphoreAdmin(broker, name, quorum=True)
    admin.create(2)
    assert {q[0]: q[1] for q in _queues(node, name + "-") if q[0].endswith("-A")} == {
        quorum_marker(name): "classic",  # clients look at tombstones first (burial.py)
        slot_queue(name, 1): "quorum",
        slot_queue(name, 2): "quorum",
    }
    sem = PersistentSemaphore(broker, name)
    with sem.acquire() as a, sem.acquire() as b:  # type: ignore[union-attr]
        assert {a.number, b.number} == {1, 2}
        assert sem.acquire(blocking=False) is None
    with pytest.raises(PreconditionFailed, match=slot_queue(name, 2)):
        SemaphoreAdmin(broker, name, quorum=False).add_slots(1)  # no classic/quorum mix
    assert admin.add_slots(1) == 3
    counter = fence_counter(broker, name)
    assert counter in [q[0] for q in _queues(node, counter)]
