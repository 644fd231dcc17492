"""Master/standby failover per locker: master ``LockableService`` process kill -9 -> the
standby reports MASTER (and is the next sample's master); every series concurrently, each
on its own lock: a failover is mostly waiting.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amqp_locks_dev import devdb

from .peers.worker import Sync, kill_series, quiet, what
from .stats import brief, delete_queues, own_cpu, system_busy

#: ActiveMQ's defaults: lockAcquireSleepInterval 10 s, lease = interval, keep-alive 0
#: (a lease locker needs one shorter than the lease: 5 s as in ActiveMQ's lease example).
DEFAULT = {"interval": 10.0, "lease": None, "keep_alive": 0.0, "lease_keep_alive": 5.0}
TUNED = {"interval": 0.25, "lease": 1.5, "keep_alive": 0.5, "lease_keep_alive": 0.5}


@dataclass(frozen=True)
class Spec:
    label: str  # e.g. "LeaseDatabaseLocker / PostgreSQL"
    kind: str  # file | db | lease | amqp
    target: str  # directory, database URL or AMQP URL
    name: str
    interval: float
    lease: float | None
    keep_alive: float


def specs(st: dict[str, Any], tag: str, tmp: Path, dbs: dict[str, str], url: str) -> list[Spec]:
    """One spec per locker (and database) with settings ``st`` (DEFAULT or TUNED)."""
    iv, ka = st["interval"], st["keep_alive"]
    name = f"bench-{tag}-{os.getpid()}-{random.randrange(1 << 30):x}"
    out = [Spec("SharedFileLocker", "file", str(tmp / "files" / tag), "lock", iv, None, ka)]
    for db, db_url in {"SQLite": None, **dbs}.items():
        for kind, cls in (("db", "DatabaseLocker"), ("lease", "LeaseDatabaseLocker")):
            # SQLite locks the whole file: one file per locker.
            target = db_url or f"sqlite:///{tmp / f'{tag}-{kind}.db'}"
            lease, keep = (st["lease"], st["lease_keep_alive"]) if kind == "lease" else (None, ka)
            out.append(Spec(f"{cls} / {db}", kind, target, name, iv, lease, keep))
    return [*out, Spec("AmqpLocker", "amqp", url, name, iv, None, ka)]


def locker(spec: Spec, broker: Any) -> Any:
    """The locker ``spec`` describes (``broker``: an AmqpLocker's, connected)."""
    from amqp_locks import AmqpLocker
    from amqp_locks.lockers import DatabaseLocker, LeaseDatabaseLocker, SharedFileLocker

    opts: dict[str, Any] = {"lock_acquire_sleep_interval": spec.interval}
    if spec.kind == "amqp":
        return AmqpLocker(broker, spec.name, **opts)
    if spec.kind == "lease":
        return LeaseDatabaseLocker(spec.target, spec.name, lease_duration=spec.lease, **opts)
    return (SharedFileLocker if spec.kind == "file" else DatabaseLocker)(
        spec.target, spec.name, **opts
    )


def _service(spec: Spec, idx: int, sync: Sync) -> None:
    """A LockableService reporting (state, idx, monotonic time) on every transition."""
    from amqp_locks import Broker, LockableService

    quiet()
    try:
        name = f"amqp-locks bench locker {idx}"
        broker = (
            Broker(spec.target, connection_name=name).connect() if spec.kind == "amqp" else None
        )
        LockableService(
            locker(spec, broker),
            lambda stop: stop.wait(),
            lock_keep_alive_period=spec.keep_alive,
            on_state=lambda _svc, state: sync.out.put((state.value, idx, time.monotonic())),
        ).run()
    except BaseException as exc:
        sync.out.put(("error", idx, what(exc)))


def _series(spec: Spec, samples: int, seed: int) -> dict[str, Any]:
    """``samples`` failovers of one locker, each standby becoming the next master."""
    limit = (spec.lease or 0) + 2 * spec.interval + 2 * spec.keep_alive + 30.0
    settle, steps = (0.1, 0.1 + spec.interval), ("standby", "master")
    s = kill_series(spec, samples, settle, seed, limit, _service, steps)
    s["errors"] += [f"the standby not master within {limit:.0f} s"] * s.pop("censored")
    return s


def measure(
    groups: dict[str, list[Spec]], samples: dict[str, int], log: Callable[[str], None]
) -> dict[str, Any]:
    """Every spec of every group concurrently (one thread each, each on its own lock)."""
    started = time.monotonic()
    calls = [
        (g, sp, 100 * i + j)
        for i, (g, sps) in enumerate(groups.items())
        for j, sp in enumerate(sps)
    ]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda c: _series(c[1], samples[c[0]], c[2]), calls))
    out: dict[str, Any] = {g: {"rows": []} for g in groups}
    for (group, spec, _), s in zip(calls, results, strict=True):
        out[group]["rows"].append({"locker": spec.label, **s})
        log(f"  failover {group} {spec.label}: {brief(s)}")
    return {"groups": out, "wall_s": round(time.monotonic() - started, 1)}


def run(
    url: str, samples: dict[str, int], db_servers: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    """Failover with each group's settings (``samples``: group -> samples) on a shared file,
    SQLite and (``db_servers``) private PostgreSQL and MariaDB servers, started here."""
    tmp = Path(tempfile.mkdtemp(prefix="amqp-locks-bench-"))
    dbs: dict[str, str] = {}
    started: list[tuple[str, Path]] = []
    smoke = "smoke run: no PostgreSQL/MariaDB servers, no default-settings failover"
    notes, groups = ([] if db_servers else [smoke]), {}
    busy0, own0, t0 = system_busy(), own_cpu(), time.monotonic()
    try:
        for kind, label in (("postgresql", "PostgreSQL"), ("mariadb", "MariaDB"))[: 2 * db_servers]:
            base = devdb.db_fixture_base() / kind
            try:
                log(f"starting private {kind} server")
                dbs[label] = devdb.start(kind, name="bench", base_dir=base).url
                started.append((kind, base))
            except Exception as exc:  # no server binaries: say so, measure the rest
                notes.append(f"{label} not measured: {exc}")
                log(f"  {notes[-1]}")
        groups = {g: specs(TUNED if g == "tuned" else DEFAULT, g, tmp, dbs, url) for g in samples}
        log(f"failover per locker ({', '.join(groups)} settings), all concurrently")
        measured = measure(groups, samples, log)
    finally:
        # AmqpLocker's mutex leaves its fence queue (and nothing else) on the broker.
        names = {sp.name for g in groups.values() for sp in g if sp.kind == "amqp"}
        delete_queues(url, [q for n in names for q in (n, f"{n}-fence")])
        for kind, base in started:
            with contextlib.suppress(Exception):
                devdb.stop(kind, name="bench", base_dir=base)
            shutil.rmtree(base.parent, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - t0
    return {
        **measured,
        "settings": {"tuned": TUNED, "default": DEFAULT},
        "databases": sorted(dbs),
        "notes": notes,
        # Cores kept busy meanwhile by everything (this phase's processes included).
        "busy_cores": round((system_busy() - busy0) / wall, 2),
        "own_cores": round((own_cpu() - own0) / wall, 2),
    }
