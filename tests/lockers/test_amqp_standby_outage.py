"""An AmqpLocker standby rides out a broker it cannot reach any more.

Found by the broker-restart scenario of tests/faults/test_lockers_faults.py: during the
restart every standby's attempt raised (connection refused), LockableService took that for
a locker that cannot start, and the services ended — after the restart nobody was master.
A broker never reached at all is still reported at once (a wrong URL).
"""

from __future__ import annotations

import threading
import uuid

import pytest

from amqp_locks import Broker
from amqp_locks.errors import BrokerUnreachable, ConnectionLost
from amqp_locks.lease import Lease
from amqp_locks.lockers import AmqpLocker
from amqp_locks.service import LockableService, State


def test_standby_service_survives_an_outage_and_becomes_master(amqp_url: str) -> None:
    with Broker(amqp_url, heartbeat=5) as broker:
        locker = AmqpLocker(broker, f"o{uuid.uuid4().hex[:8]}", lock_acquire_sleep_interval=0.05)
        script: list[BaseException | None] = [
            None,  # reached the broker: the lock is held elsewhere
            BrokerUnreachable("connection refused"),  # the broker restarts...
            BrokerUnreachable("connection refused"),
            ConnectionLost("closed during the acquire"),
        ]
        real = locker._mutex.acquire

        def acquire(blocking: bool = True, timeout: float | None = None) -> Lease | None:
            if not script:
                return real(blocking, timeout)
            step = script.pop(0)
            if step is not None:
                raise step
            return None

        locker._mutex.acquire = acquire  # type: ignore[method-assign]
        master = threading.Event()
        service = LockableService(
            locker,
            lambda stop: stop.wait(),
            lock_keep_alive_period=0.5,
            on_state=lambda _, s: master.set() if s is State.MASTER else None,
        )
        thread = service.start()
        try:
            assert master.wait(20), service.error
            assert service.error is None and not script
        finally:
            service.stop(10)
        thread.join(10)
        locker.close()


def test_a_broker_never_reached_is_reported(amqp_url: str) -> None:
    with Broker(amqp_url, heartbeat=5) as broker:
        locker = AmqpLocker(broker, "never", lock_acquire_sleep_interval=0.05)

        def unreachable(blocking: bool = True, timeout: float | None = None) -> Lease | None:
            raise BrokerUnreachable("connection refused")

        locker._mutex.acquire = unreachable  # type: ignore[method-assign]
        with pytest.raises(BrokerUnreachable):
            locker.start()
        locker.close()
