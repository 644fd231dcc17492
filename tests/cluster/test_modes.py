"""Every client of a lock must use the same mode: the library says so instead of letting a
single-node client and a cluster-mode client hold one lock at once."""

from __future__ import annotations

import pytest

from amqp_locks import (
    Broker,
    ModeMismatch,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
)

from .conftest import Nodes, wait_until


def _single(nodes: Nodes, index: int) -> Broker:
    b = Broker(nodes.urls_from(index)[0], heartbeat=5.0)
    assert not b.cluster
    return b


def test_mutex_used_in_cluster_mode_is_refused_in_single_node_mode(nodes: Nodes, name: str) -> None:
    held = Mutex(nodes.broker(1), name).acquire(timeout=10)
    assert held is not None
    with _single(nodes, 2) as single, pytest.raises(ModeMismatch, match="cluster mode"):
        Mutex(single, name).acquire(timeout=1)
    held.release()


def test_semaphore_modes_refuse_each_other(nodes: Nodes, name: str) -> None:
    SemaphoreAdmin(nodes.broker(1), name).create(2)  # cluster mode: slot tokens
    with _single(nodes, 2) as single:
        with pytest.raises(ModeMismatch, match="created in cluster mode"):
            PersistentSemaphore(single, name).acquire(timeout=1)
        SemaphoreAdmin(single, name + "s", quorum=True).create(1)  # the seed's slot queues
    with pytest.raises(ModeMismatch, match="created in single-node mode"):
        PersistentSemaphore(nodes.broker(2), name + "s").acquire(timeout=1)


def test_status_and_holders_in_cluster_mode(nodes: Nodes, name: str) -> None:
    """`amqp-locks status` and `holder()` show cluster mode's mutex and semaphore as the
    locks they are, not as the token semaphores that carry them."""
    from amqp_locks import lock_status

    b1 = Broker(nodes.urls_from(1), heartbeat=5.0, holder_id="worker-7")
    b2 = nodes.broker(2)
    assert Mutex(b2, name).holder() is None and not Mutex(b2, name).locked()
    SemaphoreAdmin(b2, name).create(3)
    held = Mutex(b1, name).acquire()
    with PersistentSemaphore(b1, name) as slot:
        # A read returns once the holder answered; its record's bind lags the grant.
        record = Mutex(b2, name).holder(timeout=10)
        assert record is not None and record.holder_id == "worker-7" and record.kind == "mutex"
        sem = PersistentSemaphore(b2, name)
        assert sem.locked() and [r.number for r in sem.holders()] == [slot.number]
        found = {st.kind: st for st in lock_status(b2, name, records=True)}
        assert found["mutex"].held == 1 and found["mutex"].capacity == 1
        assert found["semaphore"].capacity == 3 and found["semaphore"].held == 1
        assert found["semaphore"].holders == (slot.number,)
        assert [r.holder_id for r in found["semaphore"].records] == ["worker-7"]
    # A confirmed release cannot be undone by anything that happens to b1; the quorum
    # queue applies its return a Raft commit after the answer, and another client's read
    # (a stat of the leader's applied state) can come first (CI rehearsal 59, 4.3.6):
    # docs/operations.md, "Releasing and closing". The read converges within the commit.
    held.release(wait=True)
    wait_until(lambda: not Mutex(b2, name).locked(), 10, "the mutex read as free on node 2")
    b1.close()


def test_cluster_mode_permissions(nodes: Nodes, name: str) -> None:
    """docs/operations.md's cluster-mode permissions are enough; without the quorum probe
    queue's, connecting in cluster mode says which permission is missing."""
    import uuid

    from amqp_locks import AccessRefused, TokenSemaphore
    from amqp_locks_dev import devbroker

    node = nodes.info.node(1)
    user, vhost = f"u{uuid.uuid4().hex[:8]}", f"v{uuid.uuid4().hex[:8]}"
    locks = r"(images|reindex)(\.(mutex|slots))?(\.semaphore(-ledger)?|-fence)?"
    extra = (
        r"|amqp-locks\.quorum-guard\..*|amqp-locks\.holder(s|\.[0-9a-f]{32})"
        r"|amqp-locks-fence-[0-9]+(-g[0-9]+(-done)?)?"
    )
    full = f"^({locks}{extra})$"
    write = r"^(amq\.default|amqp-locks\.holder(s|\.[0-9a-f]{32}))$"
    devbroker.rabbitmqctl(node, "add_vhost", vhost)
    devbroker.rabbitmqctl(node, "add_user", user, "pw")
    try:
        urls = [
            u.replace("guest:guest@", f"{user}:pw@").replace("/%2F", f"/{vhost}")
            for u in nodes.urls_from(1)
        ]
        devbroker.rabbitmqctl(
            node, "set_permissions", "-p", vhost, user, f"^({locks})$", write, f"^({locks})$"
        )
        with pytest.raises(AccessRefused, match="quorum-guard"):
            Broker(urls).connect()
        devbroker.rabbitmqctl(node, "set_permissions", "-p", vhost, user, full, write, full)
        with Broker(urls) as b, Broker(urls) as other:
            with Mutex(b, "reindex", timeout=10) as lease:
                assert lease.fencing_token >= 1 and Mutex(other, "reindex").locked()
            SemaphoreAdmin(b, "images").create(2)
            with PersistentSemaphore(other, "images", timeout=10) as slot:
                assert slot.number in (1, 2)
            TokenSemaphore(b, "images").setup(1)
            with TokenSemaphore(other, "images", timeout=10):
                pass
    finally:
        devbroker.rabbitmqctl(node, "delete_user", user)
        devbroker.rabbitmqctl(node, "delete_vhost", vhost)
