"""Lockers and LockableService on SQLite, the file system and RabbitMQ (ActiveMQ's scenarios).

PostgreSQL and MariaDB run the same scenarios in test_database_servers.py.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from amqp_locks import Broker, ConfigurationError
from amqp_locks.lockers import (
    AmqpLocker,
    DatabaseLocker,
    LeaseDatabaseLocker,
    LockedElsewhere,
    Locker,
    LockerStopped,
    SharedFileLocker,
)
from amqp_locks.service import LockableService, State

from ..threads import start_catching
from .masters import MasterLedger

LEDGER = MasterLedger()
FAST = {"lock_acquire_sleep_interval": 0.2}

LockerFactory = Callable[[], Locker]


@pytest.fixture(params=["file", "database", "lease", "amqp"])
def make_locker(
    request: pytest.FixtureRequest, tmp_path: Path, amqp_url: str
) -> Iterator[LockerFactory]:
    made: list[Locker] = []
    brokers: list[Broker] = []
    db = f"sqlite:///{tmp_path / 'locks.db'}"

    def factory() -> Locker:
        kind = request.param
        locker: Locker
        if kind == "file":
            locker = SharedFileLocker(tmp_path, **FAST)
        elif kind == "database":
            locker = DatabaseLocker(db, "orders", **FAST)
        elif kind == "lease":
            locker = LeaseDatabaseLocker(db, "orders", lease_duration=5.0, **FAST)
        else:
            broker = Broker(amqp_url, heartbeat=5)
            brokers.append(broker)
            locker = AmqpLocker(broker, f"locker-{tmp_path.name}", **FAST)
        made.append(locker)
        return locker

    yield factory
    for locker in made:
        locker.close()
    for broker in brokers:
        broker.close()


def test_second_blocks_then_takes_over(make_locker: LockerFactory) -> None:
    first, second = make_locker(), make_locker()
    first.start()
    assert first.keep_alive()
    got = threading.Event()
    t = threading.Thread(target=lambda: (second.start(), got.set()))
    t.start()
    assert not got.wait(0.6)  # three intervals: still standby while the first keeps alive
    assert first.keep_alive()
    stopped_at = time.monotonic()
    first.stop()
    assert got.wait(10)
    took = time.monotonic() - stopped_at
    assert second.fencing_token > first.fencing_token
    assert second.keep_alive()
    assert took < 10  # generous bound; the benchmark reports the real figure
    t.join()
    second.stop()


def test_fail_if_locked(make_locker: LockerFactory) -> None:
    first = make_locker()
    first.start()
    second = make_locker()
    second.fail_if_locked = True
    with pytest.raises(LockedElsewhere):
        second.start()
    first.stop()
    second.start()
    assert second.held
    second.stop()


def test_stop_without_start_and_stop_interrupts_start(make_locker: LockerFactory) -> None:
    idle = make_locker()
    idle.stop()  # nothing held: a no-op
    holder, waiter = make_locker(), make_locker()
    holder.start()
    t, errors = start_catching(waiter.start)
    assert waiter.standing_by.wait(10)  # the scenario: a standby is waiting
    waiter.stop()
    t.join(5)
    assert not t.is_alive()
    assert errors and isinstance(errors[0], LockerStopped)
    assert not waiter.held and holder.keep_alive()
    holder.stop()


def test_one_of_two_waiters_wins(make_locker: LockerFactory) -> None:
    holder = make_locker()
    holder.start()
    waiters = [make_locker(), make_locker()]
    winners: list[Locker] = []
    lock = threading.Lock()

    def wait(w: Locker) -> None:
        try:
            w.start()
        except LockerStopped:
            return
        with lock:
            winners.append(w)

    threads = [threading.Thread(target=wait, args=(w,)) for w in waiters]
    for t in threads:
        t.start()
    for w in waiters:
        assert w.standing_by.wait(10)
    holder.stop()
    deadline = time.monotonic() + 10
    while not winners and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(winners) == 1
    loser = next(w for w in waiters if w not in winners)
    seen = loser.attempts
    while loser.attempts < seen + 3:  # three more attempts, all refused
        assert time.monotonic() < deadline + 10
        time.sleep(0.05)
    assert len(winners) == 1 and not loser.held
    for w in waiters:
        if w not in winners:
            w.stop()
    for t in threads:
        t.join(5)
    winners[0].stop()


def test_service_fails_over_and_never_two_masters(make_locker: LockerFactory) -> None:
    services = []

    def work(name: str) -> Callable[[threading.Event], None]:
        def run(stop: threading.Event) -> None:
            LEDGER.enter(name)
            try:
                stop.wait()
            finally:
                LEDGER.leave(name)

        return run

    for i in range(3):
        locker = make_locker()
        period = 0.25 if not isinstance(locker, LeaseDatabaseLocker) else 0.3
        services.append(
            LockableService(locker, work(f"s{i}-{id(locker)}"), lock_keep_alive_period=period)
        )
    for s in services:
        s.start()
    for _ in range(3):
        deadline = time.monotonic() + 15
        while not any(s.state is State.MASTER for s in services) and time.monotonic() < deadline:
            time.sleep(0.02)
        masters = [s for s in services if s.state is State.MASTER]
        assert len(masters) == 1
        masters[0].stop(10)
        services.remove(masters[0])
        if not services:
            break
    for s in services:
        s.stop(10)
    assert LEDGER.overlaps == 0


def test_hundred_start_stop_cycles(make_locker: LockerFactory) -> None:
    locker = make_locker()
    tokens = []
    for _ in range(100):
        locker.start()
        tokens.append(locker.fencing_token)
        locker.stop()
    assert all(b > a for a, b in itertools.pairwise(tokens))
    other = make_locker()
    other.fail_if_locked = True
    other.start()  # nothing leaked: the lock is free
    other.stop()


def test_file_locker_detects_deleted_and_modified_file(tmp_path: Path) -> None:
    for tamper in ("delete", "modify", "replace"):
        locker = SharedFileLocker(tmp_path, **FAST)
        locker.start()
        assert locker.keep_alive()
        if tamper == "delete":
            os.unlink(locker.path)
        elif tamper == "modify":
            time.sleep(0.01)  # mtime granularity
            with open(locker.path, "a") as f:
                f.write("x")
        else:
            tmp = tmp_path / "other"
            tmp.write_text("0\n")
            os.replace(tmp, locker.path)
        assert not locker.keep_alive(), tamper
        locker.stop()


def test_file_locker_demotes_master_when_file_deleted(tmp_path: Path) -> None:
    states: list[State] = []
    masters = threading.Semaphore(0)

    def work(stop: threading.Event) -> None:
        masters.release()
        stop.wait()

    service = LockableService(
        SharedFileLocker(tmp_path, **FAST),
        work,
        lock_keep_alive_period=0.2,
        on_state=lambda _, s: states.append(s),
    )
    service.start()
    assert masters.acquire(timeout=10)
    os.unlink(tmp_path / "lock")
    assert masters.acquire(timeout=10)  # demoted, then master again on a new file
    assert service.masterships == 2
    service.stop(10)
    assert states[:3] == [State.STANDBY, State.MASTER, State.STANDBY]


def test_in_process_guard(tmp_path: Path) -> None:
    a = SharedFileLocker(tmp_path, **FAST)
    b = SharedFileLocker(tmp_path, fail_if_locked=True, **FAST)
    a.start()
    with pytest.raises(LockedElsewhere):
        b.start()
    a.stop()


def test_lease_config_is_checked(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'l.db'}"
    locker = LeaseDatabaseLocker(db, lease_duration=2.0)
    for bad in (0, 2.0, 5.0):
        with pytest.raises(ConfigurationError, match="shorter than the lease"):
            LockableService(locker, lambda stop: None, lock_keep_alive_period=bad)
    LockableService(locker, lambda stop: None, lock_keep_alive_period=1.0)  # fine
    with pytest.raises(ConfigurationError):
        LeaseDatabaseLocker(db, max_allowable_diff_from_db_time=-1)


@pytest.mark.parametrize("offset", [+30.0, -30.0])
def test_lease_clock_skew_rule(tmp_path: Path, offset: float) -> None:
    """The local judgement of the lease uses the corrected clock only when
    max_allowable_diff_from_db_time > 0 (ActiveMQ's rule)."""
    db = f"sqlite:///{tmp_path / 'skew.db'}"
    skewed = lambda: time.time() + offset  # noqa: E731
    plain = LeaseDatabaseLocker(db, "a", lease_duration=10.0, clock=skewed, **FAST)
    corrected = LeaseDatabaseLocker(
        db, "b", lease_duration=10.0, clock=skewed, max_allowable_diff_from_db_time=1.0, **FAST
    )
    for locker in (plain, corrected):
        locker.start()
    # the database's clock decides who holds: both hold a 10 s lease in database time
    assert plain.keep_alive() and corrected.keep_alive()
    assert abs(corrected.clock_offset() + offset) < 1.0
    assert plain.clock_offset() == 0.0
    assert corrected.lease_valid_locally()
    # uncorrected: a clock 30 s ahead thinks the lease expired, 30 s behind thinks it holds
    assert plain.lease_valid_locally() is (offset < 0)
    within = LeaseDatabaseLocker(
        db, "c", clock=skewed, max_allowable_diff_from_db_time=60.0, lease_duration=10.0, **FAST
    )
    within.start()
    assert within.clock_offset() == 0.0  # a difference inside the allowance is not corrected
    for locker in (plain, corrected, within):
        locker.close()


def test_lease_expiry_lets_standby_in_and_old_keep_alive_fails(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'exp.db'}"
    master = LeaseDatabaseLocker(db, lease_duration=0.5, **FAST)
    standby = LeaseDatabaseLocker(db, lease_duration=0.5, **FAST)
    master.start()
    standby.start()  # the master does not renew (a frozen process): its lease runs out
    assert standby.fencing_token > master.fencing_token
    assert not master.keep_alive()  # the frozen master's next keep-alive fails
    assert standby.keep_alive()
    master.close()
    standby.close()


def test_lease_policy_rides_out_errors_only_while_valid(tmp_path: Path) -> None:
    from amqp_locks.service import LeaseAwarePolicy

    db = f"sqlite:///{tmp_path / 'pol.db'}"
    locker = LeaseDatabaseLocker(db, lease_duration=0.4, **FAST)
    locker.start()
    policy = LeaseAwarePolicy()
    assert policy.on_error(locker, OSError("db blip")) is True
    time.sleep(0.5)  # the scenario: the lease runs out during the outage
    assert policy.on_error(locker, OSError("db still down")) is False
    locker.close()


def test_service_reports_a_locker_that_cannot_start(tmp_path: Path) -> None:
    holder = SharedFileLocker(tmp_path, **FAST)
    holder.start()
    service = LockableService(
        SharedFileLocker(tmp_path, fail_if_locked=True, **FAST), lambda stop: None
    )
    thread = service.start()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(service.error, LockedElsewhere)  # not lost silently
    assert service.state is State.STOPPED
    holder.stop()
