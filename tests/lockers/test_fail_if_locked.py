"""`fail_if_locked`: LockedElsewhere only when the lock's server says another holds it.

Rehearsal 114 (4.3.6, 2 CPU burners): test_lockers.py::test_fail_if_locked[amqp] raised
LockedElsewhere from the second locker's start() right after the first one's stop() had
released (and its release had returned). The attempt was an acquire timed at the
locker's 0.2 s interval: a busy broker that had not answered within it read as a holder.
An attempt is now the non-blocking acquire (the broker's answer), and a broker that cannot
be reached is raised as such, never reported as "held by someone else". Forced here by a
proxy that delays every chunk (each round trip takes longer than the old slice) and by a
silent one. The database lockers had the same answer for a database they could not reach
(their standby's "wait it out"); they raise its error too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from amqp_locks import Broker
from amqp_locks.errors import BrokerUnreachable, ConnectionLost
from amqp_locks.lockers import (
    AmqpLocker,
    DatabaseLocker,
    LeaseDatabaseLocker,
    LockedElsewhere,
    Locker,
)

from ..faults.proxy import FaultProxy

#: Each chunk this much later, both ways: a round trip takes 0.3 s, over the 0.2 s
#: interval an attempt was once timed at.
DELAY = 0.15
INTERVAL = 0.2


def _slow_locker(broker: Broker, proxy: FaultProxy, name: str) -> AmqpLocker:
    """A fail_if_locked locker connected through `proxy` (at full speed), whose proxy
    delays everything from now on."""
    locker = AmqpLocker(broker, name, lock_acquire_sleep_interval=INTERVAL, fail_if_locked=True)
    broker.core.run(broker.core.session())
    proxy.delay(DELAY)
    return locker


@contextlib.contextmanager
def _holder_and_slow_one(
    proxy: FaultProxy, amqp_url: str, name: str
) -> Iterator[tuple[AmqpLocker, AmqpLocker]]:
    """(a locker holding `name` on a direct connection, a slow fail_if_locked one)."""
    with Broker(amqp_url, heartbeat=5) as near, Broker(proxy.url(), heartbeat=5) as far:
        first = AmqpLocker(near, name, lock_acquire_sleep_interval=INTERVAL)
        first.start()
        second = _slow_locker(far, proxy, name)
        try:
            yield first, second
        finally:
            for locker in (first, second):
                locker.close()


def test_a_free_lock_behind_a_slow_broker_is_taken(
    proxy: FaultProxy, amqp_url: str, name: str
) -> None:
    with _holder_and_slow_one(proxy, amqp_url, name) as (first, second):
        first.stop()  # released before the slow one asks
        began = time.monotonic()
        second.start()
        took = time.monotonic() - began
        assert second.held and second.lease is not None and not second.lease.lost.is_set()
        assert took > INTERVAL  # the premise: the broker's answer came after the interval
        second.stop()


def test_a_held_lock_behind_a_slow_broker_is_reported_held(
    proxy: FaultProxy, amqp_url: str, name: str
) -> None:
    with _holder_and_slow_one(proxy, amqp_url, name) as (first, second):
        with pytest.raises(LockedElsewhere):
            second.start()
        assert not second.held
        first.stop()
        second.start()
        assert second.held and second.fencing_token > first.fencing_token
        second.stop()


def test_a_silent_broker_is_not_reported_as_a_holder(proxy: FaultProxy, name: str) -> None:
    """Nobody holds the lock; the broker goes silent after the locker reached it. Its
    start() raises the broker's failure (the watchdog's ConnectionLost, or a reconnect
    that got no answer), not LockedElsewhere (it was: after a standby's wait)."""
    with Broker(proxy.url(), heartbeat=1, connect_timeout=2) as broker:
        locker = _slow_locker(broker, proxy, name)
        proxy.delay(0.0)
        proxy.blackhole()
        began = time.monotonic()
        with pytest.raises((ConnectionLost, BrokerUnreachable)):
            locker.start()
        assert time.monotonic() - began < 15  # the watchdog's bound, with room
        assert not locker.held
        proxy.heal()
        locker.close()


@pytest.mark.parametrize("kind", ["database", "lease"])
@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://nobody:secret@127.0.0.1:1/locks",
        "mysql+pymysql://nobody:secret@127.0.0.1:1/locks",
        "sqlite:///{missing}/locks.db",
    ],
    ids=["postgresql", "mariadb", "sqlite"],
)
def test_a_database_it_cannot_reach_is_raised(tmp_path: Path, kind: str, url: str) -> None:
    """Nothing listens on port 1; SQLite's directory does not exist: the driver's error,
    not "held by someone else"."""
    url = url.format(missing=tmp_path / "missing")
    locker: Locker
    if kind == "database":
        locker = DatabaseLocker(url, "orders", fail_if_locked=True, connect_timeout=2)
    else:
        locker = LeaseDatabaseLocker(url, "orders", fail_if_locked=True, connect_timeout=2)
    began = time.monotonic()
    with pytest.raises(OperationalError):
        locker.start()
    assert time.monotonic() - began < 10 and not locker.held
    locker.close()
