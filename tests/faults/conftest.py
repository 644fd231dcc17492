"""Fixtures of the fault scenarios: a run factory on the shared test node, and a private node
(`amqplocksfault`, or ``$AMQP_LOCKS_FAULT_NODE``) that only these tests stop, kill or restart."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from amqp_locks import Broker, prepare_fences
from amqp_locks_dev import devbroker

from . import node as fault_node_control
from . import primitives
from .run import FaultRun


@pytest.fixture
def fault_run(tmp_path: Path, amqp_url: str, name: str) -> Iterator[Callable[..., FaultRun]]:
    """make(kind, permits=1, heartbeat=2.0, url=None, name=None): a FaultRun on a lock set
    up for it; closed (holders killed by pid, proxies closed) and cleaned up afterwards."""
    runs: list[FaultRun] = []

    def make(
        kind: str,
        *,
        permits: int = 1,
        heartbeat: float = 2.0,
        url: str | None = None,
        lock_name: str | None = None,
    ) -> FaultRun:
        target = url or amqp_url
        lock = lock_name or f"{name}-{len(runs)}"
        with Broker(target, heartbeat=5) as b:
            primitives.setup(kind, b, lock, permits)
        run = FaultRun(
            tmp_path / f"run{len(runs)}",
            kind=kind,
            url=target,
            name=lock,
            permits=permits,
            heartbeat=heartbeat,
        )
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()
        primitives.cleanup(run.url, run.name)


@pytest.fixture(scope="session")
def fault_node() -> Iterator[devbroker.NodeInfo]:
    """The private node for broker stop/kill/restart scenarios. Left running for reuse on a
    developer machine; under CI a node this session started is stopped, like the test node."""
    was_running = (
        devbroker.status(
            name=fault_node_control.node_name(), base_dir=fault_node_control.base_dir()
        )
        is not None
    )
    info = fault_node_control.start()
    # The shards exist before any fault: a quorum queue made moments before a SIGKILL may
    # not come back on 3.10.8 (amqp_locks.prepare_fences says why; tested there).
    with Broker(info.url) as b:
        prepare_fences(b)
    yield info
    if not was_running and os.environ.get("CI") and os.environ.get("AMQP_LOCKS_KEEP_BROKER") != "1":
        fault_node_control.stop()
