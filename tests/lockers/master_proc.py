"""A master/standby process for the fault tests: prints MASTER <token> / STANDBY lines."""

from __future__ import annotations

import sys
import threading

from amqp_locks.lockers import DatabaseLocker, LeaseDatabaseLocker, Locker
from amqp_locks.service import LockableService, State


def main() -> None:
    kind, url, name = sys.argv[1], sys.argv[2], sys.argv[3]
    period, lease = float(sys.argv[4]), float(sys.argv[5])
    locker: Locker
    if kind == "database":
        locker = DatabaseLocker(url, name, lock_acquire_sleep_interval=0.2)
    else:
        locker = LeaseDatabaseLocker(
            url, name, lease_duration=lease, lock_acquire_sleep_interval=0.2
        )

    def on_state(service: LockableService, state: State) -> None:
        token = service.locker.fencing_token if state is State.MASTER else 0
        print(f"{state.value.upper()} {token}", flush=True)

    service = LockableService(
        locker, lambda stop: stop.wait(), lock_keep_alive_period=period, on_state=on_state
    )
    service.start()
    sys.stdin.read()  # until the test closes stdin or kills us
    service.stop(10)
    threading.Event().wait(0)


if __name__ == "__main__":
    main()
