"""Node failures in a 3-node cluster: the fast subset (one kill and one restart per test).

Every test kills, with SIGKILL, the node a holder is connected to; holders there must learn
their lease is lost, waiters elsewhere must get the lock, a resource that checks fencing
tokens must refuse the dead holder's late write, and after the node restarts the lock's
capacity must be what it was configured to be.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from amqp_locks import Lease, Mutex, PersistentSemaphore, SemaphoreAdmin, TokenSemaphore
from amqp_locks.names import quorum_mutex_name
from amqp_locks.semaphore.cluster import slots_name
from amqp_locks.transport.quorum_guard import DEFAULT_LOCK_DELAY, MIN_MARGIN
from amqp_locks_dev import devbroker

from .conftest import Nodes, wait_until
from .resource import FencedResource

pytestmark = pytest.mark.timeout(300)

#: How long a holder on a killed node may take to learn it lost its lease: the kernel
#: resets the socket at once; this only absorbs scheduling on a loaded 2-core machine.
LOSS_BOUND = 5.0
#: How long a waiter on a surviving node may take to get the freed lock (on 4.3 after the
#: lock delay, issue 29: a token held through a lost node waits that long).
REGRANT_BOUND = 15.0 + (DEFAULT_LOCK_DELAY if devbroker.default_version() == "4.3" else 0.0)
#: The quorum bound of a holder that must ride out its lock queue's leader election: the
#: largest allowed (``lock_delay - 1``). The default (half the lock delay) tells a cut-off
#: holder sooner, but under CI's load (four test lanes, a dozen nodes, 2 cores) a holder
#: on a surviving node had no answer from its queue's new leader within 5 s of a SIGKILL
#: twice in about ten runs, and the guard rightly dropped it: it cannot tell a slow
#: election from a cut (docs/cluster.md, "Riding out a node's loss").
RIDE_OUT = DEFAULT_LOCK_DELAY - MIN_MARGIN


def _background(acquire: Callable[[], Lease | None]) -> tuple[threading.Thread, list[Lease | None]]:
    box: list[Lease | None] = []
    t = threading.Thread(target=lambda: box.append(acquire()), daemon=True)
    t.start()
    return t, box


def _kept_or_told(lease: Lease) -> bool:
    """After the killed node rejoins, a holder on a surviving node still holds its lock.
    RabbitMQ 3.10.8 may instead close that holder's connection while its quorum queues
    change leaders or a member restarts (docs/cluster.md, "RabbitMQ 3.10"); the holder
    must then have been told. Never on 4.x."""
    if lease.verify():
        return True
    assert devbroker.default_version() == "3.10", f"surviving holder lost: {lease.lost_reason}"
    assert lease.lost.is_set() and lease.lost_reason, "lost without being told"
    print(f"3.10: surviving holder told it lost its lock: {lease.lost_reason}")
    return False


def _got(t: threading.Thread, box: list[Lease | None], timeout: float) -> Lease:
    t.join(timeout)
    assert box and box[0] is not None, "the waiter on a surviving node got nothing"
    return box[0]


def _regranted_after_killing_node_1(
    nodes: Nodes,
    what: str,
    h1: Lease,
    t: threading.Thread,
    box: list[Lease | None],
    resource: FencedResource,
) -> Lease:
    """Kills node 1, where ``h1`` holds: ``h1`` is told, the waiter in ``t`` gets the same
    slot or permit with a higher fencing token, and ``resource`` takes only the new one."""
    killed = time.monotonic()
    nodes.kill(1)
    assert h1.lost.wait(LOSS_BOUND), "holder on the killed node was not told"
    new = _got(t, box, REGRANT_BOUND)
    print(f"{what}: re-granted after {time.monotonic() - killed:.3f}s")
    assert new.number == h1.number and new.fencing_token > h1.fencing_token
    assert resource.write(new.number, new.fencing_token)
    assert not resource.write(h1.number, h1.fencing_token), "stale write accepted"
    return new


def test_mutex_survives_killing_the_holders_node(nodes: Nodes, name: str) -> None:
    resource = FencedResource(permits=1)
    b1, b2 = nodes.broker(1), nodes.broker(2)
    held = Mutex(b1, name).acquire(timeout=10)  # its token's epoch from a fence shard
    assert held is not None
    assert resource.write(name, held.fencing_token)
    t, box = _background(lambda: Mutex(b2, name).acquire(timeout=60))
    wait_until(lambda: nodes.waiting(b2, tokens=quorum_mutex_name(name)), 10, "the waiter")

    killed = time.monotonic()
    nodes.kill(1)
    assert held.lost.wait(LOSS_BOUND), "holder on the killed node was not told"
    lost_after = time.monotonic() - killed
    new = _got(t, box, REGRANT_BOUND)
    regrant_after = time.monotonic() - killed
    assert new.fencing_token > held.fencing_token
    assert resource.write(name, new.fencing_token)
    assert not resource.write(name, held.fencing_token), "stale write accepted"
    print(f"mutex: lost after {lost_after:.3f}s, re-granted after {regrant_after:.3f}s")

    # The dead holder's Broker reconnects to a surviving node for new work.
    new.release()
    again = Mutex(b1, name).acquire(timeout=10)
    assert again is not None and str(nodes.port(1)) not in b1.url
    assert again.fencing_token > new.fencing_token
    again.release()

    nodes.restart(1)
    b1b = nodes.broker(1)
    last = Mutex(b1b, name).acquire(timeout=10)
    assert last is not None and last.fencing_token > again.fencing_token
    last.release()


def test_persistent_semaphore_keeps_its_slots(nodes: Nodes, name: str) -> None:
    resource = FencedResource(permits=2)
    b1, b2, b3 = nodes.broker(1), nodes.broker(2, quorum_timeout=RIDE_OUT), nodes.broker(3)
    admin = SemaphoreAdmin(b1, name, quorum=True)
    admin.create(2)  # slot and fence queues led by node 1
    h1 = PersistentSemaphore(b1, name).acquire(timeout=10)
    h2 = PersistentSemaphore(b2, name).acquire(timeout=10)
    assert h1 is not None and h2 is not None
    for h in (h1, h2):
        assert resource.write(h.number, h.fencing_token)
    t, box = _background(lambda: PersistentSemaphore(b3, name).acquire(timeout=60))
    wait_until(lambda: nodes.waiting(b3, tokens=slots_name(name)), 10, "the waiter to wait")

    new = _regranted_after_killing_node_1(nodes, "semaphore", h1, t, box, resource)
    # The holder on a surviving node keeps its slot (quorum slot queue, new leader).
    assert not h2.lost.is_set() and h2.verify()
    assert PersistentSemaphore(b2, name).acquire(blocking=False) is None  # still 2 held

    nodes.restart(1)
    kept = [h for h in (h2, new) if _kept_or_told(h)]
    admin2 = SemaphoreAdmin(b2, name, quorum=True)
    assert sorted(admin2.holders()) == sorted(h.number for h in kept)
    for h in (h2, new):
        h.release(wait=h in kept)
    assert admin2.holders() == [] and admin2.max_slots() == 2
    # Cluster mode: each slot is a token carrying its own counter, so fencing tokens rise
    # per slot (docs/protocol.md section 11), as a token semaphore's do per permit.
    by_slot = {(h.number, h.fencing_token) for h in (h1, h2, new)}
    assert len(by_slot) == 3


def test_token_semaphore_keeps_its_tokens(nodes: Nodes, name: str) -> None:
    resource = FencedResource(permits=2)
    b1, b2, b3 = nodes.broker(1), nodes.broker(2, quorum_timeout=RIDE_OUT), nodes.broker(3)
    sem1 = TokenSemaphore(b1, name, quorum=True)
    sem1.setup(2)  # token queue and ledger led by node 1
    h1 = sem1.acquire(timeout=10)
    h2 = TokenSemaphore(b2, name).acquire(timeout=10)
    assert h1 is not None and h2 is not None
    for h in (h1, h2):
        assert resource.write(h.number, h.fencing_token)
    t, box = _background(lambda: TokenSemaphore(b3, name).acquire(timeout=60))
    wait_until(lambda: TokenSemaphore(b3, name).status().waiting >= 1, 10, "waiter consuming")

    new = _regranted_after_killing_node_1(nodes, "token semaphore", h1, t, box, resource)
    assert not h2.lost.is_set() and h2.verify()

    nodes.restart(1)
    # Confirmed releases: a plain release returns before the broker has the token back,
    # and the status read right after raced it (2 of 17 runs on 4.3 saw ready 1).
    kept = [h for h in (h2, new) if _kept_or_told(h)]
    for h in (h2, new):
        h.release(wait=h in kept)
    sem2 = TokenSemaphore(b2, name)
    status = sem2.status()
    assert (status.permits, status.ready) == (2, 2)
    assert sem2.audit(timeout=5).ok


def test_killing_another_node_keeps_every_lease(nodes: Nodes, name: str) -> None:
    """Node 3 leads every queue of the locks; holders on nodes 1 and 2 keep them."""
    b1, b2, b3 = nodes.broker(1), nodes.broker(2), nodes.broker(3)
    SemaphoreAdmin(b3, name + "s", quorum=True).create(1)
    TokenSemaphore(b3, name + "t", quorum=True).setup(1)
    Mutex(b3, name + "m").acquire(timeout=10).release()  # type: ignore[union-attr]
    slot = PersistentSemaphore(b1, name + "s").acquire(timeout=10)
    permit = TokenSemaphore(b1, name + "t").acquire(timeout=10)
    mutex = Mutex(b2, name + "m").acquire(timeout=10)
    assert slot is not None and permit is not None and mutex is not None
    nodes.kill(3)
    for lease in (slot, permit, mutex):
        assert lease.verify() and not lease.lost.is_set(), lease
    # Nothing more to grant, and the locks still answer through the new leaders. Each
    # attempt goes through the connection of another lock's holder, as a user's next
    # acquire would: RabbitMQ 3.10.8 may close it (541) when that acquire meets the leader
    # change (rehearsal 117: the mutex's holder was told 0.33 s after the kill, and the
    # mutex was then free; docs/cluster.md, "Known gaps"). Strict on 4.x.
    attempts = (
        (slot, lambda: PersistentSemaphore(b2, name + "s").acquire(timeout=1)),
        (permit, lambda: TokenSemaphore(b2, name + "t").acquire(timeout=1)),
        (mutex, lambda: Mutex(b1, name + "m").acquire(timeout=1)),
    )
    for lease, attempt in attempts:
        if _kept_or_told(lease):
            assert attempt() is None, f"{lease} is held, yet granted again"
    kept = [lease for lease in (slot, permit, mutex) if _kept_or_told(lease)]
    tokens = (slot.fencing_token, permit.fencing_token, mutex.fencing_token)
    for lease in (slot, permit, mutex):
        lease.release(wait=lease in kept)
    after = (
        PersistentSemaphore(b2, name + "s").acquire(timeout=10),
        TokenSemaphore(b2, name + "t").acquire(timeout=10),
        Mutex(b1, name + "m").acquire(timeout=10),
    )
    for old, lease in zip(tokens, after, strict=True):
        assert lease is not None and lease.fencing_token > old
        lease.release()
    nodes.restart(3)
    assert SemaphoreAdmin(b1, name + "s").holders() == []
    assert TokenSemaphore(b1, name + "t").audit(timeout=5).ok
