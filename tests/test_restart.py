"""A broker restart: leases are lost, slots and fencing counters survive (durable/quorum)."""

from __future__ import annotations

import pytest

from amqp_locks import Broker, Mutex, PersistentSemaphore, SemaphoreAdmin
from amqp_locks_dev import devbroker


@pytest.mark.timeout(240)
def test_restart_loses_leases_keeps_slots_and_fence(node: devbroker.NodeInfo, name: str) -> None:
    with Broker(node.url, heartbeat=5) as b:
        SemaphoreAdmin(b, name).create(2)
        lease = PersistentSemaphore(b, name).acquire()
        mutex = Mutex(b, name + "m").acquire()
        assert lease is not None and mutex is not None
        before = lease.fencing_token
        devbroker.restart(name=node.name, base_dir=node.base_dir)
        assert lease.lost.wait(30) and mutex.lost.wait(30)
        # the same Broker reconnects for new work; the slots are still there
        assert SemaphoreAdmin(b, name).max_slots() == 2
        again = PersistentSemaphore(b, name).acquire(timeout=30)
        assert again is not None
        assert again.fencing_token > before  # the quorum queue kept the count
        again.release()


@pytest.mark.timeout(240)
def test_token_semaphore_survives_a_restart(node: devbroker.NodeInfo, name: str) -> None:
    from amqp_locks import TokenSemaphore

    with Broker(node.url, heartbeat=5) as b:
        ts = TokenSemaphore(b, name)
        ts.setup(2)
        devbroker.restart(name=node.name, base_dir=node.base_dir)
        status = ts.status()  # the ledger is persistent
        assert (status.permits, status.ready) == (2, 2)
        assert ts.setup(2) == 2  # still idempotent: no second set of tokens
        assert ts.status().ready == 2
        assert ts.audit(timeout=2).ok
