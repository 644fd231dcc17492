"""Issue 7's fault scenarios for every locker: master/standby worker processes write to a
fencing resource while master; the checker counts (a) overlaps, (b) stale writes accepted,
(c) leaks.

Lockers: SharedFileLocker (local dir), DatabaseLocker and LeaseDatabaseLocker on SQLite,
PostgreSQL and MariaDB (private ``devdb`` servers named ``lockfaults``), AmqpLocker on the
shared test node. Periods are tuned short (interval 0.1 s, keep-alive 0.25 s, lease 3 s,
heartbeat 1 s); `pytest -s` prints one measured line per scenario.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks_dev import devbroker, devdb

from .lockers_harness import Run, Worker, leak_check
from .lockers_targets import (  # noqa: F401 - lockfaults_dbs is a fixture
    ALL,
    DB_NAME,
    EXPIRING,
    LOCAL,
    NETWORKED,
    SERVERS,
    Target,
    build_target,
    end_sessions_from,
    lockfaults_dbs,
    lockfaults_node,
    params,
    upstream_ports,
)

pytestmark = pytest.mark.timeout(120)

#: The fast subset (CI): every scenario on the quickest backends, PostgreSQL for the
#: network and restart faults, MariaDB once; the rest are marked slow (the soak command).
FAST_KILL = {*LOCAL, "database-postgresql", "lease-postgresql"}
FAST_PARTITION = {
    ("amqp", "short"),
    ("amqp", "long"),
    ("lease-postgresql", "short"),
    ("lease-postgresql", "long"),
    ("database-postgresql", "long"),
}
FAST_RESTART = {
    ("database-postgresql", "restart"),
    ("lease-postgresql", "restart"),
    ("database-mariadb", "restart"),
}


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


def _master_and_standby(run: Run, **master_cfg: Any) -> tuple[Worker, Worker]:
    """Worker a (with ``master_cfg``) up as master, then worker b tried and waiting."""
    master = run.spawn("a", **master_cfg)
    master.wait_for("MASTER", 30)
    standby = run.spawn("b")
    standby.wait_for("WAITING", 30)
    return master, standby


@pytest.mark.parametrize("target", params(ALL, FAST_KILL), indirect=True)
def test_master_killed_standby_takes_over(target: Target, run_dir: Path) -> None:
    run = _run(target, run_dir)
    try:
        first, b = _master_and_standby(run)  # the standby tried and is waiting before the crash
        assert not b.is_master()
        killed_at = first.kill()
        b.wait_for("MASTER", target.detection + 10)
        took = run.grants()[-1].t - killed_at
        leaked, free_after = leak_check_after(run, target)
        v = run.verdict(leaked)
        run.report(f"kill {target.label}", v, takeover=took, fresh_lock=free_after)
        # The history, timed from the kill, says whose grant was when and why.
        history = [(round(e.t - killed_at, 3), e.kind, e.grant, e.detail) for e in run.events()]
        assert v.overlaps == 0 and v.key_overlaps == 0, history
        # The kill's takeover is exactly one grant, the standby's. Before the kill only a
        # holds it, though maybe more than once: a lease master starved of CPU past its
        # lease margin demotes itself and may win the lock back before b's next try
        # (rehearsals 18 and 101, lease-postgresql on a machine far busier than the suite:
        # a-1 granted, lost 2.8 s later, a-2 granted 0.4 s after that) — safe, the point
        # of the margin, and not this scenario.
        before = [e.grant for e in run.grants() if e.t < killed_at]
        after = [e.grant for e in run.grants() if e.t >= killed_at]
        assert before and all(g.startswith("a-") for g in before), history
        assert len(after) == 1 and after[0].startswith("b-"), history
        assert v.grants == len(before) + 1
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


#: When the database ends a partitioned master's session (its detection time).
SESSION_ENDS_AFTER = 1.5

#: How long a paused master stays paused after its lock was re-granted (the scenario).
PAUSED_BEYOND_REGRANT = 0.3


def _pause_scenario(target: Target, run: Run) -> dict[str, float | None]:
    """Pause the master mid-unit past its lease/heartbeats, resume it; the figures measured."""
    master, standby = _master_and_standby(run)
    if target.backend == "sqlite":
        # SQLite has one write lock for the whole file: a master frozen inside its
        # renewal's UPDATE (and fsync) holds it for the whole freeze, and no standby can
        # write until it resumes (docs/lockers.md). The scenario is a master paused while
        # idle, so the pause follows a renewal that just ended.
        renewed = sum(1 for _, words in master.lines if words[:1] == ["RENEWED"])
        master.wait_for("RENEWED", 30, nth=renewed + 1)
    paused_at = master.pause_mid_unit()
    regrant: float | None = None
    if target.expiring:
        standby.wait_for("MASTER", target.detection + 10)
        regrant = run.grants()[-1].t - paused_at
        time.sleep(PAUSED_BEYOND_REGRANT)  # the scenario: still paused after the re-grant
    else:
        # The paused master's OS lock / open transaction stays: nobody may take over,
        # though a free lock would have been taken three times over by now.
        time.sleep(3 * (target.cfg["interval"] + target.cfg["period"]))  # the pause
    # counted from the pause: a master that demoted itself and won the lock back before
    # it (a CPU-starved lease renewal) is not a grant while paused
    granted_while_paused = sum(1 for g in run.grants() if g.t >= paused_at)
    resumed_at = master.resume()
    noticed: float | None = None
    if target.expiring:
        master.wait_for("DEMOTED", 30)
        noticed = run.losses()[0] - resumed_at
    return {
        "regrant": regrant,
        "demoted_after_resume": noticed,
        "granted_while_paused": granted_while_paused,
    }


@pytest.mark.parametrize("target", params(ALL, set(LOCAL)), indirect=True)
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


@pytest.mark.parametrize("target", params(sorted(EXPIRING), {"lease-sqlite"}), indirect=True)
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


def _partition_lengths(target: Target) -> dict[str, float]:
    """Short: inside what the holder tolerates — the client's heartbeat loss timeout (amqp),
    the lease minus the keep-alive period and the margin (lease: 3 - 0.25 - 1.375 s), the
    keep-alive timeout (database: one period, 0.25 s). Long: past the point where the
    broker or the lease lets a standby in."""
    if target.kind == "amqp":
        hb = target.cfg["heartbeat"]
        return {"short": 0.5 * hb, "long": 4.0 * hb}
    if target.kind == "lease":
        return {"short": 0.5, "long": 2.0 * target.cfg["lease"]}
    return {"short": 0.15, "long": 3.0}


@pytest.mark.parametrize(
    ("target", "length"),
    params([(t, n) for t in NETWORKED for n in ("short", "long")], FAST_PARTITION),
    indirect=["target"],
)
def test_partition_between_master_and_server(target: Target, run_dir: Path, length: str) -> None:
    """The master reaches the broker/database through a FaultProxy that goes silent (a
    blackhole: sockets open, no bytes); the standby connects directly."""
    seconds = _partition_lengths(target)[length]
    cfg, proxy = target.proxied_cfg()
    run = _run(target, run_dir)
    try:
        master, _standby = _master_and_standby(run, **cfg)
        # What the partition did is judged from the cut: rehearsal 76 (3.10.8 lane, two CPU
        # burners beside four lanes) saw lease-postgresql's master demote itself 0.75 s
        # *before* the cut (its keep-alives went unanswered for 1.4 s) and win the lease
        # back before it; that demotion was the load's, not the partition's.
        demoted_before = master.count("DEMOTED")
        proxy.blackhole()
        cut = time.monotonic()
        time.sleep(seconds)  # the scenario: a partition this long
        proxy.heal()
        healed = time.monotonic()
        granted_during = [g for g in run.grants() if cut < g.t < healed]
        demoted_during = master.count("DEMOTED") - demoted_before
        if length == "long" and (target.expiring or target.kind == "database"):
            master.wait_for("DEMOTED", 30, nth=demoted_before + 1)
        if granted_during or length == "long":
            run.master(30)  # someone is master again after the partition
        leaked, free_after = leak_check_after(run, target)
        v = run.verdict(leaked)
        lost = [t for t in run.losses() if t > cut]
        run.report(
            f"partition-{length} {target.label} ({seconds}s)",
            v,
            detection=(lost[0] - cut) if lost else None,
            regrant=(granted_during[0].t - cut) if granted_during else None,
            fresh_lock=free_after,
        )
        assert v.overlaps == 0 and v.stale_accepted == 0 and v.token_regressions == 0
        assert v.leaked == 0
        if length == "short":  # ridden out: nobody noticed
            assert not granted_during and demoted_during == 0
        elif target.expiring:  # re-granted during the partition, after the master demoted
            assert granted_during and v.min_margin is not None and v.min_margin > 0
        else:  # the database keeps the silent session's row lock; the master demoted anyway
            assert not granted_during and master.count("DEMOTED") > demoted_before
    finally:
        run.close()


@pytest.mark.parametrize(
    "target",
    params(["database-postgresql", "database-mariadb"], {"database-postgresql"}),
    indirect=True,
)
def test_partition_then_the_database_ends_the_masters_session(
    target: Target, run_dir: Path
) -> None:
    """ActiveMQ's weakness of the DatabaseLocker: the master is cut off from the database,
    and the database ends its session (idle-in-transaction timeout, TCP keepalive, an
    administrator) while the master still waits on its keep-alive. The row lock is free:
    the standby takes it. The master must have demoted itself first."""
    assert target.db is not None
    cfg, proxy = target.proxied_cfg()
    run = _run(target, run_dir)
    try:
        _master, standby = _master_and_standby(run, **cfg)
        ports = upstream_ports(proxy)
        proxy.blackhole()
        cut = time.monotonic()
        time.sleep(SESSION_ENDS_AFTER)  # the scenario: the database's detection time
        assert end_sessions_from(target.db, ports) >= 1
        ended = time.monotonic()
        standby.wait_for("MASTER", 30)
        granted = run.grants()[-1].t
        time.sleep(0.5)  # the scenario: the partition outlasts the re-grant
        proxy.heal()
        leaked, free_after = leak_check_after(run, target)
        v = run.verdict(leaked)
        lost = run.losses()
        run.report(
            f"partition+session-ended {target.label}",
            v,
            detection=(lost[0] - cut) if lost else None,
            session_ended=ended - cut,
            regrant=granted - cut,
            fresh_lock=free_after,
        )
        assert v.overlaps == 0 and v.stale_accepted == 0 and v.token_regressions == 0
        assert v.min_margin is not None and v.min_margin > 0
        assert v.leaked == 0
    finally:
        run.close()


@pytest.mark.parametrize(
    ("target", "how"),
    params([(t, h) for t in SERVERS for h in ("restart", "kill")], FAST_RESTART),
    indirect=["target"],
)
def test_database_restart_under_a_master(target: Target, run_dir: Path, how: str) -> None:
    """The database restarts (or crashes and comes back) under a master and a standby: at
    most one master throughout; someone is master again afterwards; nothing leaked. The
    DatabaseLocker's transaction dies with the server (its master demotes); the lease row
    survives, so a lease master rides out a restart shorter than its lease."""
    db = target.db
    assert db is not None
    run = _run(target, run_dir)
    try:
        master, _standby = _master_and_standby(run)
        down = time.monotonic()
        if how == "restart":
            devdb.restart(db.kind, name=DB_NAME, base_dir=db.base_dir)
        else:
            devdb.kill(db.kind, name=DB_NAME, base_dir=db.base_dir)
            devdb.start(db.kind, name=DB_NAME, base_dir=db.base_dir)
        up = time.monotonic()
        if target.kind == "database":
            master.wait_for("DEMOTED", 30)  # its transaction, and so its lock, are gone
        run.master(target.detection + 10)  # someone is master again afterwards
        demoted = master.count("DEMOTED")
        regrants = [g.t - down for g in run.grants() if g.t > down]
        leaked, free_after = leak_check_after(run, target)
        v = run.verdict(leaked)
        lost = [t - down for t in run.losses()]
        run.report(
            f"db-{how} {target.label}",
            v,
            restart_took=up - down,
            demoted=lost[0] if lost else None,
            master_again=regrants[0] if regrants else None,
            fresh_lock=free_after,
        )
        assert v.overlaps == 0 and v.stale_accepted == 0 and v.token_regressions == 0
        assert v.leaked == 0
        if target.kind == "database":
            assert demoted >= 1
    finally:
        run.close()


@pytest.mark.parametrize("target", ["file"], indirect=True)
def test_lock_file_deleted_under_the_master(target: Target, run_dir: Path) -> None:
    """ActiveMQ's AMQ-4705: a third party deletes the lock file. A standby can lock a new
    file at once; the master's keep-alive sees the file gone and demotes, and a new master
    waits one keep-alive period before working so the old one gets there first. Whoever
    becomes master next (the old master may win the new file), its fencing token must be
    above every earlier one: the counter cannot live only in the deleted file."""
    run = _run(target, run_dir)
    try:
        master, _standby = _master_and_standby(run)
        deleted = time.monotonic()
        os.unlink(Path(target.cfg["dir"]) / "lock")
        master.wait_for("DEMOTED", 10)
        run.master(10)  # a master again, on the new file
        leaked, free_after = leak_check_after(run, target)
        v = run.verdict(leaked)
        lost = [t - deleted for t in run.losses()]
        run.report(
            "lock-file-deleted file",
            v,
            demoted=lost[0] if lost else None,
            fresh_lock=free_after,
        )
        assert v.overlaps == 0 and v.min_margin is not None and v.min_margin > 0
        assert v.token_regressions == 0 and v.stale_accepted == 0
        assert v.leaked == 0
    finally:
        run.close()


@pytest.mark.slow
def test_broker_restart_under_an_amqp_master(
    request: pytest.FixtureRequest, tmp_path: Path, run_dir: Path
) -> None:
    """The broker node restarts under an AmqpLocker master and its standby (a private
    node: the shared test node is not ours to restart). The master's connection closes:
    it demotes at once (the lease is marked lost and alarms the service); after the
    restart someone is master again with a higher token (the fence is a quorum queue)."""
    node: devbroker.NodeInfo = request.getfixturevalue("lockfaults_node")
    target = build_target("amqp", tmp_path, request)
    cfg = {**target.cfg, "amqp_url": node.url}
    run = Run(run_dir, cfg)
    try:
        master, _standby = _master_and_standby(run)
        down = time.monotonic()
        devbroker.restart(name=node.name, base_dir=node.base_dir, version=node.version)
        up = time.monotonic()
        master.wait_for("DEMOTED", 30)
        again = run.master(30)
        regrant = run.grants()[-1].t - down
        lost = [t - down for t in run.losses()]
        for w in run.workers:
            w.stop()
        leaked, free_after = leak_check(cfg, target.detection + 10)
        v = run.verdict(leaked)
        run.report(
            "broker-restart amqp",
            v,
            restart_took=up - down,
            demoted=lost[0] if lost else None,
            master_again=regrant,
            fresh_lock=free_after,
        )
        assert again is not None and v.grants >= 2
        assert v.overlaps == 0 and v.stale_accepted == 0 and v.token_regressions == 0
        assert lost and lost[0] < up - down  # demoted while the broker was still down
        assert v.leaked == 0
    finally:
        run.close()
