"""A ``once`` key in cluster mode whose worker's node dies and stays down (issue 36).

On a Khepri cluster (RabbitMQ 4.2+) an exclusive queue of a killed node stays until the
node returns, so a key bound by the worker connection's exclusive queue stayed busy all
that time. Cluster mode binds a quorum *alive* queue instead, consumed by the worker's
connection and expiring once unused (celery/once.py): the consumer of a lost node stops
counting as use at once, and the broker deletes the queue, its binding and so the key's
claim at its next expiry check. The test runs a worker whose lock connection is on node 1,
kills node 1 and keeps it down, and measures until the key is claimable again (printed;
docs/celery.md quotes it):

    AMQP_LOCKS_RABBITMQ=4.3 .venv/bin/pytest -s tests/celery/test_once_node_loss.py
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery

from amqp_locks.celery.once import ALIVE_EXPIRES_MS, busy, claim, claim_exchange, forget
from amqp_locks_dev import devbroker

from ..cluster import conftest as cluster_fixtures
from ..cluster.conftest import Nodes
from .app import once
from .conftest import Worker, key, wait_until

# The private 3-node cluster of tests/cluster (every node up before each test).
cluster = cluster_fixtures.cluster
all_nodes_up = cluster_fixtures.all_nodes_up
nodes = cluster_fixtures.nodes

pytestmark = pytest.mark.timeout(300)

#: The quorum tick: how often RabbitMQ checks a quorum queue's expiry (5 s by default).
QUORUM_TICK = 5.0
#: The bound asserted, from the kill until the key is claimable again: within the lock
#: delay (10 s) on 4.3 (measured about 5 s); 3.10.8 takes one quorum tick more (about 10
#: s measured: there a lost node's consumer is dropped on a tick, then the queue expires
#: on a later one).
FREED_WITHIN = {"4.3": 10.0}.get(devbroker.default_version(), 15.0)


@pytest.fixture
def worker(nodes: Nodes, celery_home: Path) -> Iterator[Worker]:
    """A cluster-mode prefork worker (one child) whose Celery and lock connections go to
    node 1 first (Celery's failover list: the other nodes after it)."""
    urls = ";".join(nodes.urls_from(1))
    w = Worker(urls, celery_home, "prefork", 1, env={"CELERY_TEST_LOCKS_CLUSTER": "1"})
    yield w
    # Its call still sleeps: no warm shutdown (it would wait for it).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(w.pid, signal.SIGKILL)
    w.proc.wait(30)


def _stays(what: str, predicate: Callable[[], bool], seconds: float) -> None:
    """`predicate` holds for `seconds` (checked every 0.25 s): a state that must last."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert predicate(), what
        time.sleep(0.25)


def _alive_queue_of(nodes: Nodes, exchange: str) -> tuple[str, str]:
    """The alive queue bound to a claim exchange, and the node its consumer's channel is
    on (read through node 2)."""
    node = nodes.info.node(2)
    out = devbroker.rabbitmqctl(
        node, "list_bindings", "source_name", "destination_name", "--no-table-headers", "-q"
    )
    bound = [line.split("\t")[1] for line in out.splitlines() if line.split("\t")[0] == exchange]
    assert len(bound) == 1 and bound[0].startswith("amqp-locks.once-alive."), bound
    queue = bound[0]
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "type", "--no-table-headers", "-q")
    assert f"{queue}\tquorum" in out.splitlines(), "cluster mode's alive queue is a quorum queue"
    out = devbroker.rabbitmqctl(
        node, "list_consumers", "queue_name", "channel_pid", "--no-table-headers", "-q"
    )
    pids = [line.split("\t")[1] for line in out.splitlines() if line.split("\t")[0] == queue]
    assert len(pids) == 1, f"one consumer keeps {queue} in use: {pids}"
    return queue, pids[0].lstrip("<").split("@")[0]


def _run_once_call(nodes: Nodes, worker: Worker) -> str:
    """Start a 120 s `once` call in `worker`; its key's lock name once it runs."""
    k = key()
    sender = Celery("sender", broker=nodes.info.urls[1])  # node 2: it stays up
    try:
        # Sent around the dedup: the running call claims its key (once.Mark._start).
        sender.send_task("tests.celery.app.once", (k, 120.0), queue=worker.queue)
    finally:
        sender.close()
    worker.wait_events(k, "start", 1)
    return once.lock_name((k, 120.0))


def test_once_key_stays_busy_when_another_node_dies(nodes: Nodes, worker: Worker) -> None:
    """A node that is not the worker's dies: the worker's consumer lives, its alive queue
    keeps a majority (2 of 3), the key stays busy past its expiry and a quorum tick."""
    name = _run_once_call(nodes, worker)
    b = nodes.broker(2)
    nodes.kill(3)
    _stays("the key stays busy while its worker's connection lives", lambda: busy(b, name),
           ALIVE_EXPIRES_MS / 1000 + 2 * QUORUM_TICK + 1)  # fmt: skip
    assert not claim(b, name)


def test_once_key_freed_after_its_workers_node_is_killed(
    nodes: Nodes, worker: Worker, record_property: Callable[[str, object], None]
) -> None:
    name = _run_once_call(nodes, worker)
    b = nodes.broker(2)
    assert busy(b, name)
    _, consumer_node = _alive_queue_of(nodes, claim_exchange(name))
    assert consumer_node == nodes.info.node(1).name, "the worker's lock connection is on node 1"
    # While the worker's connection lives, its consumer keeps the queue from expiring.
    _stays("the key stays busy while its call runs", lambda: busy(b, name),
           ALIVE_EXPIRES_MS / 1000 + QUORUM_TICK + 1)  # fmt: skip
    nodes.kill(1)
    killed = time.monotonic()
    wait_until("the key to be free", lambda: not busy(b, name), FREED_WITHIN + 5)
    took = time.monotonic() - killed
    print(f"\nonce, cluster mode: SIGKILL of the worker's node -> key free: {took:.2f} s")
    record_property("node_kill_to_key_free_s", round(took, 2))
    assert took <= FREED_WITHIN
    assert claim(b, name), "the key is claimable again, node 1 still down"
    assert forget(b, name)
    assert devbroker.NODES.status(nodes.info.node(1).base_dir) is None, "node 1 stayed down"
