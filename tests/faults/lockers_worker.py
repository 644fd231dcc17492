"""A master/standby process for the locker fault scenarios (issue 7).

One process = one `LockableService` over one locker, configured by a JSON argument. While it
is master it writes to the served :class:`~tests.faults.resource.ProtectedResource` with its
locker's fencing token; every mastership is one grant in the shared history:

- ``grant`` when the service becomes master (token = ``locker.fencing_token``);
- ``lost`` when its work stopped because the service demoted itself (a failed or timed-out
  keep-alive), ``release`` when it stopped because the test asked it to (stdin closed).

The end event is recorded by the work itself, after its last write: the belief interval
covers every write the grant made. The test kills or pauses the process by PID and records
``killed`` itself.

Work loop: write, then "decide" (check the stop event), then do one unit of work (sleep
``write_every``), then write its result. A process paused in the middle of a unit still
writes its result when resumed, before it can notice anything — the hazard fencing exists
for. A ``PAUSE`` line on stdin makes the next unit stop the whole process (SIGSTOP to
itself) right after its decision: the test resumes it by PID.

Lines on stdout (for the test to wait on): ``READY``, ``MASTER <grant> <token>``,
``DEMOTED <grant>``, ``STANDBY``, ``WAITING`` (a first attempt failed), ``PAUSING`` (just
before it stops itself), ``STOPPED``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from amqp_locks import Broker
from amqp_locks.lockers import (
    AmqpLocker,
    DatabaseLocker,
    LeaseDatabaseLocker,
    Locker,
    SharedFileLocker,
)
from amqp_locks.service import LockableService, State

from .history import Recorder
from .resource import ResourceClient

KEY = 0  # one lock: the fencing key is 0


def make_locker(cfg: dict[str, Any]) -> tuple[Locker, Broker | None]:
    """The locker a config names (also used by the tests for their fresh lockers)."""
    kind = cfg["kind"]
    common: dict[str, Any] = {"lock_acquire_sleep_interval": cfg.get("interval", 0.1)}
    if cfg.get("fail_if_locked"):
        common["fail_if_locked"] = True
    if kind == "file":
        return SharedFileLocker(cfg["dir"], **common), None
    if kind in ("database", "lease") and "connect_timeout" in cfg:
        common["connect_timeout"] = cfg["connect_timeout"]
    if kind == "database":
        return DatabaseLocker(cfg["url"], cfg["name"], **common), None
    if kind == "lease":
        return (
            LeaseDatabaseLocker(cfg["url"], cfg["name"], lease_duration=cfg["lease"], **common),
            None,
        )
    if kind == "amqp":
        broker = Broker(cfg["amqp_url"], heartbeat=cfg.get("heartbeat", 1.0))
        return AmqpLocker(broker, cfg["name"], **common), broker
    raise ValueError(f"unknown locker kind {kind!r}")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(
        level=logging.INFO if cfg.get("verbose") else logging.WARNING,
        stream=sys.stderr,
        format=f"%(relativeCreated)8.0f {cfg['who']} %(name)s %(levelname)s %(message)s",
    )
    recorder = Recorder(cfg["history"])
    resource = ResourceClient(cfg["resource"])
    locker, broker = make_locker(cfg)
    write_every = float(cfg.get("write_every", 0.02))
    who = cfg["who"]
    shutting_down = threading.Event()
    pause_asked = threading.Event()
    count = 0
    current: dict[str, Any] = {}

    def on_state(service: LockableService, state: State) -> None:
        nonlocal count
        if state is State.MASTER:
            count += 1
            grant = f"{who}-{count}"
            token = service.locker.fencing_token
            current.update(grant=grant, token=token)
            recorder.record("grant", grant, KEY, token, detail=cfg["kind"])
            say(f"MASTER {grant} {token}")
        elif state is State.STANDBY:
            say("STANDBY")

    def work(stop: threading.Event) -> None:
        grant, token = current["grant"], current["token"]
        try:
            while True:
                resource.write(grant, KEY, token)
                if stop.is_set():
                    break
                if pause_asked.is_set():  # frozen mid-unit: its result is written on resume
                    pause_asked.clear()
                    say("PAUSING")
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(write_every)  # one unit of work, decided before it started
        finally:
            if shutting_down.is_set():
                recorder.record("release", grant, KEY, token)
            else:
                recorder.record("lost", grant, KEY, token)
                say(f"DEMOTED {grant}")

    keep_alive = locker.keep_alive

    def announced_keep_alive() -> bool:
        ok = keep_alive()
        if ok:
            say("RENEWED")  # the keep-alive's statement is over: the worker is idle now
        return ok

    locker.keep_alive = announced_keep_alive  # type: ignore[method-assign]

    options: dict[str, Any] = {}
    if cfg.get("keep_alive_timeout") is not None:
        options["keep_alive_timeout"] = cfg["keep_alive_timeout"]
    service = LockableService(
        locker,
        work,
        lock_keep_alive_period=cfg["period"],
        on_state=on_state,
        work_stop_timeout=10.0,
        **options,
    )
    service.start()
    say("READY")

    def watch_standby() -> None:
        locker.standing_by.wait()
        say("WAITING")  # a first attempt failed: this process waits as standby

    threading.Thread(target=watch_standby, daemon=True).start()
    for line in sys.stdin:  # until the test closes stdin (or kills us)
        if line.strip() == "PAUSE":
            pause_asked.set()
    shutting_down.set()
    service.stop(30)
    locker.close()
    if broker is not None:
        broker.close()
    recorder.close()
    say("STOPPED")
    os._exit(0)  # no lingering non-daemon threads (a hung driver call) keep us alive


if __name__ == "__main__":
    main()
