"""Cluster mode's mutex on a fresh name (tokens/fresh.py), on one node with ``cluster=True``:
made on first use by a test-and-set declaration, with no administration mutex and no
ledger, exactly one token however many processes race, and gone once unused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from amqp_locks import Broker, Mutex, TokenAdmin, TokenSemaphore
from amqp_locks.names import fence_queue, fence_shard, quorum_mutex_name, token_queue
from amqp_locks.tokens import fresh
from amqp_locks.tokens.ledger import ledger_queue
from amqp_locks.tokens.message import token_properties

from . import waiting
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


def exists(broker: Broker, queue: str) -> bool:
    async def go() -> bool:
        return await (await broker._core.session()).exists_passive(queue)

    return bool(broker._core.run(go()))


def counts(broker: Broker, queue: str) -> tuple[int, int]:
    """(ready messages, consumers), exactly (declare-ok counts quorum messages)."""

    async def go() -> tuple[int, int]:
        return await (await broker._core.session()).declare_passive_counts(queue)

    return broker._core.run(go())


def settles_at(broker: Broker, queue: str, want: tuple[int, int], timeout: float = 10.0) -> None:
    """Poll until `queue` has `want` (ready, consumers): a quorum queue's counts follow a
    release or a channel's close a moment after the client was answered (4.3)."""
    waiting.wait_until(lambda: counts(broker, queue) == want, timeout, f"{queue!r} at {want}", 0.02)


def await_gone(broker: Broker, queue: str, timeout: float = 30.0) -> None:
    """Poll until the broker deleted `queue` (passive declares do not keep it alive)."""
    waiting.wait_until(lambda: not exists(broker, queue), timeout, f"{queue!r} to expire", 0.1)


def test_the_broker_refuses_a_second_stamp(cluster_broker: Broker, name: str) -> None:
    """The fact the test-and-set rests on: a queue declared again with another
    x-max-length is refused (406), and the publish sent behind the refused declaration is
    dropped; the same stamp is accepted."""
    queue = wire(name)

    async def go() -> list[bool]:
        session = await cluster_broker._core.session()
        stamps = [fresh.new_stamp(), fresh.new_stamp()]
        made = []
        for stamp in [stamps[0], stamps[1], stamps[0]]:
            made.append(
                await session.declare_and_publish(
                    queue,
                    fresh.fresh_arguments(session, stamp),
                    b"1",
                    token_properties(quorum_mutex_name(name), 1, {}),
                )
            )
        return made

    assert cluster_broker._core.run(go()) == [True, False, True]
    assert counts(cluster_broker, queue) == (2, 0)  # the first and the third
    cluster_broker._core.run(_delete(cluster_broker, queue))


async def _delete(broker: Broker, queue: str) -> None:
    await (await broker._core.session()).delete(queue)


def test_first_use_leaves_no_admin_mutex_and_no_ledger(cluster_broker: Broker, name: str) -> None:
    lease = Mutex(cluster_broker, name).acquire(timeout=10)
    assert lease is not None and lease.number == 1 and lease.fencing_token >= 1
    assert counts(cluster_broker, wire(name)) == (0, 1)  # held: one consumer, no ready
    lease.release(wait=True)
    settles_at(cluster_broker, wire(name), (1, 0))  # exactly one token, back
    assert not exists(cluster_broker, ledger_queue(quorum_mutex_name(name)))
    assert not exists(cluster_broker, quorum_mutex_name(name))  # no admin mutex queue
    assert not exists(cluster_broker, fence_queue(quorum_mutex_name(name)))  # a shard's
    assert exists(cluster_broker, fence_shard(quorum_mutex_name(name)))


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
    assert lease.verify() and exists(cluster_broker, wire(name))
    lease.release(wait=True)
    await_gone(cluster_broker, wire(name))


def test_status_holders_and_audit_of_a_first_use_mutex(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    with Broker(amqp_url, cluster=True, heartbeat=5.0, holder_id="w-1") as holder:
        with Mutex(holder, name, timeout=10):
            mutex = Mutex(cluster_broker, name)
            assert mutex.locked()
            record = mutex.holder()
            assert record is not None and record.holder_id == "w-1"
            st = TokenAdmin(cluster_broker, quorum_mutex_name(name)).status()
            assert (st.permits, st.ready, st.held) == (1, 0, 1)
        assert not Mutex(cluster_broker, name).locked()
    audit = TokenAdmin(cluster_broker, quorum_mutex_name(name)).audit(timeout=5)
    assert audit.ok and audit.seen == (1,)


def test_a_queue_set_up_the_old_way_is_used_as_it_is(cluster_broker: Broker, name: str) -> None:
    """The earlier release's queue (TokenAdmin.setup: no x-expires, a ledger): a first-use
    declaration is refused by it (406) and adds nothing; the mutex takes its token."""
    wire_name = quorum_mutex_name(name)
    TokenAdmin(cluster_broker, wire_name, quorum=True).setup(1)

    async def create() -> bool:
        return await fresh.create(await cluster_broker._core.session(), wire_name)

    assert cluster_broker._core.run(create()) is False
    settles_at(cluster_broker, wire(name), (1, 0))
    with Mutex(cluster_broker, name, timeout=10) as lease:
        assert lease.number == 1
        st = TokenAdmin(cluster_broker, wire_name).status()
        assert (st.permits, st.held) == (1, 1)
    assert exists(cluster_broker, ledger_queue(wire_name))
    TokenAdmin(cluster_broker, wire_name).destroy()


def test_repair_gives_a_tokenless_first_use_queue_its_token(
    cluster_broker: Broker, name: str
) -> None:
    """The residual window (a creator lost between its declaration and its token) leaves
    a queue without a token: waiters time out; `repair` publishes the token."""
    wire_name = quorum_mutex_name(name)

    async def declare_empty() -> None:
        session = await cluster_broker._core.session()
        args = fresh.fresh_arguments(session, fresh.new_stamp())
        await session.declare(token_queue(wire_name), durable=True, arguments=args)

    cluster_broker._core.run(declare_empty())
    assert Mutex(cluster_broker, name).acquire(timeout=0.5) is None
    audit = TokenAdmin(cluster_broker, wire_name).repair(timeout=1)
    assert audit.missing == (1,)
    lease = Mutex(cluster_broker, name).acquire(timeout=10)
    assert lease is not None and lease.number == 1
    lease.release(wait=True)
    settles_at(cluster_broker, wire(name), (1, 0))


def test_first_use_token_semaphore_needs_quorum(amqp_url: str) -> None:
    from amqp_locks import ConfigurationError

    with Broker(amqp_url) as b, pytest.raises(ConfigurationError, match="quorum"):
        TokenSemaphore(b, "n", first_use=True)


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
