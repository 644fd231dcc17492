"""An AmqpLocker standby rides out a broker it cannot reach any more.

Found by the broker-restart scenario of tests/faults/test_lockers_faults.py: during the
restart every standby's attempt raised (connection refused), LockableService took that for
a locker that cannot start, and the services ended — after the restart nobody was master.
A broker never reached at all is still reported at once (a wrong URL).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future

import pytest

from amqp_locks import Broker
from amqp_locks.errors import BrokerUnreachable, ConnectionLost, LockerStopped
from amqp_locks.lease import Lease
from amqp_locks.lockers import AmqpLocker
from amqp_locks.service import LockableService, State

from .. import waiting
from ..faults.proxy import FaultProxy
from ..threads import start_catching


def test_standby_service_survives_an_outage_and_becomes_master(amqp_url: str) -> None:
    with Broker(amqp_url, heartbeat=5) as broker:
        locker = AmqpLocker(broker, f"o{uuid.uuid4().hex[:8]}", lock_acquire_sleep_interval=0.05)
        script: list[BaseException | None] = [
            None,  # reached the broker: the lock is held elsewhere
            BrokerUnreachable("connection refused"),  # the broker restarts...
            BrokerUnreachable("connection refused"),
            ConnectionLost("closed during the acquire"),
        ]
        real = locker._mutex.acquire_later

        def acquire_later(timeout: float | None = None) -> Future[Lease | None]:
            if not script:
                return real(timeout)
            step, fut = script.pop(0), Future[Lease | None]()
            if step is None:
                fut.set_result(None)  # a wait that ended without the lock
            else:
                fut.set_exception(step)
            return fut

        locker._mutex.acquire_later = acquire_later  # type: ignore[method-assign]
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


def test_a_broker_never_reached_is_reported() -> None:
    """A wrong URL (nothing listens on port 1) is said at once, not waited out."""
    with Broker("amqp://guest:guest@127.0.0.1:1/", heartbeat=5) as broker:
        locker = AmqpLocker(broker, "never", lock_acquire_sleep_interval=0.05)
        with pytest.raises(BrokerUnreachable):
            locker.start()
        locker.close()


def test_the_first_contact_gets_the_connect_timeout(proxy: FaultProxy, name: str) -> None:
    """A broker slow to accept (one side of a cluster mid-partition took over 1 s on
    4.3.6) is not a wrong URL: the standby's first contact waits the Broker's connect
    timeout, not the 1 s slice each acquire attempt gets (it raised BrokerUnreachable)."""
    proxy.delay(0.4)  # every chunk, both ways: the handshake's round trips take ~3 s
    with Broker(proxy.url(), heartbeat=5, connect_timeout=15) as broker:
        locker = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0)
        done = threading.Event()

        def quick_once_connected() -> None:  # the acquire itself at full speed
            waiting.wait_until(lambda: broker.core.connected or done.is_set(), 20, "connect")
            proxy.delay(0.0)

        thread = threading.Thread(target=quick_once_connected, daemon=True)
        thread.start()
        began = time.monotonic()
        try:
            locker.start()
        finally:
            done.set()
            thread.join(20)
        assert broker.core.connected and time.monotonic() - began > 1.0  # the premise
        assert locker.lease is not None and not locker.lease.lost.is_set()
        locker.stop()
        locker.close()


def test_a_standby_waits_once_not_once_per_attempt(amqp_url: str, name: str) -> None:
    """A standby keeps one acquire waiting across its attempts (it still sees stop()
    within a second): in cluster mode an acquire per second registered and cancelled a
    quorum consumer each time, and a standby of such acquires was never granted after a
    silent partition (4.3.6). Counted by the acquire calls started."""
    from amqp_locks import events

    started: list[str] = []
    unsubscribe = events.subscribe(
        lambda e: started.append(e.name) if e.type == "acquiring" and e.name == name else None
    )
    try:
        with Broker(amqp_url, heartbeat=5) as broker:
            master = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0)
            master.start()
            standby = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0)
            thread = threading.Thread(target=standby.start, daemon=True)
            thread.start()
            waiting.wait_until(lambda: standby.attempts >= 3, 10, "three standby attempts")
            assert len(started) == 2  # the master's acquire, and the standby's one wait
            master.stop()
            thread.join(10)
            assert standby.held and standby.lease is not None
            assert len(started) == 2
            standby.stop()
            standby.close()
            master.close()
    finally:
        unsubscribe()


def test_stopping_a_standby_ends_its_wait(amqp_url: str, name: str) -> None:
    """stop() ends the standby's one wait: nothing stays queued for the lock (a later
    release is not handed to a stopped standby), within a second."""
    with Broker(amqp_url, heartbeat=5) as broker:
        master = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0)
        master.start()
        standby = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0)
        thread, errors = start_catching(standby.start, daemon=True)
        waiting.wait_until(lambda: standby.attempts >= 2, 10, "the standby waits")
        stopped = time.monotonic()
        standby.stop()
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - stopped < 2.0
        assert errors and isinstance(errors[0], LockerStopped)
        master.stop()  # released: nobody is left waiting, so the next one gets it at once
        third = AmqpLocker(broker, name, lock_acquire_sleep_interval=1.0, fail_if_locked=True)
        third.start()  # LockedElsewhere if the stopped standby's wait had taken it
        assert third.held and not standby.held
        third.stop()
        for locker in (third, standby, master):
            locker.close()
