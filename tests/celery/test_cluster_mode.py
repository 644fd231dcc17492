"""Celery tasks whose locks run in cluster mode (``amqp_locks_cluster=True``: quorum
queues made on first use, expiring), on one node: a worker of 4 prefork children."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks import Broker
from amqp_locks.celery import AlreadyQueued
from amqp_locks.celery.once import busy
from amqp_locks_dev import devbroker

from .app import hold, limited, once
from .conftest import Worker, key, max_running, wait_until


@pytest.fixture(scope="module")
def cluster_worker(
    node: devbroker.NodeInfo, celery_home: Path, celery_app: Any
) -> Iterator[Worker]:
    worker = Worker(
        node.url, celery_home, "prefork", 4, env={"CELERY_TEST_LOCKS_CLUSTER": "1"}
    )
    yield worker
    worker.stop()


def _queues(node: devbroker.NodeInfo, prefix: str) -> list[str]:
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "--no-table-headers", "--quiet")
    return [q.strip() for q in out.splitlines() if q.strip().startswith(prefix)]


def test_mutex_and_lock_limit_keys_in_cluster_mode(
    cluster_worker: Worker, node: devbroker.NodeInfo
) -> None:
    """Six calls of one mutex key never overlap; twelve of one lock_limit=3 key reach 3
    at once and never more (counted from the events); both keys' token queues are the
    first-use quorum queues of cluster mode."""
    a, b = key(), key()
    calls = [hold.apply_async((a, 0.2), queue=cluster_worker.queue) for _ in range(6)]
    calls += [limited.apply_async((b, 0.3), queue=cluster_worker.queue) for _ in range(12)]
    for c in calls:
        c.get(timeout=120)
    assert max_running(cluster_worker.events_of(a)) == 1
    assert max_running(cluster_worker.events_of(b)) == 3
    mutex, semaphore = hold.lock_name((a, 0.2)), limited.lock_name((b, 0.3))
    assert _queues(node, mutex) == [f"{mutex}.mutex.semaphore"]
    assert _queues(node, semaphore) == [f"{semaphore}.semaphore"]


def test_once_in_cluster_mode(cluster_worker: Worker, broker: Broker) -> None:
    """A once key is refused while its call is queued or running, runs once, and is free
    after it (the claim is the same exchange; the run lock a cluster-mode mutex)."""
    k = key()
    first = once.apply_async((k, 1.0), queue=cluster_worker.queue)
    with pytest.raises(AlreadyQueued):
        once.apply_async((k, 1.0), queue=cluster_worker.queue)
    first.get(timeout=60)
    name = once.lock_name((k, 1.0))
    wait_until("the key to be free", lambda: not busy(broker, name), 10)
    events = cluster_worker.events_of(k)
    assert [e.kind for e in events] == ["start", "end"]
    again = once.apply_async((k, 0.0), queue=cluster_worker.queue)
    again.get(timeout=60)
    assert len(cluster_worker.events_of(k)) == 4
