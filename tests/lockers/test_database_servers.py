"""Database lockers on real PostgreSQL and MariaDB servers started by the tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, text

from amqp_locks.lockers import DatabaseLocker, LeaseDatabaseLocker, Locker, LockerStopped
from amqp_locks.service import LeaseAwarePolicy
from amqp_locks_dev import devdb

from ..waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
FAST = {"lock_acquire_sleep_interval": 0.2}


@pytest.fixture(scope="module", params=devdb.KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[devdb.DbInfo]:
    """A private server of each kind; stopped and its data directory removed afterwards."""
    base = devdb.db_fixture_base()
    try:
        yield devdb.start(request.param, name="lockertest", base_dir=base / request.param)
    finally:
        devdb.stop(request.param, name="lockertest", base_dir=base / request.param)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def lock_name() -> str:
    return f"lk{uuid.uuid4().hex[:10]}"


def _connections(info: devdb.DbInfo) -> set[int]:
    """The server's ids of the test user's connections, not counting this query's own
    (PostgreSQL: backend pids; MariaDB: connection ids, never reused)."""
    engine = create_engine(info.url)
    sql = (
        "SELECT pid FROM pg_stat_activity WHERE usename = 'amqplocks' AND pid <> pg_backend_pid()"
        if info.kind == "postgresql"
        else "SELECT ID FROM information_schema.PROCESSLIST WHERE USER = 'amqplocks'"
        " AND ID <> CONNECTION_ID()"
    )
    with engine.connect() as conn:
        ids = {int(i) for i in conn.execute(text(sql)).scalars()}
    engine.dispose()
    return ids


@pytest.mark.parametrize("cls", [DatabaseLocker, LeaseDatabaseLocker])
def test_second_waits_and_takes_over_within_two_intervals(
    server: devdb.DbInfo, lock_name: str, cls: type[Locker]
) -> None:
    # The lease outlives the renewals below by far (ActiveMQ's rule: keep-alive period <
    # lease), so the standby is held off by the lease being renewed, never by scheduling
    # delays between two renewals, and takes over because `stop()` released it.
    options = {**FAST, "lease_duration": 5.0} if cls is LeaseDatabaseLocker else FAST
    first = cls(server.url, lock_name, **options)  # type: ignore[call-arg]
    second = cls(server.url, lock_name, **options)  # type: ignore[call-arg]
    first.start()
    got = threading.Event()
    t = threading.Thread(target=lambda: (second.start(), got.set()))
    t.start()
    # It tried, and is waiting (its first attempt can take a while to connect on a loaded
    # machine: CI once saw none after 0.6 s).
    wait_until(lambda: second.attempts >= 1, 30, "the standby's first attempt")
    for _ in range(3):
        assert first.keep_alive()
        assert not got.wait(0.2)
    first.stop()
    failed_before = second.attempts
    assert got.wait(10)  # a ceiling, not the bound: that is counted in polls
    # Within two intervals: an attempt already under way at the release may still fail;
    # the first one begun after it wins.
    assert second.attempts - failed_before <= 1
    assert second.fencing_token > first.fencing_token
    t.join()
    for locker in (first, second):
        locker.close()


@pytest.mark.parametrize("cls", [DatabaseLocker, LeaseDatabaseLocker])
def test_hundred_cycles_leak_no_connection(
    server: devdb.DbInfo, lock_name: str, cls: type[Locker]
) -> None:
    before = _connections(server)
    locker = cls(server.url, lock_name, **FAST)  # type: ignore[call-arg]
    tokens = []
    for _ in range(100):
        locker.start()
        tokens.append(locker.fencing_token)
        locker.stop()
    locker.close()
    assert tokens == sorted(set(tokens))
    # By id: a closed connection stays listed until its server process has ended, so a
    # count compared another test's closing connection (listed before, gone after: CI,
    # at load 12, "0 == 1"). Ours must all end; one the locker kept would stay listed.
    wait_until(lambda: not _connections(server) - before, 15, "the locker's connections to end")


def test_stop_interrupts_a_waiting_start(server: devdb.DbInfo, lock_name: str) -> None:
    holder = DatabaseLocker(server.url, lock_name, **FAST)
    waiter = DatabaseLocker(server.url, lock_name, **FAST)
    holder.start()
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(waiter.start, errors))
    t.start()
    assert waiter.standing_by.wait(10)  # the scenario: the standby is waiting
    waiter.stop()
    t.join(5)
    assert not t.is_alive() and isinstance(errors[0], LockerStopped)
    holder.close()
    waiter.close()


def _catch(fn, errors: list[BaseException]) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.parametrize("offset", [+30.0, -30.0])
def test_clock_skew_against_the_database(
    server: devdb.DbInfo, lock_name: str, offset: float
) -> None:
    skewed = lambda: time.time() + offset  # noqa: E731
    plain = LeaseDatabaseLocker(server.url, lock_name, lease_duration=10, clock=skewed, **FAST)
    fixed = LeaseDatabaseLocker(
        server.url,
        lock_name + "b",
        lease_duration=10,
        clock=skewed,
        max_allowable_diff_from_db_time=1.0,
        **FAST,
    )
    plain.start()
    fixed.start()
    assert fixed.lease_valid_locally()
    assert plain.lease_valid_locally() is (offset < 0)  # uncorrected skew misjudges
    assert abs(fixed.clock_offset() + offset) < 1.0
    plain.close()
    fixed.close()


def test_lease_survives_a_short_restart_and_not_a_long_outage(
    server: devdb.DbInfo, lock_name: str
) -> None:
    base = server.base_dir
    locker = LeaseDatabaseLocker(server.url, lock_name, lease_duration=3.0, **FAST)
    policy = LeaseAwarePolicy()
    locker.start()
    devdb.restart(server.kind, name="lockertest", base_dir=base)
    try:
        ok = locker.keep_alive()
    except Exception as exc:
        ok = policy.on_error(locker, exc)
    assert ok  # still master: the lease outlived the outage
    assert locker.keep_alive()
    devdb.stop(server.kind, name="lockertest", base_dir=base)
    try:
        with pytest.raises(Exception):  # noqa: B017 - any driver error: the database is down
            locker.keep_alive()
        assert policy.on_error(locker, OSError("down")) is True  # lease still valid
        time.sleep(3.2)  # the scenario: an outage longer than the lease
        assert policy.on_error(locker, OSError("still down")) is False  # demote
    finally:
        devdb.start(server.kind, name="lockertest", base_dir=base)
    locker.close()


def test_database_locker_loses_its_lock_on_restart(server: devdb.DbInfo, lock_name: str) -> None:
    locker = DatabaseLocker(server.url, lock_name, **FAST)
    locker.start()
    devdb.restart(server.kind, name="lockertest", base_dir=server.base_dir)
    with pytest.raises(Exception):  # noqa: B017 - the long transaction died with the server
        locker.keep_alive()
    assert LeaseAwarePolicy().on_error(locker, OSError("gone")) is False
    locker.close()


def _spawn_master(kind: str, url: str, name: str, period: float, lease: float):  # type: ignore[no-untyped-def]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.lockers.master_proc",
            kind,
            url,
            name,
            str(period),
            str(lease),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _expect(proc: subprocess.Popen[str], word: str) -> int:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"process ended before printing {word}"
        parts = line.split()
        if parts and parts[0] == word:
            return int(parts[1])


@pytest.mark.parametrize("kind", ["database", "lease"])
def test_kill_9_of_the_master_lets_a_standby_take_over(
    server: devdb.DbInfo, lock_name: str, kind: str
) -> None:
    proc = _spawn_master(kind, server.url, lock_name, 0.5, 2.0)
    token = _expect(proc, "MASTER")
    cls = DatabaseLocker if kind == "database" else LeaseDatabaseLocker
    standby = cls(server.url, lock_name, **FAST)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    killed = time.monotonic()
    standby.start()
    took = time.monotonic() - killed
    assert standby.fencing_token > token
    assert took < 10
    standby.close()


def test_frozen_master_is_replaced_and_then_demotes(server: devdb.DbInfo, lock_name: str) -> None:
    proc = _spawn_master("lease", server.url, lock_name, 0.5, 2.0)
    token = _expect(proc, "MASTER")
    proc.send_signal(signal.SIGSTOP)
    standby = LeaseDatabaseLocker(server.url, lock_name, lease_duration=2.0, **FAST)
    try:
        standby.start()  # the frozen master cannot renew: its lease runs out
        assert standby.fencing_token > token
    finally:
        proc.send_signal(signal.SIGCONT)
    _expect(proc, "STANDBY")  # its next keep-alive failed: it demoted itself
    assert standby.keep_alive()
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(20)
    standby.close()


def test_renewal_cut_off_after_its_update_leaves_the_row_unlocked(
    server: devdb.DbInfo, lock_name: str
) -> None:
    """A master frozen or partitioned right after its renewal's UPDATE reached the server
    (before anything else it would send) must not keep the lease row locked: the standby
    takes the lease once it runs out, as it would from a master frozen between renewals."""
    first = LeaseDatabaseLocker(server.url, lock_name, lease_duration=1.0, **FAST)
    second = LeaseDatabaseLocker(server.url, lock_name, lease_duration=1.0, **FAST)
    first.start()
    cut, heal = threading.Event(), threading.Event()

    def cut_off_after_update(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith("UPDATE"):
            cut.set()
            heal.wait(30)

    event.listen(first._engine, "after_cursor_execute", cut_off_after_update)
    renewal = threading.Thread(target=first.keep_alive)
    renewal.start()
    got = threading.Event()
    standby = threading.Thread(target=lambda: (second.start(), got.set()))
    try:
        assert cut.wait(10)
        standby.start()
        assert got.wait(20)  # the 1 s lease runs out; 20 s is a ceiling, not a bound
        assert second.fencing_token > first.fencing_token
    finally:
        heal.set()
        renewal.join(10)
        second.stop()
        standby.join(10)
        for locker in (first, second):
            locker.close()
