"""Cluster mode's mutex on a fresh name (tokens/fresh.py), on one node with ``cluster=True``:
made on first use by a test-and-set declaration, with no administration mutex and no
ledger, exactly one token however many processes race, and gone once unused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from amqp_locks import Broker, LockError, Mutex, TokenAdmin, TokenSemaphore, stamps
from amqp_locks.errors import PreconditionFailed, QueueNotFound
from amqp_locks.names import fence_queue, quorum_mutex_name, token_queue
from amqp_locks.tokens import fresh
from amqp_locks.tokens.ledger import ledger_queue
from amqp_locks.tokens.message import token_properties

from . import waiting
from .conftest import fence_counter, queue_exists
from .conftest import queue_counts as counts
from .workers import race_first_use

#: A first-use queue's expiry in these tests (ms): short, so a test sees it go.
SHORT_EXPIRES_MS = 1500


@pytest.fixture
def cluster_broker(amqp_url: str) -> Iterator[Broker]:
    b = Broker(amqp_url, cluster=True, heartbeat=5.0)
    yield b
    b.close()


def wire(name: str) -> str:
    """The token queue of cluster mode's mutex `name`."""
    return token_queue(quorum_mutex_name(name))


def settles_at(broker: Broker, queue: str, want: tuple[int, int], timeout: float = 10.0) -> None:
    """Poll until `queue` has `want` (ready, consumers): a quorum queue's counts follow a
    release or a channel's close a moment after the client was answered (4.3)."""
    waiting.wait_until(lambda: counts(broker, queue) == want, timeout, f"{queue!r} at {want}", 0.02)


def await_gone(broker: Broker, queue: str, timeout: float = 30.0) -> None:
    """Poll until the broker deleted `queue` (passive declares do not keep it alive)."""
    waiting.wait_until(
        lambda: not queue_exists(broker, queue), timeout, f"{queue!r} to expire", 0.1
    )


def test_the_broker_refuses_a_second_stamp(cluster_broker: Broker, name: str) -> None:
    """The fact the test-and-set rests on: a queue declared again with another
    x-max-length is refused (406), and the publish sent behind the refused declaration is
    dropped; the same stamp is accepted."""
    queue = wire(name)

    async def go() -> list[bool]:
        session = await cluster_broker.core.session()
        two = [stamps.new_stamp(), stamps.new_stamp()]
        made = []
        for stamp in [two[0], two[1], two[0]]:
            try:
                await session.declare_and_publish(
                    queue,
                    fresh.fresh_arguments(session, stamp),
                    [(b"1", token_properties(quorum_mutex_name(name), 1, {}))],
                )
                made.append(True)
            except PreconditionFailed as exc:
                assert "inequivalent arg 'x-max-length'" in str(exc)
                made.append(False)
        return made

    assert cluster_broker.core.run(go()) == [True, False, True]
    assert counts(cluster_broker, queue) == (2, 0)  # the first and the third
    cluster_broker.core.run(_delete(cluster_broker, queue))


async def _delete(broker: Broker, queue: str) -> None:
    await (await broker.core.session()).delete(queue)


def test_first_use_leaves_no_admin_mutex_and_no_ledger(cluster_broker: Broker, name: str) -> None:
    lease = Mutex(cluster_broker, name).acquire(timeout=10)
    assert lease is not None and lease.number == 1 and lease.fencing_token >= 1
    assert counts(cluster_broker, wire(name)) == (0, 1)  # held: one consumer, no ready
    lease.release(wait=True)
    settles_at(cluster_broker, wire(name), (1, 0))  # exactly one token, back
    assert not queue_exists(cluster_broker, ledger_queue(quorum_mutex_name(name)))
    assert not queue_exists(cluster_broker, quorum_mutex_name(name))  # no admin mutex queue
    assert not queue_exists(cluster_broker, fence_queue(quorum_mutex_name(name)))  # a shard's
    assert queue_exists(cluster_broker, fence_counter(cluster_broker, quorum_mutex_name(name)))


def test_a_connection_given_up_mid_creation_keeps_the_token(
    cluster_broker: Broker, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client gives its connection up (as the quorum guard does) right after a first
    use's creation is on the socket: the abort waits for the creation (Session.drop), so
    the queue gets its token and the acquire, failed over to a new connection, holds it,
    and exactly one token exists. Aborted at once, the broker dropped the token (39 of 40
    tries on 3.10.8, 40 of 40 on 4.3.6) and the name stayed tokenless until it expired."""
    from amqp_locks.transport import queue_ops

    original = queue_ops._declare_and_publish
    core = cluster_broker.core
    given_up: list[str] = []

    async def and_give_up(ch: Any, queue: str, arguments: Any, messages: Any) -> None:
        if given_up:
            return await original(ch, queue, arguments, messages)
        session = await core.session()
        creation = asyncio.ensure_future(original(ch, queue, arguments, messages))
        for _ in range(100):  # until the writer has taken the frames to the socket
            await asyncio.sleep(0)
            if ch.confirmations and ch.write_queue.empty():
                break
        await asyncio.sleep(0)
        given_up.append(queue)
        session.drop("given up by the test")
        return await creation

    monkeypatch.setattr(queue_ops, "_declare_and_publish", and_give_up)
    lease = Mutex(cluster_broker, name).acquire(timeout=15)
    assert given_up == [wire(name)]
    assert lease is not None
    lease.release(wait=True)
    settles_at(cluster_broker, wire(name), (1, 0))  # exactly one token


def test_non_blocking_first_use_gets_the_lock(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    lease = Mutex(cluster_broker, name).acquire(blocking=False)
    assert lease is not None
    with Broker(amqp_url, cluster=True, heartbeat=5.0) as other:
        assert Mutex(other, name).acquire(blocking=False) is None
    lease.release(wait=True)


def test_processes_racing_on_a_fresh_name_hold_it_one_at_a_time(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    racers = 8
    current, most, violations, grants = race_first_use([[amqp_url]] * racers, name)
    assert (current, violations, grants) == (0, 0, racers)
    assert most == 1
    settles_at(cluster_broker, wire(name), (1, 0))  # exactly one token was made


def test_the_queue_expires_once_unused_and_is_made_again_with_higher_tokens(
    cluster_broker: Broker, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fresh, "EXPIRES_MS", SHORT_EXPIRES_MS)
    tokens = []
    with Mutex(cluster_broker, name, timeout=10) as lease:
        tokens.append(lease.fencing_token)
    with Mutex(cluster_broker, name, timeout=10) as lease:
        tokens.append(lease.fencing_token)
    await_gone(cluster_broker, wire(name))
    with Mutex(cluster_broker, name, timeout=10) as lease:
        tokens.append(lease.fencing_token)
    assert tokens == sorted(set(tokens)), tokens
    await_gone(cluster_broker, wire(name))


def test_a_held_token_keeps_its_queue(
    amqp_url: str, cluster_broker: Broker, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held for several expiry periods, the queue stays; the holder still verifies."""
    monkeypatch.setattr(fresh, "EXPIRES_MS", SHORT_EXPIRES_MS)
    lease = Mutex(cluster_broker, name).acquire(timeout=10)
    assert lease is not None
    with Broker(amqp_url, cluster=True, heartbeat=5.0) as other:
        # A waiter that times out after three expiry periods: the queue outlived them.
        assert Mutex(other, name).acquire(timeout=3 * SHORT_EXPIRES_MS / 1000) is None
    assert lease.verify() and queue_exists(cluster_broker, wire(name))
    lease.release(wait=True)
    await_gone(cluster_broker, wire(name))


def test_status_holders_and_audit_of_a_first_use_mutex(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    with Broker(amqp_url, cluster=True, heartbeat=5.0, holder_id="w-1") as holder:
        with Mutex(holder, name, timeout=10):
            mutex = Mutex(cluster_broker, name)
            assert mutex.locked()
            record = mutex.holder(timeout=10)  # returns once the holder's bind answers
            assert record is not None and record.holder_id == "w-1"
            st = TokenAdmin(cluster_broker, quorum_mutex_name(name)).status()
            assert (st.permits, st.ready, st.held) == (1, 0, 1)
        # Leaving the block waits at most 2 s for the broker's confirm (lockobject.py); a
        # loaded CI lane (4.3.6) took longer once, so the free token is awaited here.
        waiting.wait_until(lambda: not Mutex(cluster_broker, name).locked(), 15, "the release")
    audit = TokenAdmin(cluster_broker, quorum_mutex_name(name)).audit(timeout=5)
    assert audit.ok and audit.seen == (1,)


def test_a_queue_set_up_the_old_way_is_used_as_it_is(cluster_broker: Broker, name: str) -> None:
    """The earlier release's queue (TokenAdmin.setup: no x-expires, a ledger): a first-use
    declaration is refused by it (406) and adds nothing; the mutex takes its token."""
    wire_name = quorum_mutex_name(name)
    TokenAdmin(cluster_broker, wire_name, quorum=True).setup(1)

    async def create() -> str:
        return await fresh.create(await cluster_broker.core.session(), wire_name)

    assert cluster_broker.core.run(create()) == "other"
    settles_at(cluster_broker, wire(name), (1, 0))
    with Mutex(cluster_broker, name, timeout=10) as lease:
        assert lease.number == 1
        st = TokenAdmin(cluster_broker, wire_name).status()
        assert (st.permits, st.held) == (1, 1)
    assert queue_exists(cluster_broker, ledger_queue(wire_name))
    TokenAdmin(cluster_broker, wire_name).destroy()


def test_repair_gives_a_tokenless_first_use_queue_its_token(
    cluster_broker: Broker, name: str
) -> None:
    """The residual window (a creator lost between its declaration and its token) leaves
    a queue without a token: waiters time out; `repair` publishes the token."""
    wire_name = quorum_mutex_name(name)

    async def declare_empty() -> None:
        session = await cluster_broker.core.session()
        args = fresh.fresh_arguments(session, stamps.new_stamp())
        await session.declare(token_queue(wire_name), durable=True, arguments=args)

    cluster_broker.core.run(declare_empty())
    assert Mutex(cluster_broker, name).acquire(timeout=0.5) is None
    # Repair while nobody holds or waits (the timed-out waiter's consumer goes a moment
    # after its acquire returned): on 3.x a replaced queue's holders would not be told.
    settles_at(cluster_broker, wire(name), (0, 0))
    audit = TokenAdmin(cluster_broker, wire_name).repair(timeout=1)
    assert audit.missing == (1,)
    lease = Mutex(cluster_broker, name).acquire(timeout=10)
    assert lease is not None and lease.number == 1
    lease.release(wait=True)
    settles_at(cluster_broker, wire(name), (1, 0))


def test_a_first_use_token_semaphore_checks_its_permits(amqp_url: str) -> None:
    from amqp_locks import ConfigurationError

    with Broker(amqp_url) as b:
        for bad in (0, -1, stamps.MAX_PERMITS + 1, True, 2.0):
            with pytest.raises(ConfigurationError, match="permits"):
                TokenSemaphore(b, "n", first_use=True, permits=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="first_use"):
            TokenSemaphore(b, "n", permits=2)


def test_the_stamp_holds_the_count() -> None:
    for permits in (1, 3, stamps.MAX_PERMITS):
        made = {stamps.new_stamp(permits) for _ in range(50)}
        assert len(made) == 50  # random: racers never share one
        for stamp in made:
            assert stamps.STAMP_RANGE[0] <= stamp < stamps.STAMP_RANGE[1]
            assert stamps.permits_of(stamp) == permits


@pytest.mark.parametrize("cluster", [True, False], ids=["quorum", "classic"])
def test_processes_racing_on_a_fresh_counting_semaphore_make_exactly_its_permits(
    amqp_url: str, name: str, cluster: bool
) -> None:
    """8 processes, one fresh name, 3 permits: never more than 3 holders (counted), every
    racer granted, and exactly 3 tokens left: one creator's, none of the others'."""
    current, most, violations, grants = race_first_use(
        [[amqp_url]] * 8, name, permits=3, cluster=cluster
    )
    assert (current, violations, grants) == (0, 0, 8)
    assert 1 <= most <= 3
    with Broker(amqp_url, cluster=cluster) as b:
        settles_at(b, token_queue(name), (3, 0))
        st = TokenAdmin(b, name).status()  # no ledger: the count is read from the stamp
        assert (st.permits, st.ready, st.held) == (3, 3, 0)
        assert not queue_exists(b, ledger_queue(name)) and not queue_exists(b, fence_queue(name))
        b.core.run(_delete(b, token_queue(name)))


def _race_once(b: Broker, name: str, kind: str, start: Any, granted: list[str]) -> None:
    """One racer: take `name` (4 permits, or one of 4 read tokens) once, and say so."""
    from amqp_locks import ReadWriteLock

    # No fencing: what is tested is the first consume of each racer; fence shards have
    # their own races (test_fence_generations.py).
    lock: Any = (
        TokenSemaphore(b, name, first_use=True, permits=4, fencing=False)
        if kind == "semaphore"
        else ReadWriteLock(b, name, readers=4, fencing=False).read_lock
    )
    start.wait(30)
    try:
        lease = lock.acquire(timeout=60)
    except BaseException as exc:
        granted.append(f"{name}: {exc!r}")
        raise
    granted.append(name if lease is not None else f"{name}: not granted in 60 s")
    if lease is not None:
        lease.release()


@pytest.mark.parametrize("kind", ["semaphore", "rwlock"])
def test_racers_refused_while_the_queue_starts_keep_their_connections(
    amqp_url: str, kind: str
) -> None:
    """A racer may find the quorum queue still starting (its record written, its Raft
    member not running): after its own test-and-set was refused, or when its first
    consume lands then. A consume then makes the broker close the racer's whole
    connection, dropping every lock held on it (541 noproc); the library sees the queue
    run first (fresh.until_running). Raw aiormq losers that consumed at once lost their
    connection in 3 of 50 two-client races on 4.0.5. Here 4 Brokers race on 20 fresh
    names (4 permits, 4 readers: all are granted), and no connection may be closed by the
    broker."""
    import threading
    import uuid

    from amqp_locks.rwlock.admin import readers_queue, writer_queue

    brokers = [Broker(amqp_url, cluster=True, heartbeat=5.0) for _ in range(4)]
    names = [f"t{uuid.uuid4().hex[:12]}" for _ in range(20)]
    try:
        sessions = [b.core.run(b.core.session()) for b in brokers]
        for name in names:
            start = threading.Barrier(len(brokers))
            granted: list[str] = []
            threads = [
                threading.Thread(target=_race_once, args=(b, name, kind, start, granted))
                for b in brokers
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert granted == [name] * len(brokers), granted
        lost = [s.lost_reason for s in sessions]
        assert lost == [None] * len(brokers), lost
        assert [b.core.run(b.core.session()) for b in brokers] == sessions  # none replaced
    finally:
        for name in names:
            for q in (token_queue(name), readers_queue(name), writer_queue(name)):
                brokers[0].core.run(_delete(brokers[0], q))
        for b in brokers:
            b.close()


def test_another_count_is_refused_by_name(amqp_url: str, cluster_broker: Broker, name: str) -> None:
    """A first-use semaphore made with 2 permits refuses a user giving 3, and the error
    names both; a user giving 2 is served, and a resize is refused (the stamp fixes it)."""
    sem2 = TokenSemaphore(cluster_broker, name, first_use=True, permits=2)
    with sem2.acquire(timeout=10) as lease:
        assert lease.number in (1, 2)
    with Broker(amqp_url, cluster=True) as other:
        with pytest.raises(LockError, match=r"with 2 permit\(s\), not 3"):
            TokenSemaphore(other, name, first_use=True, permits=3).acquire(timeout=10)
        again = TokenSemaphore(other, name, first_use=True, permits=2)
        leases = [again.acquire(timeout=10), again.acquire(timeout=10)]
        assert sorted(x.number for x in leases if x is not None) == [1, 2]
        assert again.acquire(blocking=False) is None  # exactly 2
        for x in leases:
            assert x is not None
            x.release(wait=True)
    with pytest.raises(LockError, match="made on first use with 2"):
        TokenAdmin(cluster_broker, name).add_permits(1)
    audit = TokenAdmin(cluster_broker, name).audit(timeout=2)
    assert audit.ok and audit.seen == (1, 2)
    cluster_broker.core.run(_delete(cluster_broker, token_queue(name)))


def test_repair_of_a_counting_first_use_queue_fences_by_shard(
    cluster_broker: Broker, name: str
) -> None:
    """A creator lost after its declaration leaves no tokens: repair reads the count from
    the stamp and publishes them, with no per-name fence; grants take shard tokens."""

    async def declare_empty() -> None:
        session = await cluster_broker.core.session()
        args = fresh.fresh_arguments(session, stamps.new_stamp(3))
        await session.declare(token_queue(name), durable=True, arguments=args)

    cluster_broker.core.run(declare_empty())
    audit = TokenAdmin(cluster_broker, name).repair(timeout=1)
    assert audit.missing == (1, 2, 3)
    settles_at(cluster_broker, token_queue(name), (3, 0))
    sem = TokenSemaphore(cluster_broker, name, first_use=True, permits=3)
    tokens = []
    for _ in range(2):
        with sem.acquire(timeout=10) as lease:
            tokens.append(lease.fencing_token)
    assert tokens[0] < tokens[1] and tokens[0] > 2**50  # shard values (the clock's scale)
    assert not queue_exists(cluster_broker, fence_queue(name))
    cluster_broker.core.run(_delete(cluster_broker, token_queue(name)))


def test_held_max_length_reads_without_making(cluster_broker: Broker, name: str) -> None:
    """The read-only stamp probe: a missing queue stays missing."""

    async def probe() -> int | None:
        session = await cluster_broker.core.session()
        return await session.held_max_length(token_queue(name), fresh.fresh_arguments(session, 0))

    with pytest.raises(QueueNotFound):
        cluster_broker.core.run(probe())
    assert not queue_exists(cluster_broker, token_queue(name))


def test_aio_first_use_token_semaphore(amqp_url: str, name: str) -> None:
    """The asyncio twin: `first_use=True` makes the queue; status reads one permit."""
    import asyncio

    from amqp_locks import aio

    async def go() -> tuple[int, int]:
        async with aio.Broker(amqp_url, cluster=True, heartbeat=5.0) as b:
            sem = aio.TokenSemaphore(b, name, first_use=True)
            lease = await sem.acquire(timeout=10)
            assert lease is not None and lease.number == 1
            st = await sem.status()
            await lease.release(wait=True)
            return st.permits, st.held

    assert asyncio.run(go()) == (1, 1)
