"""Issue 22, point 4 on a 3-node cluster: what ``release(wait=True)`` and ``Broker.close()``
promise in cluster mode, where every lock is a quorum token (docs/protocol.md section 11).

The holder connects to node 1, the waiter to node 2. A confirmed release is the commit of
the re-published token, which a quorum queue confirms only with a majority: so on a node
cut off from its peers (nodes 2 and 3 frozen) the release cannot be confirmed, and
``release(wait=True)`` must say so rather than return.

Uses the private cluster of tests/cluster (its ``cluster`` and ``nodes`` fixtures, and
``all_nodes_up``, which restarts a node a failed test left down).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from amqp_locks import (
    Broker,
    Lease,
    ReadWriteLock,
    ReleaseUnconfirmed,
    SemaphoreAdmin,
    TokenSemaphore,
)
from amqp_locks.names import quorum_mutex_name, slots_name, token_queue

from .cluster import conftest as cluster_fixtures
from .cluster.conftest import Nodes, wait_until
from .cluster.locks import lock_of
from .spawn import freeze

# The cluster tests' fixtures, used here as they are.
cluster = cluster_fixtures.cluster
nodes = cluster_fixtures.nodes
all_nodes_up = cluster_fixtures.all_nodes_up
frozen = cluster_fixtures.frozen

pytestmark = pytest.mark.timeout(240)

#: How soon the waiter on node 2 must have the lock once the holder's release(wait=True)
#: or close() returned: the handoff itself, not any failure detection (seconds).
HANDOFF = 2.0
QUORUM_TIMEOUT = 3.0  # the holder's, for the cut-off test
SLACK = 3.0  # scheduling on a loaded 2-core machine


def _setup(kind: str, broker: Broker, name: str) -> None:
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
    elif kind == "token":
        TokenSemaphore(broker, name).setup(1)


def _waiter(kind: str, broker: Broker, name: str) -> tuple[threading.Thread, list[Lease | None]]:
    """A thread acquiring the other side of the lock (a writer waits for a reader, and
    the reverse), started; its result lands in the list."""
    other = {"read": "write", "write": "read"}.get(kind, kind)
    got: list[Lease | None] = []
    thread = threading.Thread(
        target=lambda: got.append(lock_of(broker, other, name).acquire(timeout=60)), daemon=True
    )
    thread.start()
    return thread, got


def _waiting(kind: str, holder: Broker, name: str) -> bool:
    """A consumer of the waiter is registered (seen from the holder's node)."""
    if kind in ("read", "write"):
        status = ReadWriteLock(holder, name).status()
        return status is not None and (status.writer if kind == "read" else status.consumers >= 2)
    tokens = {"mutex": quorum_mutex_name(name), "semaphore": slots_name(name)}.get(kind, name)
    return TokenSemaphore(holder, tokens).status().waiting >= 1


KINDS = ["mutex", "semaphore", "token", "read", "write"]


@pytest.mark.parametrize("kind", KINDS)
def test_release_wait_hands_the_lock_to_a_waiter_on_another_node(
    nodes: Nodes, name: str, kind: str
) -> None:
    b1, b2 = nodes.broker(1), nodes.broker(2)
    assert b1.cluster and b2.cluster
    _setup(kind, b1, name)
    held = lock_of(b1, kind, name).acquire(timeout=30)
    assert held is not None
    thread, got = _waiter(kind, b2, name)
    wait_until(lambda: _waiting(kind, b1, name), 30, "the waiter on node 2 to wait")
    held.release(wait=True)
    returned = time.monotonic()
    thread.join(HANDOFF)
    assert got and got[0] is not None, "the waiter on node 2 was not granted at once"
    print(f"\n{kind}: granted on node 2 {time.monotonic() - returned:.3f} s after release(wait)")
    assert got[0].fencing_token > held.fencing_token
    got[0].release(wait=True)


@pytest.mark.parametrize("kind", KINDS)
def test_close_right_after_release_hands_the_lock_on(nodes: Nodes, name: str, kind: str) -> None:
    """A process that releases and closes (exits): the waiter on another node is granted
    by the release itself, within the close, not when the cluster notices a lost
    connection."""
    b1, b2 = nodes.broker(1), nodes.broker(2)
    _setup(kind, b1, name)
    held = lock_of(b1, kind, name).acquire(timeout=30)
    assert held is not None
    thread, got = _waiter(kind, b2, name)
    wait_until(lambda: _waiting(kind, b1, name), 30, "the waiter on node 2 to wait")
    held.release()
    b1.close()
    closed = time.monotonic()
    thread.join(HANDOFF)
    assert got and got[0] is not None, "the waiter was not granted within the close"
    print(f"\n{kind}: granted on node 2 {time.monotonic() - closed:.3f} s after close()")
    got[0].release()


@pytest.mark.parametrize("kind", ["mutex", "token"])
def test_release_wait_raises_on_a_node_cut_off_from_the_majority(
    nodes: Nodes, name: str, kind: str, frozen: list[int]
) -> None:
    """Nodes 2 and 3 frozen: node 1 still answers its clients, but no commit on a quorum
    queue is confirmed. release(wait=True) must raise ReleaseUnconfirmed (once the quorum
    guard gives the connection up), not return as if the lock were free."""
    b1 = nodes.broker(1, quorum_timeout=QUORUM_TIMEOUT)
    _setup(kind, b1, name)
    held = lock_of(b1, kind, name).acquire(timeout=30)
    assert held is not None
    # A quorum queue declared while node 1 still counted a just-thawed node as down (the
    # test before froze them) gets replicas only on the nodes then running: with node 1
    # alone, it commits without nodes 2 and 3 (CI, 4.3.6: the release was confirmed).
    queue = token_queue(quorum_mutex_name(name) if kind == "mutex" else name)
    assert nodes.members(queue) == ({1, 2, 3}, {1, 2, 3}), (
        f"{queue!r} was not made on all three nodes (members, online): {nodes.members(queue)}"
    )
    for index in (2, 3):  # the premise: both Erlang VMs really stopped
        pid = nodes.pid(index)
        node = nodes.info.node(index).node.split("@")[0].encode()
        assert node in Path(f"/proc/{pid}/environ").read_bytes(), (index, pid)
        frozen.append(index)  # thawed by the fixture, also when the freeze fails
        freeze(pid)
    began = time.monotonic()
    with pytest.raises(ReleaseUnconfirmed):
        held.release(wait=True)
    took = time.monotonic() - began
    assert took < QUORUM_TIMEOUT + SLACK, took
    print(f"\n{kind}: release(wait=True) raised after {took:.2f} s (quorum_timeout 3 s)")
    for index in frozen:
        os.kill(nodes.pid(index), signal.SIGCONT)
    frozen.clear()
    again = lock_of(nodes.broker(2), kind, name).acquire(timeout=90)
    assert again is not None, "the lock was not granted again after the thaw"
    again.release()


def test_close_completes_a_release_in_flight(nodes: Nodes, name: str) -> None:
    """The default release stays asynchronous in cluster mode too (its commit is left to
    a background job); close() right after it lets that commit finish, confirmed."""
    b1 = nodes.broker(1)
    TokenSemaphore(b1, name).setup(1)
    held = TokenSemaphore(b1, name).acquire(timeout=30)
    assert held is not None
    state: Any = held._state
    held.release()
    assert state.release_job is not None, "the release left no commit in flight"
    b1.close()
    assert state.release_job.done() and not state.release_job.cancelled()
    assert state.release_failure is None
    again = TokenSemaphore(nodes.broker(2), name).acquire(blocking=False)
    assert again is not None and again.fencing_token > held.fencing_token
    again.release()
