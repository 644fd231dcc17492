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

from ..cli.conftest import Proc, child_env

SCRIPT = Path(__file__).with_name("service_proc.py")


def start(url: str, name: str) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, str(SCRIPT), url, name],
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
