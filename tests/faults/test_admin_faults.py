"""An administrator shrinking a lock while holders work: `SemaphoreAdmin.remove_slots` on a
persistent semaphore, `TokenSemaphore.remove_permits` on a token semaphore.

Holders cycle (hold, release, acquire again) on 3 permits, one more holder than permits so
someone always waits. After the removal the removed key is never granted again, at most
2 grants are believed at once from the moment the removed slot's holder learnt of it
(persistent semaphore) or from the removal (token semaphore: it waits for a holder to give
a token back), and capacity settles at 2 with nothing leaked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from amqp_locks import Broker, SemaphoreAdmin, TokenSemaphore

from . import primitives, report
from .checker import intervals, peak
from .run import FaultRun

Make = Callable[..., FaultRun]
PERMITS = 3


def _start(make: Make, kind: str, **spec: object) -> FaultRun:
    run = make(kind, permits=PERMITS, heartbeat=2.0)
    for n in range(PERMITS + 1):
        run.holder(f"h{n}", hold=0.4, rest=0.05, **spec)
    for n in range(PERMITS + 1):
        run.wait_event("grant", f"h{n}", 60)
    return run


def test_removing_a_held_slot(fault_run: Make) -> None:
    # Whoever gets the top slot keeps it until told (the others cycle on the two below):
    # it is still held when the removal strikes, however long that takes to start.
    run = _start(fault_run, "semaphore", hold_key=PERMITS)
    # the top slot held: its holder must be told
    run.wait(
        lambda: any(
            e.kind == "grant" and e.key == PERMITS and run.end_of(e.grant) is None
            for e in run.events()
        ),
        30,
        "slot 3 held",
    )
    removed_at = time.monotonic()
    with Broker(run.url, heartbeat=5) as b:
        removal = SemaphoreAdmin(b, run.name).remove_slots(1, wait=30)
    done_at = time.monotonic()
    assert removal.removed == (PERMITS,) and removal.still_held == ()
    events = run.events()
    victim = next(
        e
        for e in events
        if e.kind == "grant"
        and e.key == PERMITS
        and e.t < removed_at
        and (run.end_of(e.grant) is None or run.end_of(e.grant).t >= removed_at)  # type: ignore[union-attr]
    )
    told = run.end_of(victim.grant)
    assert told is not None and told.kind == "lost" and "removed" in told.detail, told
    time.sleep(0.5)  # the scenario: holders keep cycling on the two slots left
    run.stop()
    events = run.events()
    spans = intervals(events, time.monotonic())
    v = run.verdict(leaked=primitives.leaked(run.kind, run.url, run.name, PERMITS - 1))
    figures = {"told_after": told.t - removed_at, "removal_with_wait": done_at - removed_at}
    report.record("admin-remove-slot", run.kind, v, **figures)
    assert not [e for e in events if e.kind == "grant" and e.key == PERMITS and e.t > removed_at]
    assert peak(spans, since=told.t) <= PERMITS - 1
    assert (v.overlaps, v.key_overlaps, v.stale_accepted, v.token_regressions) == (0, 0, 0, 0), (
        v.summary()
    )
    assert v.leaked == 0, v.summary()


@pytest.mark.parametrize("kind", ["token", pytest.param("token-quorum", marks=pytest.mark.slow)])
def test_removing_a_permit_while_holders_work(fault_run: Make, kind: str) -> None:
    run = _start(fault_run, kind)
    removed_at = time.monotonic()
    with Broker(run.url, heartbeat=5) as b:
        removed = TokenSemaphore(b, run.name).remove_permits(1, timeout=30)
    done_at = time.monotonic()
    assert len(removed) == 1
    time.sleep(0.5)  # the scenario: holders keep cycling on the two permits left
    run.stop()
    events = run.events()
    spans = intervals(events, time.monotonic())
    v = run.verdict(leaked=primitives.leaked(run.kind, run.url, run.name, PERMITS - 1))
    report.record("admin-remove-permit", kind, v, removal=done_at - removed_at)
    assert not [e for e in events if e.kind == "grant" and e.key == removed[0] and e.t > done_at]
    assert peak(spans, since=done_at) <= PERMITS - 1
    assert all(e.kind != "lost" for e in events)  # nobody is interrupted: it waits for a return
    assert (v.overlaps, v.key_overlaps, v.stale_accepted, v.token_regressions) == (0, 0, 0, 0), (
        v.summary()
    )
    assert v.leaked == 0, v.summary()
