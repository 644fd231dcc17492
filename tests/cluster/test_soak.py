"""Soak: workers on every node contend for a lock while nodes are killed and restarted in
turn (`pytest -m slow tests/cluster`). Counts overlaps exactly (and how long each lasts),
and checks that tokens are never handed out twice, that each worker's tokens rise, that a
holder which lost its lease and writes anyway is refused, and that capacity comes back.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from amqp_locks import (
    AmqpLocksError,
    Broker,
    Lease,
    Mutex,
    SemaphoreAdmin,
    TokenSemaphore,
)

from .conftest import Nodes, wait_until
from .locks import lock_of
from .resource import FencedResource

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKERS_PER_NODE = 2
CYCLES = 3  # each node killed once, then restarted
WORK_AFTER_KILL = 6.0  # seconds of contention with one node down
WORK_AFTER_RESTART = 3.0
#: Longest time an overlapping (crashed-node) holder may go on believing it holds.
OVERLAP_WINDOW = 1.0


@dataclass
class Stats:
    grants: int = 0
    lost: int = 0
    zombies: int = 0
    zombies_accepted: int = 0
    errors: list[str] = field(default_factory=list)
    #: Per (worker, key): the tokens of its grants, in order.
    tokens: dict[tuple[int, object], list[int]] = field(default_factory=dict)


def _worker(
    wid: int,
    broker: Broker,
    acquire: Callable[[Broker], Lease | None],
    key_of: Callable[[Lease], object],
    resource: FencedResource,
    stats: Stats,
    stop: threading.Event,
) -> None:
    rng = random.Random(wid)
    while not stop.is_set():
        try:
            lease = acquire(broker)
        except AmqpLocksError as exc:  # the node died under the call: try again
            stats.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            time.sleep(0.05)
            continue
        if lease is None:
            continue
        stats.grants += 1
        key = key_of(lease)
        stats.tokens.setdefault((wid, key), []).append(lease.fencing_token)
        resource.enter(wid, key, lease)
        lease.on_lost(lambda _lease, wid=wid: resource.leave(wid))
        try:
            for _ in range(2):
                resource.write(key, lease.fencing_token)
                if lease.lost.wait(rng.uniform(0.02, 0.2)):
                    break
        finally:
            resource.leave(wid)
            if lease.lost.is_set():
                stats.lost += 1
                _zombie_write(resource, key, lease.fencing_token, stats)
            try:
                lease.release()
            except AmqpLocksError as exc:
                stats.errors.append(f"release: {exc}"[:200])


def _zombie_write(resource: FencedResource, key: object, token: int, stats: Stats) -> None:
    """A holder that lost its lease writes anyway (as a paused one would, unaware): once a
    newer holder of the same key has written, the resource must refuse it."""
    deadline = time.monotonic() + 10
    while resource.highest(key) <= token and time.monotonic() < deadline:
        time.sleep(0.01)
    if resource.highest(key) > token:
        stats.zombies += 1
        if resource.write(key, token):
            stats.zombies_accepted += 1


def _node_of(wid: object) -> int:
    assert isinstance(wid, int)
    return wid // WORKERS_PER_NODE + 1


def _victim(resource: FencedResource, *, holders_node: bool) -> int:
    """The node of a current holder, or else a node no current holder is connected to."""
    deadline = time.monotonic() + 10
    while not resource.inside and time.monotonic() < deadline:
        time.sleep(0.01)
    holding = {_node_of(wid) for wid in list(resource.inside)}
    if holders_node and holding:
        return min(holding)
    idle = sorted({1, 2, 3} - holding)
    return idle[0] if idle else 3


def _soak(nodes: Nodes, kind: str, name: str, permits: int) -> tuple[FencedResource, Stats]:
    """Workers contend for lock `name` of `kind` (tests/cluster/locks.py's names) through
    every node; a semaphore's resource key is the slot or permit a grant holds."""

    def acquire(b: Broker) -> Lease | None:
        return lock_of(b, kind, name).acquire(timeout=5)

    def key_of(lease: Lease) -> object:
        return name if kind == "mutex" else lease.number

    resource = FencedResource(permits=permits)
    stats = Stats()
    stop = threading.Event()
    brokers = [nodes.broker(i) for i in (1, 2, 3) for _ in range(WORKERS_PER_NODE)]
    threads = [
        threading.Thread(
            target=_worker,
            args=(wid, b, acquire, key_of, resource, stats, stop),
            daemon=True,
        )
        for wid, b in enumerate(brokers)
    ]
    for t in threads:
        t.start()
    try:
        for cycle in range(CYCLES):
            victim = _victim(resource, holders_node=cycle % 2 == 0)
            nodes.kill(victim)
            time.sleep(WORK_AFTER_KILL)  # workload duration, not synchronisation
            nodes.restart(victim)
            time.sleep(WORK_AFTER_RESTART)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    print(
        f"grants={stats.grants} lost={stats.lost} accepted={resource.accepted} "
        f"refused={resource.refused} overlaps={resource.overlaps} errors={len(stats.errors)} "
        f"zombie writes={stats.zombies} accepted={stats.zombies_accepted} "
        f"overlap windows (ms)={[round(w * 1000) for w in resource.windows]}"
    )
    assert stats.zombies_accepted == 0
    # A node's death frees its holders' locks on the broker at the instant the holders'
    # clients see their connections reset: a waiter elsewhere can be granted a few ms
    # before the old holder's lease is marked lost. Such overlaps are counted; each must
    # close within OVERLAP_WINDOW, and fencing refuses the old holder's writes (below).
    wait_for = time.monotonic() + 15
    while len(resource.windows) < resource.overlaps and time.monotonic() < wait_for:
        time.sleep(0.05)
    assert len(resource.windows) == resource.overlaps
    assert all(w < OVERLAP_WINDOW for w in resource.windows), resource.windows
    assert resource.duplicate_tokens() == {}
    for (wid, key), tokens in stats.tokens.items():
        assert tokens == sorted(set(tokens)), f"worker {wid}'s tokens for {key} fell: {tokens}"
    assert stats.grants > 50 and stats.lost >= 1
    return resource, stats


def test_soak_mutex(nodes: Nodes, name: str) -> None:
    _soak(nodes, "mutex", name, 1)
    with nodes.broker(2) as b:
        lease = Mutex(b, name).acquire(timeout=10)
        assert lease is not None
        lease.release()


def test_soak_persistent_semaphore(nodes: Nodes, name: str) -> None:
    SemaphoreAdmin(nodes.broker(1), name, quorum=True).create(2)
    _soak(nodes, "semaphore", name, 2)
    admin = SemaphoreAdmin(nodes.broker(2), name, quorum=True)
    assert admin.holders(beyond=2) == [] and admin.max_slots() == 2


def test_soak_token_semaphore(nodes: Nodes, name: str) -> None:
    TokenSemaphore(nodes.broker(1), name, quorum=True).setup(2)
    _soak(nodes, "token", name, 2)
    sem = TokenSemaphore(nodes.broker(3), name)
    # The workers' last releases were plain ones: the broker may not have every token
    # back yet when they end.
    wait_until(lambda: sem.status().ready == 2, 30, "both tokens back in the queue")
    status = sem.status()
    assert (status.permits, status.ready) == (2, 2), status
    assert sem.audit(timeout=5).ok
