"""Master/standby failover per locker: master process kill -9 -> the standby is master.

Each sample: a master process and a standby process each run a
:class:`~amqp_locks.service.LockableService` (work: wait for the stop event) and report
their state changes with ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for all
processes). Once the standby reports STANDBY the parent waits 0.1 s plus a random part of
the retry interval (so the kill falls at a random point of the standby's retries and of
the master's lease renewals), notes the time and sends SIGKILL to the master; the sample
is the time until the standby reports MASTER. The standby becomes the next sample's
master. All series (every locker, default and tuned settings) run concurrently, each on
its own lock, since most of a failover is waiting.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .handoff import context
from .stats import ms, summarize_reps

#: ActiveMQ's defaults: lockAcquireSleepInterval 10 s, lease = interval, keep-alive 0
#: (a lease locker needs one shorter than the lease: 5 s as in ActiveMQ's lease example).
DEFAULT = {"interval": 10.0, "lease": None, "keep_alive": 0.0, "lease_keep_alive": 5.0}
TUNED = {"interval": 0.25, "lease": 1.5, "keep_alive": 0.5, "lease_keep_alive": 0.5}


@dataclass(frozen=True)
class Spec:
    label: str  # e.g. "lease / PostgreSQL"
    kind: str  # file | db | lease | amqp
    target: str  # directory, database URL or AMQP URL
    name: str
    interval: float
    lease: float | None
    keep_alive: float


def specs(
    settings: dict[str, Any],
    tag: str,
    file_dir: str,
    sqlite_dir: str,
    dbs: dict[str, str],
    amqp_url: str,
) -> list[Spec]:
    """One spec per locker (and database) for ``settings`` (DEFAULT or TUNED)."""
    iv, ka, lka = settings["interval"], settings["keep_alive"], settings["lease_keep_alive"]
    lease = settings["lease"]
    name = f"bench-{tag}-{os.getpid()}-{random.randrange(1 << 30):x}"
    out = [Spec("SharedFileLocker", "file", os.path.join(file_dir, tag), "lock", iv, None, ka)]
    targets = {"SQLite": None, **dbs}
    for db, url in targets.items():
        db_url = url
        for kind, cls in (("db", "DatabaseLocker"), ("lease", "LeaseDatabaseLocker")):
            if url is None:  # SQLite locks the whole file: one file per locker
                db_url = f"sqlite:///{os.path.join(sqlite_dir, f'{tag}-{kind}.db')}"
            out.append(
                Spec(
                    f"{cls} / {db}",
                    kind,
                    db_url or "",
                    name,
                    iv,
                    lease if kind == "lease" else None,
                    lka if kind == "lease" else ka,
                )
            )
    out.append(Spec("AmqpLocker", "amqp", amqp_url, name, iv, None, ka))
    return out


# --------------------------------------------------------------------------- workers


def _service_main(spec: Spec, idx: int, events: Any) -> None:
    """A LockableService reporting (idx, state, monotonic time) on every transition."""
    logging.getLogger("aiormq.channel").setLevel(logging.ERROR)
    logging.getLogger("amqp_locks").setLevel(logging.ERROR)
    from amqp_locks import Broker
    from amqp_locks.lockers import (
        AmqpLocker,
        DatabaseLocker,
        LeaseDatabaseLocker,
        SharedFileLocker,
    )
    from amqp_locks.service import LockableService

    opts: dict[str, Any] = {"lock_acquire_sleep_interval": spec.interval}
    try:
        if spec.kind == "file":
            locker: Any = SharedFileLocker(spec.target, spec.name, **opts)
        elif spec.kind == "db":
            locker = DatabaseLocker(spec.target, spec.name, **opts)
        elif spec.kind == "lease":
            locker = LeaseDatabaseLocker(spec.target, spec.name, lease_duration=spec.lease, **opts)
        else:
            broker = Broker(spec.target, connection_name=f"amqp-locks bench locker {idx}")
            broker.connect()
            locker = AmqpLocker(broker, spec.name, **opts)

        def on_state(_svc: Any, state: Any) -> None:
            events.put((idx, state.value, time.monotonic()))

        service = LockableService(
            locker,
            lambda stop: stop.wait(),
            lock_keep_alive_period=spec.keep_alive,
            on_state=on_state,
        )
        service.run()
    except BaseException as exc:
        events.put((idx, "error", repr(exc)))


# ---------------------------------------------------------------------------- series


def _series(spec: Spec, samples: int, seed: int, ctx: Any) -> dict[str, Any]:
    """``samples`` failovers of one locker, each standby becoming the next master."""
    rng = random.Random(seed)
    events = ctx.Queue()
    pending: dict[int, list[tuple[str, float]]] = {}
    procs: dict[int, Any] = {}
    out: list[float] = []
    errors: list[str] = []
    limit = (spec.lease or 0) + 2 * spec.interval + 2 * spec.keep_alive + 30.0

    def start(idx: int) -> None:
        p = ctx.Process(target=_service_main, args=(spec, idx, events), daemon=True)
        p.start()
        procs[idx] = p

    def wait_for(idx: int, state: str, timeout: float) -> float:
        end = time.monotonic() + timeout
        while True:
            for st, t in pending.get(idx, []):
                if st == state:
                    return t
                if st == "error":
                    raise RuntimeError(f"{spec.label} worker {idx}: {t}")
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{spec.label}: worker {idx} not {state} within {timeout:.0f} s")
            try:
                i, st, t = events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            pending.setdefault(i, []).append((st, t))

    def became(idx: int, state: str) -> bool:
        with contextlib.suppress(queue.Empty):
            while True:
                i, st, t = events.get_nowait()
                pending.setdefault(i, []).append((st, t))
        return any(st == state for st, _ in pending.get(idx, []))

    try:
        start(0)
        wait_for(0, "master", limit)
        for i in range(1, samples + 1):
            start(i)
            wait_for(i, "standby", 60)
            time.sleep(0.1 + rng.uniform(0, spec.interval))
            if became(i, "master"):
                errors.append(f"sample {i}: standby became master while the master was alive")
                break
            t_kill = time.monotonic()
            os.kill(procs[i - 1].pid, signal.SIGKILL)
            try:
                t_master = wait_for(i, "master", limit)
            except (TimeoutError, RuntimeError) as exc:
                errors.append(f"sample {i}: {exc}")
                break
            out.append(t_master - t_kill)
            procs[i - 1].join(10)
    except (TimeoutError, RuntimeError) as exc:
        errors.append(str(exc))
    finally:
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    s = summarize_reps([out])
    s["samples_ms"] = [ms(x) for x in out]
    s["errors"] = errors
    return s


def measure(
    groups: dict[str, list[Spec]],
    samples: dict[str, int],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every spec of every group concurrently (one thread each, each on its own lock)."""
    ctx = context()
    started = time.monotonic()
    results: dict[tuple[str, str], Any] = {}

    def run(group: str, spec: Spec, seed: int) -> None:
        try:
            results[group, spec.label] = _series(spec, samples[group], seed, ctx)
        except Exception as exc:  # a series must not take the others down
            results[group, spec.label] = {"n": 0, "p50_ms": math.nan, "errors": [repr(exc)]}

    threads = [
        threading.Thread(target=run, args=(group, spec, 100 * g + i), daemon=True)
        for g, (group, group_specs) in enumerate(groups.items())
        for i, spec in enumerate(group_specs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out: dict[str, Any] = {}
    for group, group_specs in groups.items():
        rows = []
        for spec in group_specs:
            s = results[group, spec.label]
            s["spec"] = {k: v for k, v in asdict(spec).items() if k not in ("target", "name")}
            rows.append({"locker": spec.label, **s})
            log(
                f"  failover {group} {spec.label}: p50={s['p50_ms'] / 1000:.2f} s "
                f"max={s.get('max_ms', math.nan) / 1000:.2f} s n={s['n']} "
                f"errors={len(s['errors'])}"
            )
        out[group] = {"rows": rows}
    return {"groups": out, "wall_s": round(time.monotonic() - started, 1)}
