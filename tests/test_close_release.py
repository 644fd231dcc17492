"""Issue 22, points 3 and 4 on one node: closing a Broker under waiters, and what a
release promises (``release()``, ``release(wait=True)``, ``Broker.close()`` after it).

Every lock kind is covered: the mutex and the persistent semaphore (exclusive queues,
released by a delete), the token semaphore with and without fencing (a commit, or a bare
reject), and both halves of the read-write lock (rejects and a channel close).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from amqp_locks import (
    Broker,
    BrokerClosed,
    Lease,
    Mutex,
    PersistentSemaphore,
    ReadWriteLock,
    ReleaseUnconfirmed,
    SemaphoreAdmin,
    TokenAdmin,
    TokenSemaphore,
    aio,
)
from amqp_locks.errors import AmqpLocksError
from amqp_locks.transport.broker import SESSION_CLOSE_BOUND

from . import waiting
from .faultproxy import FaultProxy
from .test_round_trips import Wire, settle
from .test_round_trips import wire as counted_wire  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(120)

#: How soon a waiter must learn that its Broker was closed (the close itself takes a
#: round trip or two; the bound is generous for a loaded 2-core machine).
PROMPT = 2.0


@dataclass(frozen=True)
class Kind:
    """One lock kind: how to set it up, the lock a holder takes, the lock a waiter takes
    (the other half of a read-write lock), and whether a waiter is subscribed."""

    id: str
    setup: Callable[[Broker, str], None]
    held: Callable[[Any, str], Any]
    waiter: Callable[[Any, str], Any]
    waiting: Callable[[Broker, Any, str], bool]


def _no_setup(_b: Broker, _n: str) -> None:
    pass


def _slots(b: Broker, n: str) -> None:
    SemaphoreAdmin(b, n).create(1)


def _tokens(b: Broker, n: str) -> None:
    TokenSemaphore(b, n).setup(1)


def _unfenced(b: Any, n: str) -> Any:
    return (aio.TokenSemaphore if isinstance(b, aio.Broker) else TokenSemaphore)(
        b, n, fencing=False
    )


def _waiters_subscribed(_holder: Broker, waiter: Any, _name: str) -> bool:
    session = waiter.core._session
    return session is not None and any(w.ready for w in list(session.waiters))


def _token_waiting(holder: Broker, _waiter: Any, name: str) -> bool:
    return TokenSemaphore(holder, name).status().waiting >= 1


def _reader_waiting(holder: Broker, _waiter: Any, name: str) -> bool:
    status = ReadWriteLock(holder, name).status()
    return status is not None and status.consumers >= 2  # the writer and the reader


def _writer_waiting(holder: Broker, _waiter: Any, name: str) -> bool:
    status = ReadWriteLock(holder, name).status()
    return status is not None and status.writer  # a waiting writer takes the turn first


def _sync_or_aio(sync: Any, twin: Any) -> Callable[[Any, str], Any]:
    """A lock constructor for either facade, chosen by the broker's type."""

    def make(broker: Any, name: str) -> Any:
        return twin(broker, name) if isinstance(broker, aio.Broker) else sync(broker, name)

    return make


def _rw(half: str) -> Callable[[Any, str], Any]:
    def make(broker: Any, name: str) -> Any:
        cls = aio.ReadWriteLock if isinstance(broker, aio.Broker) else ReadWriteLock
        return getattr(cls(broker, name), half)

    return make


def _same_lock(
    id: str,
    setup: Callable[[Broker, str], None],
    make: Callable[[Any, str], Any],
    waiting: Callable[[Broker, Any, str], bool],
) -> Kind:
    """A kind whose holder and waiter take the same lock."""
    return Kind(id, setup, make, make, waiting)


KINDS = [
    _same_lock("mutex", _no_setup, _sync_or_aio(Mutex, aio.Mutex), _waiters_subscribed),
    _same_lock(
        "semaphore",
        _slots,
        _sync_or_aio(PersistentSemaphore, aio.PersistentSemaphore),
        _waiters_subscribed,
    ),
    _same_lock("token", _tokens, _sync_or_aio(TokenSemaphore, aio.TokenSemaphore), _token_waiting),
    _same_lock("token-nofence", _tokens, _unfenced, _token_waiting),
    Kind("rwlock-read", _no_setup, _rw("write_lock"), _rw("read_lock"), _reader_waiting),
    Kind("rwlock-write", _no_setup, _rw("read_lock"), _rw("write_lock"), _writer_waiting),
]
IDS = [k.id for k in KINDS]


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    waiting.wait_until(cond, timeout, what, step=0.02)


@pytest.fixture
def brokers(amqp_url: str) -> Iterator[Callable[..., Broker]]:
    made: list[Broker] = []

    def make(url: str | None = None, **kw: Any) -> Broker:
        b = Broker(url or amqp_url, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _hold(kind: Kind, broker: Broker, name: str) -> Lease:
    kind.setup(broker, name)
    lease = kind.held(broker, name).acquire(timeout=10)
    assert lease is not None
    return lease


def _held_beside(
    kind: Kind, brokers: Callable[..., Broker], name: str
) -> tuple[Broker, Broker, Lease]:
    """A holder's Broker, another client's, and the holder's lease of `kind`."""
    holder, other = brokers(), brokers()
    return holder, other, _hold(kind, holder, name)


# --- point 3: closing a Broker under waiters -------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_close_ends_a_waiting_thread_with_broker_closed_at_once(
    kind: Kind, brokers: Callable[..., Broker], name: str
) -> None:
    holder, other, held = _held_beside(kind, brokers, name)
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["lease"] = kind.waiter(other, name).acquire()
        except BaseException as exc:
            outcome["error"], outcome["at"] = exc, time.monotonic()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_until(lambda: kind.waiting(holder, other, name), 10, "the acquire to wait")
    closing = time.monotonic()
    other.close()
    thread.join(PROMPT + 5)
    assert not thread.is_alive(), "the waiting thread was not woken by close()"
    assert "lease" not in outcome, "a waiter was granted while its Broker closed"
    assert type(outcome["error"]) is BrokerClosed, repr(outcome["error"])
    assert isinstance(outcome["error"], AmqpLocksError)
    assert outcome["at"] - closing < PROMPT
    # The holder is untouched; using the closed Broker stays a state error.
    assert held.verify() and not held.lost.is_set()
    with pytest.raises(BrokerClosed):
        kind.waiter(other, name).acquire(blocking=False)
    held.release()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_aio_close_ends_a_waiting_task_with_broker_closed(
    kind: Kind, brokers: Callable[..., Broker], amqp_url: str, name: str
) -> None:
    holder = brokers()
    held = _hold(kind, holder, name)

    async def main() -> None:
        other = aio.Broker(amqp_url)
        waiter = asyncio.ensure_future(kind.waiter(other, name).acquire())
        while not await asyncio.to_thread(kind.waiting, holder, other, name):
            assert not waiter.done(), waiter
            await asyncio.sleep(0.02)
        closing = time.monotonic()
        await other.close()
        with pytest.raises(BrokerClosed):
            await asyncio.wait_for(waiter, PROMPT)
        assert time.monotonic() - closing < PROMPT + 1
        with pytest.raises(BrokerClosed):
            await kind.waiter(other, name).acquire(blocking=False)

    asyncio.run(main())
    assert held.verify()
    held.release()


def test_a_task_cancelled_by_its_owner_still_gets_cancelled_error(
    brokers: Callable[..., Broker], amqp_url: str, name: str
) -> None:
    """Only close() turns an ended operation into BrokerClosed: a task its owner cancels
    sees its own CancelledError, as asyncio code expects."""
    holder = brokers()
    held = Mutex(holder, name).acquire()
    assert held is not None

    async def main() -> None:
        async with aio.Broker(amqp_url) as other:
            waiter = asyncio.ensure_future(aio.Mutex(other, name).acquire())
            await asyncio.to_thread(
                wait_until, lambda: _waiters_subscribed(holder, other, name), 10, "a waiter"
            )
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter

    asyncio.run(main())
    held.release()


def test_close_ends_an_admin_wait_with_broker_closed(
    brokers: Callable[..., Broker], name: str
) -> None:
    holder, other = brokers(), brokers()
    SemaphoreAdmin(holder, name).create(1)
    held = PersistentSemaphore(holder, name).acquire()
    assert held is not None
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            SemaphoreAdmin(other, name).wait_for_holders([1], timeout=None)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_until(lambda: other.core._session is not None, 10, "the admin call to connect")
    other.close()
    thread.join(PROMPT + 5)
    assert [type(e) for e in errors] == [BrokerClosed]
    held.release()


# --- point 4: what a release promises --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_release_wait_means_the_lock_is_free_on_return(
    kind: Kind, brokers: Callable[..., Broker], name: str
) -> None:
    _, other, held = _held_beside(kind, brokers, name)
    assert kind.waiter(other, name).acquire(blocking=False) is None
    held.release(wait=True)
    assert held.released
    taken = kind.waiter(other, name).acquire(blocking=False)
    assert taken is not None, "not free right after release(wait=True) returned"
    taken.release(wait=True)


@pytest.mark.parametrize(
    ("fencing", "extra"),
    [(False, {"Basic.Qos": 1}), (True, {})],
    ids=["nofence-one-round-trip", "fenced-commit-is-the-confirm"],
)
def test_release_wait_costs_at_most_one_round_trip_and_the_default_none(
    broker: Broker,
    name: str,
    counted_wire: Wire,  # noqa: F811 - the fixture imported above
    fencing: bool,
    extra: dict[str, int],
) -> None:
    """The default release stays a write (the hot path's figures); wait=True adds one
    answered method where the release has no answer of its own (a bare reject)."""
    wire = counted_wire
    sem = TokenSemaphore(broker, name, fencing=fencing)
    sem.setup(1)
    try:
        for wait in (False, True):
            for _ in range(2):  # warm-up: channels in the pool
                lease = sem.acquire(timeout=10)
                assert lease is not None
                lease.release(wait=wait)
                settle(broker)
            lease = sem.acquire(timeout=10)
            assert lease is not None
            wire.sent.clear()
            wire.recording = True
            lease.release(wait=wait)
            settle(broker)
            wire.recording = False
            release = {"Basic.Cancel": 1, "Basic.Reject": 1}
            if fencing:
                release = {"Basic.Cancel": 1, "Basic.Ack": 1, "Basic.Publish": 1, "Tx.Commit": 1}
            assert dict(wire.sent) == {**release, **(extra if wait else {})}, wait
    finally:
        sem.destroy()


@pytest.mark.parametrize("kind", ["mutex", "token-nofence", "token"])
def test_release_wait_raises_when_the_connection_fails_first(
    kind: str, brokers: Callable[..., Broker], proxy: FaultProxy, name: str
) -> None:
    """A cut connection: the release cannot be confirmed; wait=True says so (after the
    loss timeout at most) instead of returning as if the lock were free. The broker then
    frees it when it sees the connection end."""
    spec = KINDS[IDS.index(kind)]
    direct = brokers()
    spec.setup(direct, name)
    through = brokers(proxy.url(), heartbeat=1.0)
    held = spec.held(through, name).acquire(timeout=10)
    assert held is not None
    proxy.blackhole()
    began = time.monotonic()
    with pytest.raises(ReleaseUnconfirmed, match="not confirmed"):
        held.release(wait=True)
    assert time.monotonic() - began < 1.0 + 3.0  # loss_timeout (one heartbeat) + slack
    proxy.reset()  # the broker sees the connection end: the lock is free again
    again = spec.waiter(direct, name).acquire(timeout=15)
    assert again is not None
    again.release()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_close_right_after_release_completes_it(
    kind: Kind, brokers: Callable[..., Broker], name: str
) -> None:
    """release() then close() at once (a process that releases and exits): the waiter
    elsewhere is granted as soon as the close is done, by the release itself (a token
    comes back not redelivered: a polite release, not the connection's end)."""
    holder, other, held = _held_beside(kind, brokers, name)
    got: list[Lease] = []
    thread = threading.Thread(
        target=lambda: got.append(kind.waiter(other, name).acquire(timeout=30)), daemon=True
    )
    thread.start()
    wait_until(lambda: kind.waiting(holder, other, name), 10, "the waiter to wait")
    held.release()
    holder.close()
    closed = time.monotonic()
    thread.join(10)
    assert got and got[0] is not None
    assert time.monotonic() - closed < PROMPT, "the waiter waited past the close"
    state: Any = got[0]._state
    if kind.id.startswith("token") and kind.id != "token-nofence":
        assert not state.message.delivery.redelivered, "returned by the close, not released"
        assert got[0].fencing_token == held.fencing_token + 1
    got[0].release()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_two_threads_closing_one_broker_release_each_lease_once(
    kind: Kind, brokers: Callable[..., Broker], name: str
) -> None:
    """A Broker is thread-safe, so two threads may close it at once (a worker's shutdown
    and an atexit hook): both return, neither raises, and the lease it held is released
    once and politely, as by one close (a token comes back not redelivered, its counter
    raised by one), so the next holder is granted at once."""
    holder, other, held = _held_beside(kind, brokers, name)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def close() -> None:
        start.wait(10)
        try:
            holder.close()
        except BaseException as exc:  # what escapes is the finding
            errors.append(exc)

    closers = [threading.Thread(target=close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(30)
    assert not any(t.is_alive() for t in closers), "a close did not return"
    assert errors == []
    assert held.released and holder.core.closed
    again = kind.waiter(other, name).acquire(blocking=False)
    assert again is not None, "the lease was not released by the close"
    state: Any = again._state
    if kind.id.startswith("token") and kind.id != "token-nofence":
        assert not state.message.delivery.redelivered, "returned by the connection's end"
        assert again.fencing_token == held.fencing_token + 1
    again.release()


def test_close_releases_in_flight_releases_before_closing(
    brokers: Callable[..., Broker], name: str
) -> None:
    """A release still committing when close() runs is completed, not cut short: the
    token's commit happens (it comes back with its counter raised, not redelivered)."""
    holder, other = brokers(), brokers()
    TokenSemaphore(holder, name).setup(1)
    held = TokenSemaphore(holder, name).acquire(timeout=10)
    assert held is not None
    state: Any = held._state
    held.release()  # returns before the commit
    job = state.release_job
    assert job is not None
    holder.close()
    assert job.done() and not job.cancelled()
    assert state.release_failure is None
    again = TokenSemaphore(other, name).acquire(timeout=10)
    assert again is not None and again.fencing_token == held.fencing_token + 1
    again.release()


def test_close_is_bounded_when_a_release_cannot_finish(
    brokers: Callable[..., Broker], proxy: FaultProxy, name: str
) -> None:
    direct = brokers()
    TokenSemaphore(direct, name).setup(1)
    through = brokers(proxy.url(), heartbeat=30.0)
    held = TokenSemaphore(through, name).acquire(timeout=10)
    assert held is not None
    proxy.blackhole()  # the commit will never be answered
    held.release()
    began = time.monotonic()
    through.close(timeout=0.5)
    assert time.monotonic() - began < 0.5 + SESSION_CLOSE_BOUND
    proxy.reset()  # the broker sees the connection end: the token comes back
    again = TokenSemaphore(direct, name).acquire(timeout=15)
    assert again is not None
    again.release()


def test_release_after_close_is_a_no_op(brokers: Callable[..., Broker], name: str) -> None:
    """Broker.close() released the lease: the `with` block's own release afterwards (or
    any later one) has nothing left to do and must not raise."""
    b = brokers()
    with Mutex(b, name) as lease:
        b.close()
        assert lease.released
    lease.release(wait=True)
    with pytest.raises(BrokerClosed):
        Mutex(b, name).acquire(blocking=False)


def test_aio_release_wait_and_close(
    brokers: Callable[..., Broker], amqp_url: str, name: str
) -> None:
    """The asyncio facade: ``await lease.release(wait=True)``, and a release still in
    flight (a task) when ``await broker.close()`` runs is completed by the close."""
    other = brokers()
    TokenSemaphore(other, name).setup(1)

    async def main() -> tuple[int, Any]:
        broker = aio.Broker(amqp_url)
        lease = await aio.TokenSemaphore(broker, name, fencing=False).acquire(timeout=10)
        assert lease is not None
        await lease.release(wait=True)
        taken = await asyncio.to_thread(TokenSemaphore(other, name).acquire, False)
        assert taken is not None, "not free right after release(wait=True) returned"
        taken.release(wait=True)
        lease = await aio.TokenSemaphore(broker, name).acquire(timeout=10)
        assert lease is not None
        releasing = asyncio.ensure_future(lease.release())
        await broker.close()
        await releasing
        return lease.fencing_token, lease._state

    token, state = asyncio.run(main())
    assert state.release_failure is None
    again = TokenSemaphore(other, name).acquire(timeout=10)
    assert again is not None and again.fencing_token == token + 1
    assert not again._state.message.delivery.redelivered  # type: ignore[attr-defined]
    again.release()


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "tokens", "read", "write"])
def test_leaving_a_with_block_is_seen_by_the_next_reader(
    amqp_url: str, name: str, kind: str
) -> None:
    """Issue 38: another client that reads ``locked()`` right after a `with` block ends
    sees the lock free (the block's exit waits for the broker's confirmation); 20 times."""
    with Broker(amqp_url) as holder, Broker(amqp_url) as reader:
        if kind == "semaphore":
            SemaphoreAdmin(holder, name).create(1)
        if kind == "tokens":
            TokenAdmin(holder, name).setup(1)

        def held(b: Broker) -> bool:
            if kind in ("read", "write"):
                status = ReadWriteLock(b, name).status()
                return status is not None and (status.held > 0 or status.writer)
            return bool(lock(b).locked())

        def lock(b: Broker) -> Any:
            if kind == "mutex":
                return Mutex(b, name)
            if kind == "semaphore":
                return PersistentSemaphore(b, name)
            if kind == "tokens":
                return TokenSemaphore(b, name)
            rw = ReadWriteLock(b, name)
            return rw.read_lock if kind == "read" else rw.write_lock

        seen = []
        for _ in range(20):
            with lock(holder):
                assert held(reader)
            seen.append(held(reader))
        assert seen == [False] * 20


@pytest.mark.parametrize("kind", ["token-nofence", "token"])
def test_release_wait_raises_when_the_broker_refuses_the_release(
    kind: str, brokers: Callable[..., Broker], name: str
) -> None:
    """The connection stays up but the broker refuses the release's own step (here its
    delivery was settled behind the library's back, so the reject or ack names an unknown
    delivery tag and the broker closes the holder's channel, 406): nothing confirmed it,
    so wait=True raises instead of returning as if the lock were handed on."""
    spec = KINDS[IDS.index(kind)]
    broker = brokers()
    spec.setup(broker, name)
    held = spec.held(broker, name).acquire(timeout=10)
    assert held is not None
    state: Any = held._state
    broker.core.run(state.channel.basic_ack(state.delivery_tag))
    with pytest.raises(ReleaseUnconfirmed, match="not confirmed"):
        held.release(wait=True)
    assert broker.core.run(broker.core.session()).alive  # the connection was not the cause
