"""Faults of the broker node itself, on the private fault node: a clean restart, a crash
(SIGKILL of the VM) and a frozen node (SIGSTOP past the heartbeat, then SIGCONT).

Every primitive runs at once on the node (one fault serves them all): per lock, holder ``a``
holds until it loses the lock and ``b`` waits; both acquire again after the fault.
Every grant alive at the fault must end ``lost`` before anyone is granted again, nothing
may be granted twice, fencing tokens keep rising across the fault, and capacity comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from amqp_locks_dev import devbroker

from . import node, primitives, report
from .checker import Verdict
from .run import FaultRun

Make = Callable[..., FaultRun]
HB = 1.0


def _start_runs(make: Make, info: devbroker.NodeInfo) -> list[FaultRun]:
    runs = []
    for kind in primitives.KINDS:
        run = make(kind, url=info.url, heartbeat=HB)
        run.holder("a")
        runs.append(run)
    for run in runs:
        run.wait_event("grant", "a", 60)
        run.holder("b")
    for run in runs:
        run.wait_waiting(1, holders=1)
    return runs


def _judge(test: str, runs: list[FaultRun], fault_at: float, back_at: float) -> list[Verdict]:
    verdicts = []
    for run in runs:
        run.wait(  # the lock is granted again after the fault (maybe before back_at was read)
            lambda run=run: any(e.kind == "grant" and e.t > fault_at for e in run.events()),
            90,
            f"a grant of {run.kind} after the fault",
        )
        events = run.events()
        open_at_fault = [
            e
            for e in events
            if e.kind == "grant"
            and e.t < fault_at
            and (run.end_of(e.grant) is None or run.end_of(e.grant).t >= fault_at)  # type: ignore[union-attr]
        ]
        run.stop()
        v = run.verdict(leaked=primitives.leaked(run.kind, run.url, run.name, run.permits))
        ends = [run.end_of(g.grant) for g in open_at_fault]
        regrants = [e.t for e in events if e.kind == "grant" and e.t >= fault_at]
        before = [e.token for e in events if e.kind == "grant" and e.t < fault_at]
        after = [e.token for e in events if e.kind == "grant" and e.t >= fault_at]
        figures = {
            "holders_at_fault": len(open_at_fault),
            "detected": [e.t - fault_at for e in ends if e is not None],
            "first_regrant": min(regrants) - fault_at,
            "broker_back": back_at - fault_at,
        }
        report.record(test, run.kind, v, **figures)
        assert open_at_fault, f"{run.kind}: nobody held the lock when the fault struck"
        assert all(e is not None and e.kind == "lost" for e in ends), (run.kind, ends)
        assert all(e.t < min(regrants) for e in ends if e is not None)  # lost before re-grant
        assert v.min_margin is not None and v.min_margin > 0, (run.kind, v.summary())
        assert (v.overlaps, v.key_overlaps, v.stale_accepted) == (0, 0, 0), (run.kind, v.summary())
        assert v.token_regressions == 0 and min(after) > max(before), (run.kind, before, after)
        assert v.leaked == 0, (run.kind, v.summary())
        verdicts.append(v)
    return verdicts


def test_broker_restart(fault_run: Make, fault_node: devbroker.NodeInfo) -> None:
    runs = _start_runs(fault_run, fault_node)
    fault_at = time.monotonic()
    node.restart()
    _judge("broker-restart", runs, fault_at, time.monotonic())


@pytest.mark.slow
def test_broker_crash(fault_run: Make, fault_node: devbroker.NodeInfo) -> None:
    runs = _start_runs(fault_run, fault_node)
    fault_at = node.kill(fault_node)
    node.start(port=fault_node.amqp_port)
    _judge("broker-kill", runs, fault_at, time.monotonic())


@pytest.mark.slow
def test_frozen_broker(fault_run: Make, fault_node: devbroker.NodeInfo) -> None:
    """A node frozen for 3 heartbeats: every client gives up after one; the node, once
    thawed, finds their connections gone and frees everything."""
    runs = _start_runs(fault_run, fault_node)
    fault_at = node.pause(fault_node)
    try:
        for run in runs:  # every holder gives up on its own, while the node is frozen
            for g in [e for e in run.events() if e.kind == "grant" and e.t < fault_at]:
                run.wait(lambda g=g, r=run: r.end_of(g.grant), 10 * HB, f"end of {g.grant}")
    finally:
        back_at = node.resume(fault_node)
    _judge("broker-frozen", runs, fault_at, back_at)


def test_memory_alarm_does_not_cost_the_lease(fault_node: devbroker.NodeInfo) -> None:
    """During a resource alarm RabbitMQ stops reading a connection that publishes, and
    pauses its heartbeat timeout for it: the watchdog must not take the unanswered pings
    for a partition (the lease is held all along, and verifies once the alarm clears)."""
    from amqp_locks import Broker, Mutex

    name = f"alarm{time.monotonic_ns()}"
    with Broker(fault_node.url, heartbeat=HB) as b:
        lease = Mutex(b, name).acquire(timeout=10)
        assert lease is not None
        session = b.core.run(b.core.session())
        devbroker.rabbitmqctl(fault_node, "set_vm_memory_high_watermark", "0.0000001")
        try:
            # A publish during the alarm (an acquire's probe would do) blocks the connection.
            b.core.run(_spawn_publish(session))
            deadline = time.monotonic() + 20
            while not session._blocked():  # the broker told us: connection.blocked
                assert time.monotonic() < deadline, "no connection.blocked from the broker"
                time.sleep(0.05)
            assert not lease.lost.wait(3 * HB), lease.lost_reason
        finally:
            devbroker.rabbitmqctl(fault_node, "set_vm_memory_high_watermark", "0.4")
        assert lease.verify() and not lease.lost.is_set()
        lease.release()


async def _spawn_publish(session: Any) -> None:
    session.spawn(session.publish("", "amqp-locks-nowhere", b"x"))
