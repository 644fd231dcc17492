"""The persistent semaphore client on a real broker: the seed's steps and beyond."""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from amqp_locks import (
    Backoff,
    Broker,
    ConfigurationError,
    Lease,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
    SemaphoreNotFound,
    events,
)
from amqp_locks.errors import FenceMissing
from amqp_locks.names import holder_queue, slot_queue, slots_name, token_queue
from amqp_locks_dev import devbroker

from . import workers
from .conftest import drop_fence_shard, fence_counter, fence_messages
from .spawn import spawn_held


@pytest.fixture
def sem3(broker: Broker, name: str) -> Iterator[PersistentSemaphore]:
    admin = SemaphoreAdmin(broker, name)
    admin.create(3)
    yield PersistentSemaphore(broker, name)
    admin.destroy()


def test_acquire_fills_slots_in_order_then_fails(sem3: PersistentSemaphore) -> None:
    leases = [sem3.acquire(blocking=False) for _ in range(3)]
    assert [lease.number for lease in leases if lease] == [1, 2, 3]
    assert sem3.acquire(blocking=False) is None  # step 2: A[4] missing -> failure
    assert sem3.acquire(timeout=0.2) is None
    leases[1].release()  # type: ignore[union-attr]
    again = sem3.acquire(blocking=False)
    assert again is not None and again.number == 2
    for lease in [*leases, again]:
        assert lease is not None
        lease.release()


def test_two_acquires_in_one_process_get_distinct_slots(broker: Broker, name: str) -> None:
    SemaphoreAdmin(broker, name).create(2)
    sem = PersistentSemaphore(broker, name)
    results: list[Lease | None] = []
    barrier = threading.Barrier(4)

    def grab() -> None:
        barrier.wait()
        results.append(sem.acquire(blocking=False))

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got = sorted(r.number for r in results if r is not None)
    assert got == [1, 2]  # the connection owns B queues; the session's held-set decides


def test_fencing_tokens_strictly_increase(sem3: PersistentSemaphore) -> None:
    tokens = []
    for _ in range(20):
        lease = sem3.acquire()
        assert lease is not None
        tokens.append(lease.fencing_token)
        lease.release()
    assert all(b > a for a, b in itertools.pairwise(tokens))
    assert tokens[0] >= 1


def test_verify_and_context_manager(sem3: PersistentSemaphore) -> None:
    with sem3.acquire() as lease:  # type: ignore[union-attr]
        assert lease.verify()
        assert lease.held and not lease.lost.is_set()
    assert lease.released
    assert lease.lost_reason is None  # a clean release is not a loss


def test_missing_semaphore_is_a_clear_error(broker: Broker, name: str) -> None:
    with pytest.raises(SemaphoreNotFound, match=slot_queue(name, 1)):
        PersistentSemaphore(broker, name).acquire(blocking=False)


def test_missing_semaphore_in_cluster_mode_is_a_clear_error(amqp_url: str, name: str) -> None:
    """Cluster mode's semaphore is a quorum token queue: a missing one is SemaphoreNotFound
    naming that queue (no seed slot queue either, so not ModeMismatch), blocking or not,
    and the check leaves the Broker usable: the next acquire, of one that exists, is
    granted on it."""
    with Broker(amqp_url, cluster=True, heartbeat=10.0) as b:
        missing = re.escape(token_queue(slots_name(name)))
        for blocking, timeout in ((False, None), (True, 1.0)):
            with pytest.raises(SemaphoreNotFound, match=missing) as raised:
                PersistentSemaphore(b, name).acquire(blocking=blocking, timeout=timeout)
            assert "cluster mode" in str(raised.value)
        admin = SemaphoreAdmin(b, name)
        admin.create(1)
        try:
            lease = PersistentSemaphore(b, name).acquire(timeout=10)
            assert lease is not None and lease.number == 1
            lease.release()
        finally:
            admin.destroy()


def test_bad_arguments(broker: Broker, name: str) -> None:
    with pytest.raises(ConfigurationError):
        PersistentSemaphore(broker, name, max_races=-1)
    SemaphoreAdmin(broker, name).create(1)
    with pytest.raises(ConfigurationError, match="timeout"):
        PersistentSemaphore(broker, name).acquire(timeout=-2)


def test_waiter_is_woken_by_the_release_notice(amqp_url: str, broker: Broker, name: str) -> None:
    """With fallback polling set to 30 s, only the push notice can wake the waiter in time."""
    SemaphoreAdmin(broker, name).create(1)
    holder = PersistentSemaphore(broker, name).acquire()
    assert holder is not None
    got: list[Lease | None] = []
    with Broker(amqp_url) as other:
        waiting = _slow_waiter(other, name, got)
        holder.release()
        waiting.join(15)
        assert not waiting.is_alive(), "waiter was not woken by the release notice"
        assert got and got[0] is not None and got[0].number == 1
        got[0].release()


def _bound(broker: Broker) -> bool:
    async def check() -> bool:
        session = await broker.core.session()
        return any(w.ready for w in session.waiters)

    return broker.core.run(check())


def _slow_waiter(other: Broker, name: str, got: list[Lease | None]) -> threading.Thread:
    """A thread waiting on ``name`` through ``other`` with fallback polling set to 30 s (so
    only a push notice wakes it in time), appending its lease to ``got``; returned once
    it is waiting."""
    slow = PersistentSemaphore(other, name, backoff=Backoff(initial=30, maximum=30))
    waiting = threading.Thread(target=lambda: got.append(slow.acquire(timeout=60)))
    waiting.start()
    # the waiter's notice binding exists once it is waiting; poll the broker for it
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _bound(other):
        time.sleep(0.01)
    return waiting


def test_removed_slot_marks_lease_lost_and_gets_no_new_holder(
    broker: Broker, amqp_url: str, name: str
) -> None:
    admin = SemaphoreAdmin(broker, name)
    admin.create(2)
    with Broker(amqp_url) as other:
        sem = PersistentSemaphore(other, name)
        first, second = sem.acquire(), sem.acquire()
        assert first is not None and second is not None and second.number == 2
        called = threading.Event()
        second.on_lost(lambda lease: called.set())
        admin.remove_slots(1)
        assert second.lost.wait(10), "holder of a removed slot was not told"
        assert called.wait(10)
        assert "removed" in (second.lost_reason or "")
        assert not second.verify()
        first.release()
        # slot 1 is free again, slot 2 no longer exists: nobody gets 2
        again = [sem.acquire(blocking=False), sem.acquire(blocking=False)]
        assert [lease.number for lease in again if lease] == [1]
        second.release()
        assert admin.holders(beyond=2) == [1]


def test_deleted_holder_queue_marks_lease_lost(node, broker: Broker, name: str) -> None:  # type: ignore[no-untyped-def]
    """Only an operator can delete another connection's exclusive queue (rabbitmqctl)."""
    SemaphoreAdmin(broker, name).create(1)
    with Broker(node.url) as other:
        lease = PersistentSemaphore(other, name).acquire()
        assert lease is not None
        devbroker.rabbitmqctl(node, "delete_queue", holder_queue(name, 1))
        assert lease.lost.wait(10)
        assert "deleted" in (lease.lost_reason or "")


def test_blocked_caller_keeps_its_lease_through_heartbeats(amqp_url: str, name: str) -> None:
    """The I/O thread heartbeats while the caller blocks for > 3 heartbeat intervals."""
    with Broker(amqp_url, heartbeat=1) as b:
        SemaphoreAdmin(b, name).create(1)
        lease = PersistentSemaphore(b, name).acquire()
        assert lease is not None
        time.sleep(3.5)  # the scenario itself: a caller busy for 3.5 heartbeat periods
        assert not lease.lost.is_set()
        assert lease.verify()
        lease.release()


def test_cut_connection_marks_leases_lost(proxy, name: str, broker: Broker) -> None:  # type: ignore[no-untyped-def]
    SemaphoreAdmin(broker, name).create(2)
    with Broker(proxy.url(), heartbeat=5) as b:
        sem = PersistentSemaphore(b, name)
        leases = [sem.acquire(), sem.acquire()]
        proxy.reset()
        for lease in leases:
            assert lease is not None
            assert lease.lost.wait(10)
            assert "connection" in (lease.lost_reason or "")
        # the broker drops the B queues of the dead connection: the slots come back
        again = PersistentSemaphore(broker, name)
        got = [again.acquire(timeout=10), again.acquire(timeout=10)]
        assert sorted(g.number for g in got if g) == [1, 2]
        # and the old Broker reconnects for new work
        assert SemaphoreAdmin(b, name).max_slots() == 2


def test_silent_partition_is_detected_before_the_broker_regrants(
    proxy, name: str, broker: Broker
) -> None:  # type: ignore[no-untyped-def]
    """Blackhole the connection: the client must mark the lease lost (missed heartbeats)
    before the broker deletes its B queue and another client can take the slot."""
    SemaphoreAdmin(broker, name).create(1)
    with Broker(proxy.url(), heartbeat=2) as b:
        lease = PersistentSemaphore(b, name).acquire()
        assert lease is not None
        lost_at: list[float] = []

        def on_event(ev: events.Event) -> None:  # on the holder's I/O thread, as it learns
            if ev.type == "lost" and ev.name == name:
                lost_at.append(time.monotonic())

        # Not lease.on_lost: its callbacks run on a helper thread, whose stamp could come
        # after the rival's grant on a loaded machine though the lease knew before.
        unsubscribe = events.subscribe(on_event)
        proxy.blackhole()
        start = time.monotonic()
        try:
            rival = PersistentSemaphore(broker, name).acquire(timeout=60)
            regranted_at = time.monotonic()
        finally:
            unsubscribe()
        assert rival is not None
        assert lease.lost.is_set()
        assert lost_at and lost_at[0] < regranted_at
        print(
            f"detected after {lost_at[0] - start:.2f}s, re-granted after "
            f"{regranted_at - start:.2f}s"
        )
        rival.release()
        proxy.heal()


def test_threads_contending_never_exceed_slots(broker: Broker, name: str) -> None:
    slots, threads_n, rounds = 3, 8, 15
    SemaphoreAdmin(broker, name).create(slots)
    lock = threading.Lock()
    occupancy = [0] * (slots + 1)
    counters = [0, 0, 0, 0]

    def work() -> None:
        sem = PersistentSemaphore(broker, name, max_races=1000)
        for _ in range(rounds):
            lease = sem.acquire(timeout=60)
            assert lease is not None
            with lock:
                counters[0] += 1
                counters[3] += 1
                counters[1] = max(counters[1], counters[0])
                if counters[0] > slots or occupancy[lease.number]:
                    counters[2] += 1
                occupancy[lease.number] += 1
            time.sleep(0.001)
            with lock:
                counters[0] -= 1
                occupancy[lease.number] -= 1
            lease.release()

    ts = [threading.Thread(target=work) for _ in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert counters[3] == threads_n * rounds
    assert counters[2] == 0, f"{counters[2]} overlaps"
    assert 1 <= counters[1] <= slots


def test_processes_contending_never_exceed_slots(amqp_url: str, broker: Broker, name: str) -> None:
    slots, procs_n, rounds = 3, 6, 15
    SemaphoreAdmin(broker, name).create(slots)
    counters = workers.contend_in_processes(amqp_url, name, slots, procs_n, rounds)
    assert counters[3] == procs_n * rounds
    assert counters[2] == 0, f"{counters[2]} overlaps"
    assert counters[1] <= slots
    assert SemaphoreAdmin(broker, name).holders() == []  # nothing leaked


def _spawn_holder(url: str, name: str, kind: str) -> tuple[subprocess.Popen[str], int, int]:
    p, numbers = spawn_held("tests.workers", url, name, kind)
    return p, numbers[0], numbers[1]


@pytest.mark.parametrize("kind", ["semaphore", "mutex"])
def test_kill_9_of_a_holder_wakes_a_waiter_by_push(
    amqp_url: str, broker: Broker, name: str, kind: str
) -> None:
    """The dead holder's sentinel goes to the waiter: with fallback polling set to 30 s,
    only that push can hand it the lock in time."""
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
    proc, _, token = _spawn_holder(amqp_url, name, kind)
    lock = (
        PersistentSemaphore(broker, name, backoff=Backoff(30, 30))
        if kind == "semaphore"
        else Mutex(broker, name, backoff=Backoff(30, 30))
    )
    got: list[Lease | None] = []
    waiting = threading.Thread(target=lambda: got.append(lock.acquire(timeout=60)))
    waiting.start()
    deadline = time.monotonic() + 20
    while not _bound(broker):  # the push can reach only a waiter that consumes
        assert time.monotonic() < deadline, "the waiter never subscribed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    waiting.join(15)
    assert not waiting.is_alive(), "the waiter was not woken by the dead holder's sentinel"
    assert got and got[0] is not None and got[0].fencing_token > token
    got[0].release()


def test_kill_9_of_a_holder_frees_its_slot(amqp_url: str, broker: Broker, name: str) -> None:
    SemaphoreAdmin(broker, name).create(1)
    proc, slot, token = _spawn_holder(amqp_url, name, "semaphore")
    assert slot == 1
    sem = PersistentSemaphore(broker, name)
    assert sem.acquire(blocking=False) is None
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    lease = sem.acquire(timeout=30)  # the broker saw the socket close: B[1] is gone
    assert lease is not None and lease.number == 1
    assert lease.fencing_token > token
    lease.release()


def test_woken_waiter_gets_the_freed_slot(amqp_url: str, broker: Broker, name: str) -> None:
    """Five slots held; the notice for slot 4 wakes one waiter, which takes slot 4."""
    SemaphoreAdmin(broker, name).create(5)
    sem = PersistentSemaphore(broker, name)
    held = [sem.acquire() for _ in range(5)]
    got: list[Lease | None] = []
    with Broker(amqp_url) as other:
        waiting = _slow_waiter(other, name, got)
        assert held[3] is not None and held[3].number == 4
        held[3].release()
        waiting.join(15)
        assert not waiting.is_alive(), "waiter was not woken by the notice"
        assert got and got[0] is not None and got[0].number == 4
        got[0].release()
    for lease in held:
        assert lease is not None
        lease.release()


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_a_releaser_asking_again_at_once_lets_the_waiter_go_first(
    broker: Broker, amqp_url: str, name: str, kind: str
) -> None:
    """One process loops acquire -> hold 5 ms -> release -> acquire; another asks once.
    The looper's next attempt right after its release would win almost every race, so it
    queues up behind the waiter instead: the waiter is granted within the looper's next
    two grants (waiting.POLITE_WINDOW). A later looper grant is allowed only where the
    library gives up waiting politely, at least POLITE_WINDOW after the looper's release
    (its re-check, or a re-ask that came that late): an impolite looper overtakes within
    milliseconds. On 4.3.6 under heavy load the waiter once took longer than that, and
    the looper's 1 s re-check took the lock back."""
    from amqp_locks.waiting import POLITE_WINDOW

    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)

    def lock(b: Broker) -> Mutex | PersistentSemaphore:
        return Mutex(b, name) if kind == "mutex" else PersistentSemaphore(b, name)

    stop = threading.Event()
    looper_grants: list[float] = []
    looper_releases: list[float] = []

    def loop() -> None:
        with Broker(amqp_url) as own:
            lk = lock(own)
            while not stop.is_set():
                lease = lk.acquire(timeout=30)
                assert lease is not None
                looper_grants.append(time.monotonic())
                time.sleep(0.005)  # the hold itself, not synchronisation
                lease.release()
                looper_releases.append(time.monotonic())

    looper = threading.Thread(target=loop)
    looper.start()
    try:
        deadline = time.monotonic() + 20
        while len(looper_grants) < 5:
            assert time.monotonic() < deadline, "the looper never got going"
            time.sleep(0.01)
        for _ in range(3):
            got: list[Lease | None] = []
            waiter = threading.Thread(
                target=lambda got=got: got.append(lock(broker).acquire(timeout=30))
            )
            waiter.start()
            # Count from the moment the waiter is subscribed to the wake-ups: from then on
            # the looper, asking again at once, finds a waiter and lets it go first.
            deadline = time.monotonic() + 20
            while not _bound(broker) and waiter.is_alive():
                assert time.monotonic() < deadline, "the waiter never subscribed"
                time.sleep(0.002)
            bound = time.monotonic()
            waiter.join(30)
            granted = time.monotonic()
            assert got and got[0] is not None
            got[0].release()
            grants = [i for i, t in enumerate(looper_grants) if bound < t < granted]
            between = [round(looper_grants[i] - bound, 3) for i in grants]
            # at most the grant already under way when the waiter subscribed; any later one
            # only after the looper waited politely (its release is i - 1: one grant each)
            gaps = [round(looper_grants[i] - looper_releases[i - 1], 3) for i in grants[1:]]
            impolite = [g for g in gaps if g < 0.9 * POLITE_WINDOW]
            assert not impolite, (
                f"the releaser was granted {len(between)} times meanwhile, at {between} s "
                f"after the waiter subscribed, {gaps} s after its own releases; the waiter "
                f"got it at {granted - bound:.3f} s"
            )
    finally:
        stop.set()
        looper.join(60)


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_a_releaser_asking_again_leaves_its_notice_to_a_busy_waiter(
    broker: Broker, amqp_url: str, name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter takes one notice at a time (prefetch 1) and acks it after its attempt, so
    a release during that attempt leaves its notice ready in the wake-up queue. A
    releaser that asks again at once must not subscribe and take that notice itself (it
    did: rehearsal 48's CI, the looper test above, re-granted 18 ms after its release);
    it waits until the waiter has it, then queues up behind. The busy waiter here is a
    raw consumer holding an earlier notice for 0.3 s; then it takes the release's notice
    and, answering it, finds the lock free (a try through its own connection) while the
    releaser still waits; the releaser is granted only after that try releases. The
    polite window is widened to 10 s so a slow machine cannot end it first."""
    import asyncio

    from aiormq.abc import AbstractChannel, DeliveredMessage

    from amqp_locks import waiting
    from amqp_locks.names import wakeup_queue
    from amqp_locks.transport.features import helper_queue

    monkeypatch.setattr(waiting, "POLITE_WINDOW", 10.0)
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)

    def lock(b: Broker) -> Mutex | PersistentSemaphore:
        return Mutex(b, name) if kind == "mutex" else PersistentSemaphore(b, name)

    queue = wakeup_queue(name, "mutex" if kind == "mutex" else "sem")
    delivered: list[int] = []
    arrived = threading.Event()

    async def on_notice(message: DeliveredMessage) -> None:
        delivered.append(message.delivery_tag or 0)
        arrived.set()

    async def busy_waiter() -> AbstractChannel:
        session = await broker.core.session()
        ch = await session.open_channel()
        await ch.basic_qos(prefetch_count=1)
        await ch.queue_declare(queue, **helper_queue(session, wakeups=True))
        await ch.basic_consume(queue, on_notice, no_ack=False)
        await ch.basic_publish(b"0", routing_key=queue)  # the notice it is busy with
        return ch

    with Broker(amqp_url) as releaser:
        lease = lock(releaser).acquire(timeout=10)
        assert lease is not None
        ch = broker.core.run(busy_waiter())
        assert arrived.wait(10), "the busy waiter's own notice never came"
        arrived.clear()
        lease.release()  # its notice stays ready: the only waiter is busy
        again: list[Lease | None] = []
        asking = threading.Thread(target=lambda: again.append(lock(releaser).acquire(timeout=30)))
        asking.start()
        asking.join(0.3)  # the busy waiter's attempt takes this long
        assert not again, "the releaser took the notice left for the busy waiter"
        broker.core.run(ch.basic_ack(delivered[0]))
        assert arrived.wait(10), "the release's notice never reached the waiter"
        mine = lock(broker).acquire(blocking=False)
        assert mine is not None, "the releaser overtook the woken waiter"
        assert not again, "the releaser was granted while the waiter held the lock"
        mine.release()
        asking.join(30)
        assert again and again[0] is not None
        again[0].release()
        broker.core.run(asyncio.wait_for(ch.close(), 10))


def test_a_deleted_fence_counter_is_rebuilt_once_from_a_floor_and_tokens_keep_rising(
    node: devbroker.NodeInfo, broker: Broker, amqp_url: str, name: str
) -> None:
    """A semaphore whose fence counter was deleted by hand refuses typed (FenceMissing)
    rather than restart low; once rebuilt from the floor, two holders racing on two
    connections leave exactly one fence message, with tokens above the floor."""
    drop_fence_shard(node, broker, name)
    SemaphoreAdmin(broker, name).create(2)
    first = PersistentSemaphore(broker, name).acquire(timeout=10)
    assert first is not None and first.fencing_token > 0
    first.release()
    devbroker.rabbitmqctl(node, "delete_queue", fence_counter(broker, name))
    with Broker(amqp_url) as fresh, pytest.raises(FenceMissing, match="repair"):
        PersistentSemaphore(fresh, name).acquire(timeout=10)
    assert SemaphoreAdmin(broker, name).repair_fence(first.fencing_token) is True

    start = threading.Barrier(2)
    tokens: list[int] = []
    errors: list[BaseException] = []

    def holder(b: Broker) -> None:
        try:
            start.wait(30)
            with PersistentSemaphore(b, name, timeout=30) as lease:
                tokens.append(lease.fencing_token)
        except BaseException as exc:
            errors.append(exc)

    with Broker(amqp_url) as other:
        threads = [threading.Thread(target=holder, args=(b,)) for b in (broker, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert len(tokens) == 2 and len(set(tokens)) == 2 and min(tokens) > first.fencing_token
    assert fence_messages(broker, name) == 1  # one fence, not one per racing holder
