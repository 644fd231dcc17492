"""A database locker's connection attempt to a server that never answers times out.

Found by the random-fault run of tests/faults/test_lockers_soak.py: after a database crash
a standby's connection attempt reached something that accepted TCP and then said nothing;
libpq waits for ever by default, so the standby never took over and could not be stopped.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from amqp_locks import ConfigurationError
from amqp_locks.lockers import DatabaseLocker, LeaseDatabaseLocker, Locker, LockerStopped
from amqp_locks.lockers.sql import DEFAULT_CONNECT_TIMEOUT

from ..threads import start_catching


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port whose kernel completes TCP handshakes that nobody ever answers."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    yield listener.getsockname()[1]
    listener.close()


@pytest.mark.parametrize("cls", [DatabaseLocker, LeaseDatabaseLocker])
@pytest.mark.parametrize("driver", ["postgresql+psycopg", "mysql+pymysql"])
def test_standby_attempts_time_out_and_stop_interrupts(
    silent_server: int, cls: type[Locker], driver: str
) -> None:
    url = f"{driver}://u:p@127.0.0.1:{silent_server}/db"
    locker = cls(url, "x", connect_timeout=1, lock_acquire_sleep_interval=0.05)  # type: ignore[call-arg]
    started = time.monotonic()
    t, errors = start_catching(locker.start, daemon=True)
    deadline = started + 10
    while locker.attempts < 1:  # an attempt ends (unavailable) instead of hanging
        assert time.monotonic() < deadline, "a connection attempt hung"
        time.sleep(0.05)
    locker.stop()
    t.join(5)
    assert not t.is_alive() and isinstance(errors[0], LockerStopped)
    locker.close()


def test_default_and_checked(silent_server: int) -> None:
    assert DEFAULT_CONNECT_TIMEOUT == 10.0
    with pytest.raises(ConfigurationError, match="connect_timeout"):
        DatabaseLocker("postgresql+psycopg://u:p@127.0.0.1:1/db", connect_timeout=0)
