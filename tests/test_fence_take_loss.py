"""A connection lost in the middle of a fencing-token take (fencing.take_token) leaves as
:class:`ConnectionLost`, the error every acquire answers by waiting on a new connection.

CI of 2026-12-02 (stop 54): a write lock's grant had its turn and reader tokens when the
connection ended as the fence shard's counter message was given back; aiormq's raw
``AMQPConnectionError`` escaped the acquire, which retries only typed losses. Here the
connection is ended at that very frame (its socket aborted, as a broker's close or the
watchdog's drop does), on a real broker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from amqp_locks import Broker, ConnectionLost, ReadWriteLock, fencing, prepare_fences
from amqp_locks.transport.wire import AbstractChannel


@pytest.fixture(params=[False, True], ids=["single", "cluster-mode"])
def broker(request: pytest.FixtureRequest, amqp_url: str) -> Iterator[Broker]:
    with contextlib.closing(Broker(amqp_url, cluster=request.param)) as b:
        prepare_fences(b)
        yield b


def _die_at_give_back(monkeypatch: pytest.MonkeyPatch, broker: Broker, times: int) -> list[int]:
    """The first `times` returns of a counter message abort the connection first; the
    list counts the aborts made."""
    real = fencing.give_back
    aborted: list[int] = []

    async def dying(ch: AbstractChannel, tag: int) -> None:
        session = broker.core._session
        if len(aborted) < times and session is not None and session.alive:
            aborted.append(tag)
            session._abort()
        await real(ch, tag)

    monkeypatch.setattr(fencing, "give_back", dying)
    return aborted


def test_a_take_cut_at_the_counters_return_raises_connection_lost(
    broker: Broker, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = broker.core.run(broker.core.session())
    aborted = _die_at_give_back(monkeypatch, broker, times=1)
    with pytest.raises(ConnectionLost):
        broker.core.run(fencing.take_token(session, name, timeout=10.0))
    assert len(aborted) == 1


def test_a_write_lock_granted_as_its_fence_take_is_cut_is_granted_on_a_new_connection(
    broker: Broker, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant is given back with the dead connection and asked for again on a new one,
    with a fencing token above every one taken before."""
    lock = ReadWriteLock(broker, name, readers=2)
    with lock.write_lock as lease:
        before = lease.fencing_token
    first = broker.core._session
    aborted = _die_at_give_back(monkeypatch, broker, times=1)
    lease = lock.write_lock.acquire(timeout=20.0)
    assert lease is not None
    try:
        assert len(aborted) == 1
        assert broker.core._session is not first
        assert lease.fencing_token > before
    finally:
        lease.release(wait=True)
