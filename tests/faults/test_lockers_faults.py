"""Issue 7's fault scenarios for every locker: master/standby worker processes write to a
fencing resource while master; the checker counts (a) overlaps, (b) stale writes accepted,
(c) leaks.

Lockers: SharedFileLocker (local dir), DatabaseLocker and LeaseDatabaseLocker on SQLite,
PostgreSQL and MariaDB (private ``devdb`` servers named ``lockfaults``), AmqpLocker on the
shared test node. Periods are tuned short (interval 0.1 s, keep-alive 0.25 s, lease 1.5 s,
heartbeat 1 s); `pytest -s` prints one measured line per scenario.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .history import load
from .lockers_harness import Run, leak_check
from .lockers_targets import (  # noqa: F401 - lockfaults_dbs is a fixture
    ALL,
    EXPIRING,
    Target,
    build_target,
    lockfaults_dbs,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    t = build_target(request.param, tmp_path, request)
    yield t
    t.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def _run(target: Target, run_dir: Path, fencing: bool = True) -> Run:
    return Run(run_dir, target.cfg, fencing=fencing)


@pytest.mark.parametrize("target", ALL, indirect=True)
def test_master_killed_standby_takes_over(target: Target, run_dir: Path) -> None:
    run = _run(target, run_dir)
    try:
        first = run.spawn("a")
        first.wait_for("MASTER", 30)
        b = run.spawn("b")
        b.wait_for("WAITING", 30)  # the standby tried and is waiting before the crash
        assert not b.is_master()
        killed_at = first.kill()
        b.wait_for("MASTER", target.detection + 10)
        took = run.grants()[-1].t - killed_at
        leaked, free_after = leak_check_after(run, target)
        v = run.verdict(leaked)
        run.report(f"kill {target.label}", v, takeover=took, fresh_lock=free_after)
        assert v.grants == 2 and v.overlaps == 0 and v.key_overlaps == 0
        assert v.stale_accepted == 0 and v.token_regressions == 0
        assert took < target.detection
        assert v.leaked == 0
    finally:
        run.close()


def leak_check_after(run: Run, target: Target) -> tuple[int, float | None]:
    """Stop every worker cleanly, then (c): a fresh locker gets the lock in time."""
    for w in run.workers:
        w.stop()
    return leak_check(target.cfg, target.detection)


#: How long a paused master stays paused after its lock was re-granted (the scenario).
PAUSED_BEYOND_REGRANT = 0.3


def _pause_scenario(target: Target, run: Run) -> dict[str, float | None]:
    """Pause the master past its lease/heartbeats, resume it; the figures measured."""
    master = run.spawn("a")
    master.wait_for("MASTER", 30)
    standby = run.spawn("b")
    standby.wait_for("WAITING", 30)
    paused_at = master.pause()
    regrant: float | None = None
    if target.expiring:
        standby.wait_for("MASTER", target.detection + 10)
        regrant = run.grants()[-1].t - paused_at
        time.sleep(PAUSED_BEYOND_REGRANT)  # the scenario: still paused after the re-grant
    else:
        # The paused master's OS lock / open transaction stays: nobody may take over.
        time.sleep(target.detection)  # the scenario: a pause this long
    granted_while_paused = len(run.grants()) - 1
    resumed_at = master.resume()
    noticed: float | None = None
    if target.expiring:
        master.wait_for("DEMOTED", 30)
        lost = [e for e in load(run.history) if e.kind == "lost"]
        noticed = lost[0].t - resumed_at
    return {
        "regrant": regrant,
        "demoted_after_resume": noticed,
        "granted_while_paused": granted_while_paused,
    }


@pytest.mark.parametrize("target", ALL, indirect=True)
def test_master_paused_past_the_lease_then_resumed(target: Target, run_dir: Path) -> None:
    """A paused process cannot notice anything: where the lock expires (lease, heartbeats)
    it is re-granted under the paused master, whose belief overlaps the new master's until
    it runs again and demotes (by design). Fencing refuses its in-flight write. Where the
    lock lives as long as the process (flock, an open transaction), nobody takes over."""
    run = _run(target, run_dir)
    try:
        fig = _pause_scenario(target, run)
        leaked, free_after = leak_check_after(run, target)
        v = run.verdict(leaked)
        run.report(
            f"pause {target.label}",
            v,
            regrant_after_pause=fig["regrant"],
            demoted_after_resume=fig["demoted_after_resume"],
            overlap=v.overlap_seconds,
            fresh_lock=free_after,
        )
        assert v.stale_accepted == 0 and v.token_regressions == 0 and v.leaked == 0
        if target.expiring:
            assert fig["granted_while_paused"] == 1
            assert v.overlaps == 1 and v.overlap_seconds >= PAUSED_BEYOND_REGRANT
            assert v.rejected >= 1  # the resumed master's in-flight write was refused
        else:
            assert fig["granted_while_paused"] == 0 and v.overlaps == 0
            assert v.rejected == 0
    finally:
        run.close()


@pytest.mark.parametrize("target", sorted(EXPIRING), indirect=True)
def test_paused_master_without_fencing_gets_a_stale_write_in(target: Target, run_dir: Path) -> None:
    """The same pause against a resource that does not check tokens: the resumed master's
    in-flight write lands after the new master's — what fencing prevents."""
    run = _run(target, run_dir, fencing=False)
    try:
        _pause_scenario(target, run)
        leaked, _ = leak_check_after(run, target)
        v = run.verdict(leaked)
        run.report(f"pause-unfenced {target.label}", v, overlap=v.overlap_seconds)
        assert v.rejected == 0 and v.stale_accepted >= 1
        assert v.leaked == 0
    finally:
        run.close()
