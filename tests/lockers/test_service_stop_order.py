"""`LockableService.stop()` gives the lock up only after the master's work has stopped.

Found by tests/faults/test_lockers_faults.py (database restart on MariaDB): stopping a
master released its lock at once, from the caller's thread, while its work was still
running; the standby became master 6 ms before the old master's work ended. With a work
that takes time to stop (`amqp-locks elect` gives COMMAND --grace seconds after SIGTERM)
two masters ran for that long.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from amqp_locks.lockers import DatabaseLocker, Locker, LockerStopped, SharedFileLocker
from amqp_locks.service import LockableService, State

SLOW_STOP = 0.5


@pytest.mark.parametrize("kind", ["file", "database"])
def test_standby_gets_the_lock_only_after_the_masters_work_stopped(
    tmp_path: Path, kind: str
) -> None:
    def locker() -> Locker:
        if kind == "file":
            return SharedFileLocker(tmp_path, lock_acquire_sleep_interval=0.02)
        return DatabaseLocker(
            f"sqlite:///{tmp_path / 'l.db'}", "m", lock_acquire_sleep_interval=0.02
        )

    work_ended: list[float] = []
    master_now = threading.Event()

    def work(stop: threading.Event) -> None:
        master_now.set()
        stop.wait()
        time.sleep(SLOW_STOP)  # the scenario: work that takes this long to wind down
        work_ended.append(time.monotonic())

    service = LockableService(locker(), work, lock_keep_alive_period=0.1)
    service.start()
    assert master_now.wait(10)
    standby = locker()
    acquired: list[float] = []

    def wait_as_standby() -> None:
        try:
            standby.start()
        except LockerStopped:
            return
        acquired.append(time.monotonic())

    t = threading.Thread(target=wait_as_standby)
    t.start()
    assert standby.standing_by.wait(10)
    service.stop(10)
    assert service.state is State.STOPPED
    t.join(10)
    assert acquired and work_ended
    assert work_ended[0] <= acquired[0]  # never two masters' work at once
    standby.close()


def test_stop_interrupts_a_standby_service(tmp_path: Path) -> None:
    holder = SharedFileLocker(tmp_path, lock_acquire_sleep_interval=0.05)
    holder.start()
    service = LockableService(
        SharedFileLocker(tmp_path, lock_acquire_sleep_interval=0.05), lambda stop: stop.wait()
    )
    thread = service.start()
    assert service.locker.standing_by.wait(10)
    service.stop(10)
    assert not thread.is_alive() and service.state is State.STOPPED
    assert service.masterships == 0 and holder.keep_alive()
    holder.stop()
