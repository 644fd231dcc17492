"""`LockableService.run()` in the main thread stops on SIGINT (Ctrl-C) and SIGTERM as
`stop()` would: the work's stop event is set, the lock released, `run()` returns; no
KeyboardInterrupt traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from amqp_locks import Broker, Mutex

from ..cli.conftest import Proc, child_env, signal_a_thread

SCRIPT = Path(__file__).with_name("service_proc.py")


def start(url: str, name: str, *extra: str) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, str(SCRIPT), url, name, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=child_env(),
    )
    p = Proc(popen)
    p.start_pumps()
    return p


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_master_and_the_standby_cleanly(
    sig: signal.Signals, amqp_url: str, broker: Broker, name: str
) -> None:
    master = start(amqp_url, name)
    standby: Proc | None = None
    try:
        master.expect("state master")
        standby = start(amqp_url, name)
        standby.expect("state standby")
        # The standby, blocked in the locker's wait, stops at once and holds nothing.
        standby.popen.send_signal(sig)
        rc, out, err = standby.finish()
        assert rc == 0, err
        assert f"run returned, signal {sig.name}" in out
        assert "state master" not in out and "Traceback" not in err
        # The master: its work is told to stop, then the lock is released.
        master.popen.send_signal(sig)
        rc, out, err = master.finish()
        assert rc == 0, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err
        lines = out.splitlines()
        assert lines.index("work saw stop") < lines.index("state stopped")
        assert f"run returned, signal {sig.name}" in out
        assert f"{sig.name} received: stopping" in err
        assert not Mutex(broker, name).locked()
    finally:
        for p in (master, standby):
            if p is not None:
                p.kill()


def test_sigterm_taken_by_another_thread_still_stops_the_master(
    amqp_url: str, broker: Broker, name: str
) -> None:
    """The kernel may hand SIGTERM to any thread of the process that does not block it, and
    one taken by another thread does not interrupt the main thread's wait; Python runs the
    handler only when the main thread next runs Python. With a keep-alive every 60 s the
    master's main thread waits 60 s at a time, so before amqp_locks.signals' slices such a
    SIGTERM was acted on only at the next keep-alive (CI rehearsal 62: `elect`, whose main
    thread joined with no timeout, never). Sent to one of the service's threads, it stops
    the master within seconds."""
    master = start(amqp_url, name, "60")
    try:
        master.expect("state master")
        signal_a_thread(master.popen.pid, signal.SIGTERM)
        rc, out, err = master.finish(timeout=15.0)
        assert rc == 0, err
        lines = out.splitlines()
        assert lines.index("work saw stop") < lines.index("state stopped")
        assert "run returned, signal SIGTERM" in out
        assert not Mutex(broker, name).locked()
    finally:
        master.kill()
