"""A master learns at once that its lock's session ended, not at its next keep-alive.

Found by tests/faults/test_lockers_faults.py (database restart): the master only found out
at its next keep-alive, while the restarted server let the polling standby in — two masters
for up to one keep-alive period (143 ms seen on PostgreSQL with a 0.25 s period). The
locker now watches its idle connection; anything the server says there alarms the service,
which runs its keep-alive at once. The AMQP locker does the same when its lease is marked
lost (connection closed, missed heartbeats).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest

from amqp_locks import Broker
from amqp_locks.lockers import AmqpLocker, DatabaseLocker, Locker
from amqp_locks.service import LockableService, State
from amqp_locks_dev import devdb

from ..faultproxy import FaultProxy
from ..faults.lockers_targets import end_sessions_from, lockfaults_dbs  # noqa: F401 - fixture

#: Long: a demotion that waited for the next keep-alive would take this long, far beyond
#: the ceiling `AT_ONCE` that scheduling delays on a loaded machine cannot reach.
PERIOD = 30.0
AT_ONCE = 5.0


def _demotion_after(states: list[tuple[float, State]], t0: float) -> float:
    deadline = t0 + 2 * PERIOD
    while not any(s is State.STANDBY for _, s in states[2:]):
        assert time.monotonic() < deadline, "never demoted"
        time.sleep(0.01)
    return next(t for t, s in states[2:] if s is State.STANDBY) - t0


def _serve(locker: Locker) -> tuple[LockableService, list[tuple[float, State]]]:
    states: list[tuple[float, State]] = []
    master = threading.Event()

    def on_state(_: LockableService, state: State) -> None:
        states.append((time.monotonic(), state))
        if state is State.MASTER:
            master.set()

    service = LockableService(
        locker, lambda stop: stop.wait(), lock_keep_alive_period=PERIOD, on_state=on_state
    )
    service.start()
    assert master.wait(30)
    return service, states


def _local_port(locker: DatabaseLocker) -> int:
    """The master's client port, as the server sees it (through the driver's socket)."""
    conn = locker._conn
    assert conn is not None
    dbapi = conn.connection.dbapi_connection
    sock = getattr(dbapi, "_sock", None)  # PyMySQL
    fd = sock.fileno() if sock is not None else dbapi.fileno()  # type: ignore[union-attr]
    s = socket.socket(fileno=os.dup(fd))
    try:
        return int(s.getsockname()[1])
    finally:
        s.close()


@pytest.mark.parametrize("kind", devdb.KINDS)
def test_master_demotes_at_once_when_the_database_ends_its_session(
    kind: str, request: pytest.FixtureRequest
) -> None:
    db: devdb.DbInfo = request.getfixturevalue("lockfaults_dbs")[kind]
    locker = DatabaseLocker(db.url, f"w{uuid.uuid4().hex[:8]}", lock_acquire_sleep_interval=0.1)
    service, states = _serve(locker)
    try:
        assert end_sessions_from(db, [_local_port(locker)]) == 1
        took = _demotion_after(states, time.monotonic())
        assert took < AT_ONCE  # not at the next keep-alive, up to PERIOD away
    finally:
        service.stop(30)
        locker.close()


def test_amqp_master_demotes_at_once_when_its_connection_drops(proxy: FaultProxy) -> None:
    broker = Broker(proxy.url(), heartbeat=10)
    locker = AmqpLocker(broker, f"w{uuid.uuid4().hex[:8]}", lock_acquire_sleep_interval=0.1)
    service, states = _serve(locker)
    try:
        proxy.reset()  # the broker closes the connection (restart, admin, network reset)
        took = _demotion_after(states, time.monotonic())
        assert took < AT_ONCE
    finally:
        service.stop(30)
        locker.close()
        broker.close()
