"""A lease master demotes itself before its lease runs out, whatever its keep-alive does.

Found by the partition scenario of tests/faults/test_lockers_faults.py: a keep-alive hung on
a silent connection held the master for as long as the partition lasted, and a standby took
the expired lease meanwhile (two masters for 1.7 s). Failing keep-alives had the same flaw
on a smaller scale: the policy kept mastership while the lease was valid *now*, and the
next check came up to a keep-alive period after the lease ran out.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from amqp_locks import ConfigurationError
from amqp_locks.lockers import LeaseDatabaseLocker, SharedFileLocker
from amqp_locks.service import LockableService, State

#: The lease leaves a renewal `LEASE - lease_margin` = 1.6 s to answer: far more than a
#: SQLite UPDATE takes on a loaded machine (at 1 s, 0.6 s, a healthy master demoted).
LEASE = 3.0
PERIOD = 0.2


class TroubledLease(LeaseDatabaseLocker):
    """A lease locker whose keep-alive can be made to hang or fail on demand."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.mode = "ok"
        self.unblock = threading.Event()
        self.renewed_until = 0.0  # database time of the last successful renewal's expiry

    def _keep_alive(self) -> bool:
        if self.mode == "hang":
            self.unblock.wait(30)  # a call on a connection that went silent
        if self.mode == "error":
            raise OperationalError("UPDATE", {}, Exception("database unreachable"))
        ok = super()._keep_alive()
        if ok:
            self.renewed_until = self.expires_at
        return ok

    def _try_acquire(self) -> bool:
        return self.mode != "error" and super()._try_acquire()

    def _release(self) -> None:
        if self.mode != "error":  # unreachable: the lease cannot be cleared, it expires
            super()._release()


def _master(locker: TroubledLease, **options: float) -> tuple[LockableService, dict[str, float]]:
    seen: dict[str, float] = {}
    is_master = threading.Event()

    def on_state(_: LockableService, state: State) -> None:
        if state is State.MASTER:
            is_master.set()
        elif state is State.STANDBY and is_master.is_set():
            seen.setdefault("demoted", time.time())  # the first demotion is the one

    def work(stop: threading.Event) -> None:
        stop.wait()
        seen.setdefault("work_stopped", time.time())

    service = LockableService(
        locker, work, lock_keep_alive_period=PERIOD, on_state=on_state, **options
    )
    service.start()
    assert is_master.wait(10)
    deadline = time.monotonic() + 10
    while locker.renewed_until == 0.0:  # one renewal went through
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return service, seen


@pytest.mark.parametrize("mode", ["hang", "error"])
def test_lease_master_demotes_before_its_lease_runs_out(tmp_path: Path, mode: str) -> None:
    url = f"sqlite:///{tmp_path / 'lease.db'}"
    locker = TroubledLease(url, "m", lease_duration=LEASE, lock_acquire_sleep_interval=0.05)
    service, seen = _master(locker)
    locker.mode = mode
    standby = LeaseDatabaseLocker(url, "m", lease_duration=LEASE, lock_acquire_sleep_interval=0.05)
    try:
        standby.start()  # waits for the lease to run out (nobody renews it)
        granted = time.time()
        deadline = time.monotonic() + 5
        while "demoted" not in seen:
            assert time.monotonic() < deadline, "the master never demoted"
            time.sleep(0.01)
        expired = locker.renewed_until
        # Demoted, work stopped, before the lease ran out — and before the standby's grant.
        assert seen["work_stopped"] <= seen["demoted"] < expired <= granted
        margin = expired - seen["demoted"]
        assert margin >= service.lease_margin * 0.5, margin
    finally:
        locker.unblock.set()
        service.stop(10)
        standby.close()
        locker.close()


def test_a_keep_alive_stuck_for_less_than_the_slack_keeps_mastership(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lease.db'}"
    locker = TroubledLease(url, "m", lease_duration=LEASE, lock_acquire_sleep_interval=0.05)
    service, seen = _master(locker)
    try:
        locker.mode = "hang"
        time.sleep(0.2)  # the scenario: a keep-alive stuck this long (lease 3 s, margin 1.4 s)
        renewed = locker.renewed_until
        locker.unblock.set()  # the stuck call answers, and renews
        deadline = time.monotonic() + 5
        while locker.renewed_until == renewed:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "demoted" not in seen and service.state is State.MASTER
    finally:
        service.stop(10)
        locker.close()


def test_lease_margin_is_checked_and_defaults_to_half_the_slack(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lease.db'}"
    locker = LeaseDatabaseLocker(url, "m", lease_duration=3.0)
    service = LockableService(locker, lambda stop: None, lock_keep_alive_period=1.0)
    assert service.lease_margin == pytest.approx(1.0)
    with pytest.raises(ConfigurationError, match="lease_margin"):
        LockableService(locker, lambda stop: None, lock_keep_alive_period=1.0, lease_margin=-1)
    other = LockableService(SharedFileLocker(tmp_path), lambda stop: None)
    assert other.lease_margin == 0.0 and other.locker.valid_until() is None
    locker.close()


@pytest.mark.parametrize("offset", [+30.0, -30.0])
def test_the_deadline_does_not_depend_on_the_wall_clock(tmp_path: Path, offset: float) -> None:
    """A host clock 30 s off the database's (no allowance set) must neither demote a healthy
    master at once (clock ahead) nor keep a silent one for 30 s more (clock behind)."""
    url = f"sqlite:///{tmp_path / 'lease.db'}"
    locker = TroubledLease(
        url,
        "m",
        lease_duration=LEASE,
        lock_acquire_sleep_interval=0.05,
        clock=lambda: time.time() + offset,
    )
    # Only the deadline may demote here: a keep-alive merely slower than one period on a
    # busy machine would consult the policy, which judges by the (skewed) local clock.
    service, seen = _master(locker, keep_alive_timeout=LEASE)
    try:
        renewed = locker.renewed_until
        deadline = time.monotonic() + 2 * LEASE + 10
        while locker.renewed_until < renewed + 2 * LEASE:  # renewing for two leases
            assert time.monotonic() < deadline and "demoted" not in seen, seen
            time.sleep(0.05)
        locker.mode = "hang"
        hung = time.time()
        deadline = time.monotonic() + LEASE + 10
        while "demoted" not in seen:
            assert time.monotonic() < deadline, "the master never demoted"
            time.sleep(0.01)
        assert seen["demoted"] - hung < LEASE
    finally:
        locker.unblock.set()
        service.stop(10)
        locker.close()
