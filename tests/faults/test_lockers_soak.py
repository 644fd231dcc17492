"""Random faults against every locker for a bounded time: seeded, reproducible, self-ending.

Three master/standby workers per locker write to a fencing resource while a seeded random
schedule kills (and respawns) them, pauses and resumes them (SIGSTOP/SIGCONT, sometimes
past the lease or the heartbeat timeout), partitions one of them from its server (each
worker of a networked locker talks through its own FaultProxy) and restarts or crashes the
database. Afterwards: (b) no stale write accepted and no token regression; (c) a fresh
locker gets the lock within the detection time; (a) every overlap of two masters involves
a worker that was paused around the re-grant — the one case no design can prevent, and
fencing covers it.

    AMQP_LOCKS_FAULT_SEED=1234 AMQP_LOCKS_SOAK_SECONDS=60 \\
        .venv/bin/pytest -m slow tests/faults/test_lockers_soak.py -s

The seed (random unless set) and every fault are printed, so a failing run can be replayed.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks_dev import devdb

from ..faultproxy import FaultProxy
from .history import load
from .lockers_harness import Run, Worker, leak_check, unexplained_overlaps
from .lockers_targets import (  # noqa: F401 - lockfaults_dbs is a fixture
    ALL,
    DB_NAME,
    Target,
    build_target,
    db_sessions,
    lockfaults_dbs,
)

SEED = int(os.environ.get("AMQP_LOCKS_FAULT_SEED") or random.SystemRandom().randrange(10**6))
SECONDS = float(os.environ.get("AMQP_LOCKS_SOAK_SECONDS", "40"))
WORKERS = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SECONDS) + 300)]


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    t = build_target(request.param, tmp_path, request)
    yield t
    t.close()


class Soak:
    def __init__(self, target: Target, run: Run, rng: random.Random) -> None:
        self.target = target
        self.run = run
        self.rng = rng
        self.proxies: dict[str, FaultProxy] = {}
        self.live: list[Worker] = []
        self.spawned = 0
        self.log: list[str] = []
        self.t0 = time.monotonic()

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self.t0:7.2f}s {what}"
        self.log.append(line)
        print(f"  [{self.target.label} seed={SEED}] {line}", flush=True)

    def spawn(self) -> Worker:
        self.spawned += 1
        who = f"w{self.spawned}"
        overrides: dict[str, Any] = {}
        if self.target.kind == "amqp" or self.target.db is not None:
            cfg, proxy = self.target.proxied_cfg()
            self.proxies[who] = proxy
            overrides = cfg
        w = self.run.spawn(who, **overrides)
        self.live.append(w)
        return w

    def pick(self) -> Worker:
        return self.rng.choice(self.live)

    def pick_for(self, fault: str, lease: float) -> tuple[Worker, float]:
        """A worker for `fault` and how long it lasts (up to two leases), noted."""
        w = self.pick()
        seconds = self.rng.uniform(0.05, 2.0 * lease)
        was = "master" if w.is_master() else "standby"
        self.note(f"{fault} {w.who} ({was}) for {seconds:.2f}s")
        return w, seconds

    def step(self) -> None:
        t = self.target
        lease = t.cfg["lease"] if t.kind == "lease" else 3.0 * t.cfg.get("heartbeat", 1.0)
        actions = ["kill", "pause", "pause", "idle"]
        if self.proxies:
            actions += ["partition", "partition"]
        if t.db is not None:
            actions += ["db-restart", "db-kill"]
        action = self.rng.choice(actions)
        if action == "kill":
            w = self.pick()
            was = "master" if w.is_master() else "standby"
            w.kill()
            self.live.remove(w)
            self.note(f"kill {w.who} ({was}); spawn {self.spawn().who}")
        elif action == "pause":
            w, seconds = self.pick_for(action, lease)
            w.pause()
            time.sleep(seconds)  # the fault: a pause this long
            w.resume()
        elif action == "partition":
            w, seconds = self.pick_for(action, lease)
            proxy = self.proxies[w.who]
            proxy.blackhole()
            time.sleep(seconds)  # the fault: a partition this long
            proxy.heal()
        elif action in ("db-restart", "db-kill"):
            db = t.db
            assert db is not None
            self.note(action)
            if action == "db-restart":
                devdb.restart(db.kind, name=DB_NAME, base_dir=db.base_dir)
            else:
                devdb.kill(db.kind, name=DB_NAME, base_dir=db.base_dir)
                devdb.start(db.kind, name=DB_NAME, base_dir=db.base_dir)
        time.sleep(self.rng.uniform(0.1, 1.0))  # the schedule: time between faults


@pytest.mark.parametrize("target", ALL, indirect=True)
def test_random_faults(target: Target, tmp_path: Path) -> None:
    rng = random.Random(f"{SEED}:{target.label}")
    print(f"\n[{target.label}] AMQP_LOCKS_FAULT_SEED={SEED} for {SECONDS:.0f}s", flush=True)
    run = Run(tmp_path / "run", target.cfg)
    soak = Soak(target, run, rng)
    try:
        for _ in range(WORKERS):
            soak.spawn()
        run.master(60)
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            soak.step()
        for proxy in soak.proxies.values():
            proxy.heal()
        try:
            run.master(target.detection + 30)  # the service recovers: a master again
        except AssertionError:
            if target.db is not None:
                print("sessions:", *db_sessions(target.db), sep="\n  ")
            raise
        for w in run.workers:
            w.stop()
        leaked, free_after = leak_check(target.cfg, target.detection)
        v = run.verdict(leaked)
        bad = unexplained_overlaps(load(run.history), run.workers)
        run.report(
            f"soak {target.label} seed={SEED} {SECONDS:.0f}s faults={len(soak.log)}",
            v,
            fresh_lock=free_after,
        )
        assert v.stale_accepted == 0 and v.token_regressions == 0, soak.log
        assert v.leaked == 0
        assert not bad, (bad, soak.log)
        assert v.grants >= 1 and len(run.resource.log) > 0  # the run did work
    finally:
        run.close()
