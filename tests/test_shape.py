"""Every client agrees on a lock's shape (shape.py, issue 36 cases 2 and 6): each token
says its lock's kind, permit count and lock delay, and every grant checks them, so a
``Mutex`` never holds a token of a 2-permit queue, a 3-permit object never holds more than
3, and a client that needs a 6 s lock delay never holds a token of a 2 s queue. Cluster
mode on one node (``cluster=True``); the lock delay exists on RabbitMQ 4.3+ only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from amqp_locks import Broker, LockShapeMismatch, Mutex, ReadWriteLock, TokenSemaphore
from amqp_locks.cli.common import exit_code_for
from amqp_locks.cli.exitcodes import Exit
from amqp_locks.errors import LockError, PreconditionFailed
from amqp_locks.names import quorum_mutex_name, token_queue
from amqp_locks.rwlock.admin import readers_queue, writer_queue
from amqp_locks.shape import DELAY_HEADER, KIND_HEADER, PERMITS_HEADER
from amqp_locks.stamps import new_stamp
from amqp_locks.tokens import fresh
from amqp_locks.tokens.fencing import shard_headers
from amqp_locks.tokens.message import headers_of, text, token_properties
from amqp_locks.transport.session import Session

from . import waiting
from .conftest import on_session
from .conftest import queue_counts as counts


@pytest.fixture
def cluster_broker(amqp_url: str) -> Iterator[Broker]:
    b = Broker(amqp_url, cluster=True, heartbeat=5.0)
    yield b
    b.close()


def settles_at(broker: Broker, queue: str, want: tuple[int, int]) -> None:
    """A quorum queue's counts follow a channel's close a moment after the client."""
    waiting.wait_until(lambda: counts(broker, queue) == want, 10.0, f"{queue!r} at {want}", 0.02)


def delete(broker: Broker, *queues: str) -> None:
    async def go(session: Session) -> None:
        for queue in queues:
            await session.delete(queue)

    on_session(broker, go)


def version(broker: Broker) -> tuple[int, int]:
    async def go() -> tuple[int, int]:
        return (await broker.core.session()).version

    return broker.core.run(go())


def first_token_headers(broker: Broker, queue: str) -> dict[str, object]:
    """The headers of the token at the head of `queue` (taken and given back)."""

    async def go() -> dict[str, object]:
        session = await broker.core.session()
        ch = await session.open_channel()
        try:
            message = await ch.basic_get(queue, no_ack=False)
            return headers_of(message)
        finally:
            await ch.close()  # gives it back

    return broker.core.run(go())


def test_tokens_say_their_shape(cluster_broker: Broker, name: str) -> None:
    """A first-use token says its kind, count and (4.3: the queue's) lock delay."""
    sem = TokenSemaphore(cluster_broker, name, first_use=True, permits=2)
    with sem.acquire(timeout=10):
        pass
    mutex = Mutex(cluster_broker, name)
    with mutex.acquire(timeout=10):
        pass
    sem_headers = first_token_headers(cluster_broker, token_queue(name))
    mutex_headers = first_token_headers(cluster_broker, token_queue(quorum_mutex_name(name)))
    assert (text(sem_headers[KIND_HEADER]), sem_headers[PERMITS_HEADER]) == ("semaphore", 2)
    assert (text(mutex_headers[KIND_HEADER]), mutex_headers[PERMITS_HEADER]) == ("mutex", 1)
    if version(cluster_broker) >= (4, 3):
        assert sem_headers[DELAY_HEADER] == mutex_headers[DELAY_HEADER] == 10_000
    else:
        assert DELAY_HEADER not in sem_headers and DELAY_HEADER not in mutex_headers
    delete(cluster_broker, token_queue(name), token_queue(quorum_mutex_name(name)))


def test_a_mutex_never_holds_a_two_permit_queue(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    """Case 6: ``TokenSemaphore("X.mutex", permits=2)`` made the queue cluster mode's
    ``Mutex("X")`` uses. On main two Mutex holders held it at once; now every Mutex grant
    refuses it (the token goes back), naming both counts."""
    wire = quorum_mutex_name(name)
    sem = TokenSemaphore(cluster_broker, wire, first_use=True, permits=2)
    held = sem.acquire(timeout=10)
    assert held is not None  # one token held by the semaphore, one ready
    with Broker(amqp_url, cluster=True) as one, Broker(amqp_url, cluster=True) as two:
        for b in (one, two):
            with pytest.raises(LockShapeMismatch) as err:
                Mutex(b, name).acquire(timeout=10)
            assert err.value.held == 2 and err.value.wanted == 1
            assert err.value.queue == token_queue(wire)
            text = str(err.value)
            assert "2 permit(s), not 1" in text and f"Mutex {name!r}" in text
            assert isinstance(err.value, PreconditionFailed) and isinstance(err.value, LockError)
        # The refused token went back: one ready, one held by the semaphore, no Mutex holder.
        settles_at(cluster_broker, token_queue(wire), (1, 1))
    held.release(wait=True)
    delete(cluster_broker, token_queue(wire))


def test_a_one_permit_semaphore_is_not_a_mutex(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    """A mutex's tokens say "mutex": a token semaphore of any count, given the name, takes
    them only with the right count; and a Mutex refuses a set-up semaphore's queue whose
    ledger says 2 (its tokens say no count: the ledger is read)."""
    with Mutex(cluster_broker, name).acquire(timeout=10):
        pass
    wire = quorum_mutex_name(name)
    with TokenSemaphore(cluster_broker, wire, first_use=True, permits=1).acquire(timeout=10):
        pass  # a one-permit semaphore may take a mutex's token: same count
    with pytest.raises(LockShapeMismatch, match=r"1 permit\(s\), not 3"):
        TokenSemaphore(cluster_broker, wire, first_use=True, permits=3).acquire(timeout=10)
    delete(cluster_broker, token_queue(wire))
    other = f"{name}o"
    TokenSemaphore(cluster_broker, quorum_mutex_name(other), quorum=True).setup(2)
    with Broker(amqp_url, cluster=True) as b, pytest.raises(LockShapeMismatch) as err:
        Mutex(b, other).acquire(timeout=10)
    assert (err.value.held, err.value.wanted) == (2, 1)
    TokenSemaphore(cluster_broker, quorum_mutex_name(other), quorum=True).destroy()


def test_a_counted_semaphore_never_holds_more_after_its_queue_is_made_again(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    """Case 6: a ``permits=3`` object checked its count once, at its first acquire; its
    queue expired and was made again with 5, and it held 5. Now each grant checks."""
    three = TokenSemaphore(cluster_broker, name, first_use=True, permits=3)
    with three.acquire(timeout=10):
        pass
    delete(cluster_broker, token_queue(name))  # as its expiry would
    with Broker(amqp_url, cluster=True) as other:
        five = TokenSemaphore(other, name, first_use=True, permits=5)
        with five.acquire(timeout=10):
            pass
        held = []
        with pytest.raises(LockShapeMismatch) as err:
            for _ in range(5):
                lease = three.acquire(timeout=5)
                assert lease is not None
                held.append(lease)
        assert held == []  # not even one
        assert (err.value.held, err.value.wanted) == (5, 3)
        assert "5 permit(s), not 3" in str(err.value)
        settles_at(other, token_queue(name), (5, 0))
    delete(cluster_broker, token_queue(name))


def test_tokens_of_an_earlier_release_are_checked_by_the_queue(
    cluster_broker: Broker, name: str
) -> None:
    """A token that says no shape (minted by an earlier release) is checked against its
    queue's arguments: the stamp's count (and on 4.3 the lock delay)."""
    wire = quorum_mutex_name(name)

    async def legacy() -> None:
        session = await cluster_broker.core.session()
        args = fresh.fresh_arguments(session, new_stamp(2), True)
        messages = [(str(k).encode(), token_properties(wire, k, shard_headers())) for k in (1, 2)]
        await session.declare_and_publish(token_queue(wire), args, messages)

    cluster_broker.core.run(legacy())
    assert KIND_HEADER not in first_token_headers(cluster_broker, token_queue(wire))
    with pytest.raises(LockShapeMismatch, match=r"2 permit\(s\), not 1"):
        Mutex(cluster_broker, name).acquire(timeout=10)
    with TokenSemaphore(cluster_broker, wire, first_use=True, permits=2).acquire(timeout=10):
        pass  # the right count is served
    settles_at(cluster_broker, token_queue(wire), (2, 0))
    delete(cluster_broker, token_queue(wire))


def test_a_read_write_lock_of_another_r_is_refused_on_every_grant(
    amqp_url: str, cluster_broker: Broker, name: str
) -> None:
    """A lock made with R=3 refuses a client giving R=5 on its grants (reads and writes),
    not only when it makes the queues; tokens say R."""
    rw3 = ReadWriteLock(cluster_broker, name, readers=3)
    with rw3.write_lock.acquire(timeout=10):
        pass
    headers = first_token_headers(cluster_broker, readers_queue(name))
    assert headers[PERMITS_HEADER] == 3
    with Broker(amqp_url, cluster=True) as other:
        rw5 = ReadWriteLock(other, name, readers=5)
        for half in (rw5.read_lock, rw5.write_lock):
            with pytest.raises(LockShapeMismatch, match=r"3 permit\(s\), not 5"):
                half.acquire(timeout=10)
        any_r = ReadWriteLock(other, name)
        with any_r.read_lock.acquire(timeout=10), rw3.read_lock.acquire(timeout=10):
            pass
    settles_at(cluster_broker, readers_queue(name), (3, 0))
    settles_at(cluster_broker, writer_queue(name), (1, 0))
    ReadWriteLock(cluster_broker, name).destroy()


def test_a_default_client_refuses_a_short_lock_delay(amqp_url: str, name: str) -> None:
    """Case 2 (4.3+): a client with ``lock_delay=2`` made a mutex, a counting semaphore and
    a read-write lock; a client with the defaults (which needs >= 6,000 ms) acquired all
    three on main. Now each grant refuses, naming both delays; the refused creation path
    (a test-and-set that finds the queue) does too."""
    with Broker(amqp_url, cluster=True, lock_delay=2) as short:
        if version(short) < (4, 3):
            pytest.skip("x-consumer-disconnected-timeout (the lock delay) is RabbitMQ 4.3+")
        with Mutex(short, name).acquire(timeout=10):
            pass
        with TokenSemaphore(short, f"{name}s", first_use=True, permits=2).acquire(timeout=10):
            pass
        rw = ReadWriteLock(short, f"{name}r")
        with rw.write_lock.acquire(timeout=10):
            pass
        with rw.read_lock.acquire(timeout=10):
            pass
        with Broker(amqp_url, cluster=True) as default:
            locks = [
                Mutex(default, name),
                TokenSemaphore(default, f"{name}s", first_use=True, permits=2),
                ReadWriteLock(default, f"{name}r").read_lock,
                ReadWriteLock(default, f"{name}r").write_lock,
            ]
            for lock in locks:
                with pytest.raises(LockShapeMismatch) as err:
                    lock.acquire(timeout=10)
                assert (err.value.held, err.value.wanted) == (2000, 6000), lock
                assert "2000 ms" in str(err.value) and "6000 ms" in str(err.value)

            async def found() -> None:
                session = await default.core.session()
                await fresh.create(session, f"{name}s", 2, True)

            with pytest.raises(LockShapeMismatch, match="2000 ms"):
                default.core.run(found())
        # The short-delay client itself is still served; so is one needing less than 20 s
        # on a queue made with 20 s (a longer delay is safe).
        with Mutex(short, name).acquire(timeout=10):
            pass
    with (
        Broker(amqp_url, cluster=True, lock_delay=20) as long,
        Mutex(long, f"{name}l").acquire(timeout=10),
    ):
        pass
    with Broker(amqp_url, cluster=True) as default:
        with Mutex(default, f"{name}l").acquire(timeout=10):
            pass
        delete(
            default,
            token_queue(quorum_mutex_name(name)),
            token_queue(quorum_mutex_name(f"{name}l")),
            token_queue(f"{name}s"),
            readers_queue(f"{name}r"),
            writer_queue(f"{name}r"),
        )


def test_the_cli_maps_a_shape_mismatch_to_its_own_exit_code() -> None:
    err = LockShapeMismatch("lock queue 'x.semaphore' was made with 2 permit(s), not 1")
    code, message = exit_code_for(err)
    assert code == Exit.SHAPE == 76
    assert message.startswith("lock shape mismatch: ") and "2 permit(s), not 1" in message


def test_an_earlier_release_s_short_lock_delay_is_read_from_the_queue(
    amqp_url: str, name: str
) -> None:
    """4.3+: tokens that say no lock delay (an earlier release's) in a queue made with
    2 s are refused by a client that needs 6 s: the delay is read from the queue (a
    declaration the broker refuses either way), once per queue and session."""
    wire = quorum_mutex_name(name)
    with Broker(amqp_url, cluster=True, lock_delay=2) as short:
        if version(short) < (4, 3):
            pytest.skip("x-consumer-disconnected-timeout (the lock delay) is RabbitMQ 4.3+")

        async def legacy() -> None:
            session = await short.core.session()
            args = fresh.fresh_arguments(session, new_stamp(1), True)
            token = [(b"1", token_properties(wire, 1, shard_headers()))]
            await session.declare_and_publish(token_queue(wire), args, token)

        short.core.run(legacy())
        with Mutex(short, name).acquire(timeout=10):
            pass  # its own delay: served
    with Broker(amqp_url, cluster=True) as default:
        for _ in range(2):
            with pytest.raises(LockShapeMismatch) as err:
                Mutex(default, name).acquire(timeout=10)
            assert (err.value.held, err.value.wanted) == (2000, 6000)
        settles_at(default, token_queue(wire), (1, 0))
        delete(default, token_queue(wire))
