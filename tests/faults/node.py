"""Broker node faults on a private node of our own: stop, start, SIGKILL, SIGSTOP/SIGCONT.

Never the shared ``amqplockstest`` node: other tests use it at the same time. The node is
``amqplocksfault`` (``$AMQP_LOCKS_FAULT_NODE`` overrides), under ``$AMQP_LOCKS_TEST_HOME``
when set, like the test node. A killed node comes back on the same AMQP port, so the URLs
holders were given stay valid.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from amqp_locks_dev import devbroker

from .. import nodes
from .holders import wait_stopped


def node_name() -> str:
    return os.environ.get("AMQP_LOCKS_FAULT_NODE") or nodes.node_name("amqplocksfault")


def base_dir() -> Path | None:
    home = nodes.test_home()
    return home / node_name() if home else None


def start(port: int | None = None) -> devbroker.NodeInfo:
    return devbroker.start(name=node_name(), base_dir=base_dir(), amqp_port=port)


def stop() -> None:
    devbroker.stop(name=node_name(), base_dir=base_dir())


def restart() -> devbroker.NodeInfo:
    """A clean stop (clients get connection.close) and a start on the same ports."""
    return devbroker.restart(name=node_name(), base_dir=base_dir())


def beam_pid(info: devbroker.NodeInfo) -> int:
    return int(info.pid_file.read_text().strip())


def kill(info: devbroker.NodeInfo, timeout: float = 30.0) -> float:
    """SIGKILL the node's VM (a crash: no goodbye to clients); returns when it is gone."""
    pid = beam_pid(info)
    os.kill(pid, signal.SIGKILL)
    t = time.monotonic()
    deadline = t + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"broker VM {pid} survived SIGKILL")
        time.sleep(0.02)
    return t


def pause(info: devbroker.NodeInfo) -> float:
    """SIGSTOP the node's VM: every client's connection goes silent at once."""
    pid = beam_pid(info)
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid)
    return time.monotonic()


def resume(info: devbroker.NodeInfo) -> float:
    os.kill(beam_pid(info), signal.SIGCONT)
    return time.monotonic()
