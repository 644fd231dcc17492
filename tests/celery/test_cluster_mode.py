"""Celery tasks whose locks run in cluster mode (``amqp_locks_cluster=True``: quorum
queues made on first use, expiring), on one node: a worker of 4 prefork children."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks import Broker
from amqp_locks.celery import AlreadyQueued
from amqp_locks.celery.once import ALIVE_EXPIRES_MS, Mark, busy, claim, claim_exchange
from amqp_locks_dev import devbroker

from .app import hold, limited, once
from .conftest import Worker, key, max_running, wait_until


@pytest.fixture(scope="module")
def cluster_worker(
    node: devbroker.NodeInfo, celery_home: Path, celery_app: Any
) -> Iterator[Worker]:
    worker = Worker(node.url, celery_home, "prefork", 4, env={"CELERY_TEST_LOCKS_CLUSTER": "1"})
    yield worker
    worker.stop()


def _queues(node: devbroker.NodeInfo, *prefixes: str) -> list[list[str]]:
    """The queues named with each prefix, from one listing: a rabbitmqctl call starts an
    Erlang VM, which takes seconds on a loaded machine (a first-use queue unused for 60 s
    expires meanwhile: one listing per key once missed the second key's queue)."""
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "--no-table-headers", "--quiet")
    names = [q.strip() for q in out.splitlines()]
    return [[q for q in names if q.startswith(prefix)] for prefix in prefixes]


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
    assert _queues(node, mutex, semaphore) == [
        [f"{mutex}.mutex.semaphore"],
        [f"{semaphore}.semaphore"],
    ]


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


#: The quorum tick: how often RabbitMQ checks a quorum queue's expiry (5 s by default).
QUORUM_TICK = 5.0


def test_once_key_of_a_killed_child_in_cluster_mode(
    cluster_worker: Worker,
    broker: Broker,
    node: devbroker.NodeInfo,
    record_property: Callable[[str, object], None],
) -> None:
    """Cluster mode keeps no exclusive queue: the running call's binding is to its
    connection's quorum alive queue, which a killed child's connection leaves unused, and
    which then expires (ALIVE_EXPIRES_MS, checked on the quorum tick): the key is free
    within that, not at once as with one node's exclusive queue."""
    k = key()
    name = once.lock_name((k, 60.0))
    once.apply_async((k, 60.0), queue=cluster_worker.queue)
    victim = cluster_worker.wait_events(k, "start", 1)[0].pid
    out = devbroker.rabbitmqctl(
        node, "list_bindings", "source_name", "destination_name", "--no-table-headers", "-q"
    )
    bound = [line.split("\t")[1] for line in out.splitlines()
             if line.split("\t")[0] == claim_exchange(name)]  # fmt: skip
    assert len(bound) == 1 and bound[0].startswith("amqp-locks.once-alive."), bound
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "type", "--no-table-headers", "-q")
    assert f"{bound[0]}\tquorum" in out.splitlines(), "a quorum queue, never exclusive"
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    wait_until("the killed call's key to be free", lambda: not busy(broker, name), 20)
    took = time.monotonic() - killed
    print(f"\nonce, cluster mode: SIGKILL of the child -> key free: {took:.2f} s")
    record_property("child_kill_to_key_free_s", round(took, 2))
    assert took <= ALIVE_EXPIRES_MS / 1000 + 2 * QUORUM_TICK
    again = once.apply_async((k, 0.0), queue=cluster_worker.queue)
    again.get(timeout=60)


def test_a_deleted_alive_queue_is_replaced(node: devbroker.NodeInfo) -> None:
    """An alive queue deleted under its connection (by an operator) frees the keys bound to
    it (the broker deletes a claim with its last binding); the connection's next call
    finds no queue to bind and declares and consumes a new one."""
    with Broker(node.url, cluster=True) as b:
        first, second = (f"celery.test.{key()}" for _ in range(2))
        assert claim(b, first)
        mark = Mark(b, first, "task-1", comes_back=False)
        mark.start(retried=False)
        assert busy(b, first) and mark.alive is not None
        devbroker.rabbitmqctl(node, "delete_queue", mark.alive)
        wait_until("the key bound to the deleted queue to be free", lambda: not busy(b, first), 10)
        assert claim(b, second)
        again = Mark(b, second, "task-2", comes_back=False)
        again.start(retried=False)
        assert again.alive not in (None, mark.alive)
        assert busy(b, second)
        again.end(hand_over=False)
        assert not busy(b, second)
