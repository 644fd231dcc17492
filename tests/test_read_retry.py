"""A read (status, holders, ``locked()``, a Celery key) whose connection is lost under it
is tried once more on a new connection: in a cluster a node's death, or the quorum guard
dropping a connection while its probe queue elects a leader, need not reach the caller
(core.BrokerCore.read)."""

from __future__ import annotations

from typing import Any

import pytest

from amqp_locks import Broker, Mutex
from amqp_locks.errors import ConnectionLost
from amqp_locks.holders import read_locked
from amqp_locks.mutex import read_mutex
from amqp_locks.transport.core import BrokerCore


def _dropping_reader(sessions: list[Any], drops: int) -> Any:
    """A mutex reader whose first `drops` calls lose their connection mid-read: the
    session is dropped, then asked on the broker (a passive declare on a dead socket)."""

    async def read(core: BrokerCore, name: str) -> Any:
        session = await core.session()
        sessions.append(session)
        if len(sessions) <= drops:
            session.drop("cut by the test")
            await session.exists_passive(name)  # the connection is gone: ConnectionLost
            raise AssertionError("a dropped session answered")
        return await read_mutex(core, name)

    return read


def test_a_read_goes_on_over_a_new_connection(amqp_url: str, broker: Broker, name: str) -> None:
    sessions: list[Any] = []
    core = broker.core
    with Broker(amqp_url) as other, Mutex(other, name):  # held elsewhere: the read says so
        held = core.run(read_locked(core, _dropping_reader(sessions, 1), name))
    assert held is True
    assert len(sessions) == 2 and sessions[0] is not sessions[1]
    assert not sessions[0].alive and sessions[1].alive


def test_a_second_loss_reaches_the_caller(broker: Broker, name: str) -> None:
    """Once more, not for ever: a read that keeps losing its connection raises."""
    sessions: list[Any] = []
    core = broker.core
    with pytest.raises(ConnectionLost, match="cut by the test"):
        core.run(read_locked(core, _dropping_reader(sessions, 2), name))
    assert len(sessions) == 2
