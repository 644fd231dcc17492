"""Faults that strike one holder: SIGKILL, SIGSTOP past the heartbeat, and a silent partition
(blackhole) shorter and longer than the heartbeat timeout — for every primitive.

Each scenario has a holder ``a`` and a waiter ``b`` contending for one permit, both writing
to a fenced and an unfenced protected resource, and judges the run with the checker:
(a) overlaps of belief, (b) stale writes accepted, token regressions, (c) leaks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from . import primitives, report
from .history import Event
from .proxy import FaultProxy
from .run import FaultRun

Make = Callable[..., FaultRun]

#: Heartbeat for the short partition: a silence of 0.6 period must not trip the watchdog
#: even on a loaded machine.
HB_PARTITION = 2.0
#: Heartbeat for kills, pauses and long partitions: the broker drops a silent holder after
#: 2-3 periods (RabbitMQ takes whole seconds; 1 is the least).
HB_FAST = 1.0


def _leaked(run: FaultRun) -> int:
    return primitives.leaked(run.kind, run.url, run.name, run.permits)


def scenario_kill(make: Make, kind: str) -> dict[str, float]:
    run = make(kind, heartbeat=HB_FAST)
    run.holder("a")
    ga = run.wait_event("grant", "a", 30)
    run.wait_write(ga.grant, 10)
    run.holder("b")
    run.wait_waiting(1, holders=1)
    killed_at = run.kill("a")
    gb = run.wait_event("grant", "b", 30)
    run.stop()
    v = run.verdict(leaked=_leaked(run))
    figures = {"regrant_after_kill": gb.t - killed_at}
    report.record("kill", kind, v, **figures)
    assert (v.grants, v.overlaps, v.key_overlaps) == (2, 0, 0), v.summary()
    assert (v.stale_accepted, v.rejected, v.token_regressions) == (0, 0, 0), v.summary()
    assert v.leaked == 0, v.summary()
    assert run.end_of(ga.grant) is not None and run.end_of(ga.grant).kind == "killed"  # type: ignore[union-attr]
    return figures


def scenario_pause(make: Make, kind: str) -> dict[str, float]:
    """SIGSTOP the holder mid-unit until the broker re-grants, then SIGCONT: beliefs overlap
    (a paused process notices nothing) and fencing refuses the resumed holder's write."""
    run = make(kind, heartbeat=HB_FAST)
    a = run.holder("a")
    ga = run.wait_event("grant", "a", 30)
    run.holder("b")
    run.wait_waiting(1, holders=1)
    run.wait_write(ga.grant, 10)
    paused_at = a.pause_mid_unit()  # it will resume straight into the unit's write
    gb = run.wait_event("grant", "b", 30 * HB_FAST)
    run.wait_write(gb.grant, 10)  # the new holder registered its higher token
    resumed_at = a.resume()
    lost = run.wait_event("lost", "a", 10)
    run.stop()
    v = run.verdict(leaked=_leaked(run))
    u = run.verdict(fenced=False)
    stale = len(run.writes(ga.grant, after=resumed_at))
    figures = {
        "regrant_after_pause": gb.t - paused_at,
        "detected_after_resume": lost.t - resumed_at,
        "belief_overlap": v.overlap_seconds,
        "stale_writes_refused": v.rejected,
        "stale_writes_accepted_unfenced": u.stale_accepted,
    }
    report.record("pause", kind, v, **figures)
    # (a) by design: a believed until it resumed, b held meanwhile
    assert (v.overlaps, v.key_overlaps, v.max_believers) == (1, 1, 2), v.summary()
    assert v.min_margin is not None and v.min_margin < 0
    # (b) the resumed holder wrote with its old token: refused, and only fencing refused it
    assert stale >= 1
    assert (v.stale_accepted, v.rejected) == (0, stale), v.summary()
    assert u.stale_accepted == stale and u.rejected == 0, u.summary()
    assert v.token_regressions == 0 and gb.token > ga.token
    assert v.leaked == 0, v.summary()
    return figures


def _proxied_holder_with_waiter(run: FaultRun, heartbeat: float) -> tuple[Event, FaultProxy]:
    """Holder "a" behind its proxy holds, "b" waits, and the broker has just sent "a" a
    frame: the moment a partition scenario cuts the proxy."""
    run.holder("a", proxied=True)
    ga = run.wait_event("grant", "a", 30)
    run.holder("b")
    proxy = run.proxies["a"]
    run.wait_waiting(1, holders=1)
    assert proxy.wait_downstream(heartbeat), "no heartbeat from the broker"
    return ga, proxy


def scenario_short_blackhole(make: Make, kind: str) -> dict[str, float]:
    """A partition of 0.6 heartbeat periods: nobody notices, nothing changes hands."""
    run = make(kind, heartbeat=HB_PARTITION)
    ga, proxy = _proxied_holder_with_waiter(run, HB_PARTITION)
    proxy.blackhole()
    cut_at = time.monotonic()
    time.sleep(0.6 * HB_PARTITION)  # the scenario: the partition's length
    proxy.heal()
    healed_at = time.monotonic()
    run.wait_write(ga.grant, 10, after=healed_at)
    assert proxy.wait_downstream(HB_PARTITION)  # the broker still talks on that connection
    assert proxy.connections == 1  # the same one, never replaced
    assert run.event("lost", "a") is None and run.event("grant", "b") is None
    run.stop()
    v = run.verdict(leaked=_leaked(run))
    figures = {"partition": healed_at - cut_at}
    report.record("blackhole-short", kind, v, **figures)
    assert v.margins == [] and all(e.kind != "lost" for e in run.events())
    assert (v.overlaps, v.key_overlaps, v.stale_accepted, v.rejected) == (0, 0, 0, 0)
    assert v.token_regressions == 0 and v.leaked == 0, v.summary()
    return figures


def scenario_long_blackhole(make: Make, kind: str) -> dict[str, float]:
    """A partition that lasts until the broker re-grants: the holder's watchdog must tell it
    first (one heartbeat of silence against the broker's two to three)."""
    run = make(kind, heartbeat=HB_FAST)
    ga, proxy = _proxied_holder_with_waiter(run, HB_FAST)
    proxy.blackhole()
    cut_at = time.monotonic()
    gb = run.wait_event("grant", "b", 10 * HB_FAST)
    proxy.heal()
    lost = run.end_of(ga.grant)
    assert lost is not None and lost.kind == "lost", run.events()
    run.stop()
    v = run.verdict(leaked=_leaked(run))
    figures = {
        "detected": lost.t - cut_at,
        "regranted": gb.t - cut_at,
        "margin": gb.t - lost.t,
    }
    report.record("blackhole-long", kind, v, **figures)
    assert (v.overlaps, v.key_overlaps, v.stale_accepted) == (0, 0, 0), v.summary()
    assert v.min_margin is not None and v.min_margin > 0.5 * HB_FAST, v.summary()
    assert figures["detected"] < 1.5 * HB_FAST, figures
    assert v.token_regressions == 0 and gb.token > ga.token
    assert v.leaked == 0, v.summary()
    return figures


def scenario_one_way_blackhole(make: Make, kind: str, direction: str) -> dict[str, float]:
    """Only one direction cut. "down" (the broker's frames lost): the watchdog hears nothing
    and gives up as for a full partition. "up" (ours lost): the broker's heartbeats still
    arrive; the holder must still learn before the broker, missing ours, re-grants."""
    run = make(kind, heartbeat=HB_FAST)
    ga, proxy = _proxied_holder_with_waiter(run, HB_FAST)
    proxy.blackhole(direction)  # type: ignore[arg-type]
    cut_at = time.monotonic()
    gb = run.wait_event("grant", "b", 10 * HB_FAST)
    proxy.heal()
    lost = run.end_of(ga.grant)
    assert lost is not None and lost.kind == "lost", run.events()
    run.stop()
    v = run.verdict(leaked=_leaked(run))
    figures = {"detected": lost.t - cut_at, "regranted": gb.t - cut_at, "margin": gb.t - lost.t}
    report.record(f"blackhole-{direction}", kind, v, **figures)
    assert (v.overlaps, v.key_overlaps, v.stale_accepted) == (0, 0, 0), v.summary()
    assert v.min_margin is not None and v.min_margin > 0, v.summary()
    if direction == "up":
        # The broker drops us on its own timeout (2-3 periods without our frames): the
        # holder must have learnt about a period earlier, not when the broker hung up.
        assert figures["detected"] < 1.5 * HB_FAST, figures
        assert v.min_margin > 0.5 * HB_FAST, figures
    # "down": the holder's watchdog gives up first, and its abort reaches the broker (the
    # other way is open), which frees the lock only then: lost before re-grant by causality.
    assert v.token_regressions == 0 and v.leaked == 0, v.summary()
    return figures


FAST_KINDS = ["semaphore", "token", "mutex"]
#: Every primitive; the quorum token queue only in the soak (same code path as "token").
KINDS = [*FAST_KINDS, pytest.param("token-quorum", marks=pytest.mark.slow)]
SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind", KINDS)
def test_killed_holder(fault_run: Make, kind: str) -> None:
    scenario_kill(fault_run, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_paused_holder_is_fenced(fault_run: Make, kind: str) -> None:
    scenario_pause(fault_run, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_short_partition_changes_nothing(fault_run: Make, kind: str) -> None:
    scenario_short_blackhole(fault_run, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_long_partition_is_detected_before_the_regrant(fault_run: Make, kind: str) -> None:
    scenario_long_blackhole(fault_run, kind)


@pytest.mark.parametrize(
    ("kind", "direction"),
    [
        ("mutex", "up"),  # the fast subset's guard of the watchdog's ping rule
        *(pytest.param(k, "up", marks=SLOW) for k in ["semaphore", "token", "token-quorum"]),
        *(pytest.param(k, "down", marks=SLOW) for k in primitives.KINDS),
    ],
)
def test_one_way_partition_is_detected_before_the_regrant(
    fault_run: Make, kind: str, direction: str
) -> None:
    scenario_one_way_blackhole(fault_run, kind, direction)
