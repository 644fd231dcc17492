"""A `LockableService` on an AMQP locker, run in its own process's main thread, for
tests/lockers/test_service_signals.py: it says when it is standby or master and when its
work saw the stop event, then reports how `run()` ended."""

from __future__ import annotations

import sys
import threading

from amqp_locks import AmqpLocker, Broker, LockableService
from amqp_locks.service import State


def main(url: str, name: str, period: float = 0.0) -> int:
    def work(stop: threading.Event) -> None:
        stop.wait()
        print("work saw stop", flush=True)

    def on_state(service: LockableService, state: State) -> None:
        print(f"state {state.value}", flush=True)

    with Broker(url) as broker:
        locker = AmqpLocker(broker, name, lock_acquire_sleep_interval=0.2)
        service = LockableService(locker, work, on_state=on_state, lock_keep_alive_period=period)
        service.run()
        signum = service.signal_received
        print(f"run returned, signal {signum.name if signum else None}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], *(float(a) for a in sys.argv[3:4])))
