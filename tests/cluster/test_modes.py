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

from .conftest import Nodes


def _single(nodes: Nodes, index: int) -> Broker:
    b = Broker(nodes.urls_from(index)[0], heartbeat=5.0)
    assert not b.cluster
    return b


def test_mutex_used_in_cluster_mode_is_refused_in_single_node_mode(
    nodes: Nodes, name: str
) -> None:
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
