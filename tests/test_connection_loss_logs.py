"""An expected connection loss under a held lock prints no aiormq traceback on a user's
stderr: aiormq's records about our connections go through `amqp_locks.transport`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from amqp_locks import Broker, Mutex
from amqp_locks_dev import devbroker

from .faultproxy import FaultProxy

#: A user's program: no logging configured, so WARNING records reach stderr through
#: logging's last resort, tracebacks included. Its heartbeat is the suite's 5 s: with 1 s
#: (as before) a loaded machine lost the connection on its own before the test cut it
#: (rehearsal 110, 3.10.8: the node logged the client closing TCP right after HELD, and no
#: connection of the child was left to close). Both cuts are seen at once, not by heartbeat.
CHILD = textwrap.dedent(
    """
    import os, sys
    from amqp_locks import Broker, Mutex
    broker = Broker(os.environ["URL"], heartbeat=5.0)
    lease = Mutex(broker, os.environ["NAME"]).acquire(timeout=30)
    print("HELD", flush=True)
    assert lease.lost.wait(60), "the lease was not marked lost"
    print("LOST", lease.lost_reason, flush=True)
    broker.close()
    """
)

AIORMQ_NOISE = ("Traceback", "Cancelling cause reader", "AMQPConnectionError", "aiormq")


def _close_from_broker(node: devbroker.NodeInfo, child: subprocess.Popen[str]) -> None:
    """The broker closes (CONNECTION_FORCED) the connections of process `child`."""
    pid, deadline = child.pid, time.monotonic() + 30
    while time.monotonic() < deadline:
        if child.poll() is not None:  # it lost its connection on its own: say how
            out, err = child.communicate()
            raise AssertionError(f"child {pid} ended before the broker closed it: {out}{err}")
        listing = devbroker.rabbitmqctl(
            node, "list_connections", "pid", "client_properties", "--no-table-headers", "-q"
        )
        mine = [line.split("\t", 1)[0] for line in listing.splitlines() if f"pid={pid}" in line]
        for conn in mine:
            devbroker.rabbitmqctl(node, "close_connection", conn, "test: closed")
        if mine:
            return
        time.sleep(0.2)  # the listing may lag the connection by a moment
    raise AssertionError(f"no connection of pid {pid} listed")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["reset", "broker-close"])
def test_connection_killed_under_a_held_lock_prints_no_traceback(
    node: devbroker.NodeInfo, proxy: FaultProxy, how: str
) -> None:
    env = {**os.environ, "URL": proxy.url(), "NAME": f"t{uuid.uuid4().hex[:12]}"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "HELD"
        if how == "reset":
            proxy.reset()
        else:
            _close_from_broker(node, child)
        out, err = child.communicate(timeout=90)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err
    assert out.startswith("LOST"), (out, err)
    assert not [word for word in AIORMQ_NOISE if word in err], err
    # What the user does see: the library's own warnings, naming the loss.
    assert "lost mutex 1" in err, err


def test_aiormq_records_of_a_lost_connection_go_through_our_logger(
    proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with Broker(proxy.url(), heartbeat=1.0) as broker:
        lease = Mutex(broker, f"t{uuid.uuid4().hex[:12]}").acquire(timeout=30)
        assert lease is not None
        proxy.reset()
        assert lease.lost.wait(30)
        broker.close()
    assert not [r for r in caplog.records if r.name.startswith("aiormq.connection")]
    ours = [r for r in caplog.records if r.name == "amqp_locks.transport"]
    reader = [r for r in ours if "Cancelling cause reader exited abnormally" in r.getMessage()]
    assert reader and all(r.levelno == logging.DEBUG and r.exc_info for r in reader), ours


def test_an_unreachable_broker_is_an_exception_not_a_log_line() -> None:
    code = (
        "from amqp_locks import Broker, BrokerUnreachable\n"
        "try:\n"
        "    Broker('amqp://guest:guest@127.0.0.1:1/', connect_timeout=5).connect()\n"
        "except BrokerUnreachable:\n"
        "    print('RAISED')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "RAISED", done
    assert done.stderr == "", done.stderr
