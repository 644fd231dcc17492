"""Smoke tests of an installed wheel (scripts/matrix runs them in fresh venvs).

Not a pytest module: it runs with nothing but the wheel (and one extra) installed, from a
directory outside the repository, so it imports what a user's ``pip install`` gave them:

    python smoke.py plain AMQP_URL          # no extras: the API, the asyncio API, the CLI
    python smoke.py sqlite                  # extra `sqlite`: the database lockers on SQLite
    python smoke.py postgresql DB_URL       # extra `postgresql` against a dev PostgreSQL
    python smoke.py mysql DB_URL            # extra `mysql` against a dev MariaDB
    python smoke.py metrics AMQP_URL        # extra `metrics`: Prometheus series of a grant
    python smoke.py tooz AMQP_URL           # extra `tooz`: a lock through tooz's API
    python smoke.py celery AMQP_URL         # extra `celery`: a Singleton task holding its lock
    python smoke.py otel AMQP_URL           # extra `otel`: the instrumentor, no SDK installed

Each check prints one line; any failure raises (a traceback, exit status 1).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

#: Every optional dependency's import name, by the extra that brings it.
OPTIONAL = {
    "sqlite": ["sqlalchemy"],
    "postgresql": ["sqlalchemy", "psycopg"],
    "mysql": ["sqlalchemy", "pymysql"],
    "metrics": ["prometheus_client"],
    "tooz": ["tooz"],
    "celery": ["celery"],
    "otel": ["opentelemetry"],
}


def check(what: str, ok: bool) -> None:
    if not ok:
        raise AssertionError(f"FAILED: {what}")
    print(f"  ok  {what}")


def name() -> str:
    return f"smoke-{uuid.uuid4().hex[:10]}"


def only_extra(extra: str | None) -> None:
    """Exactly the extra's dependencies are installed: the install is what it claims."""
    wanted = set(OPTIONAL.get(extra or "", []))
    present = {m for deps in OPTIONAL.values() for m in deps if importlib.util.find_spec(m)}
    check(f"optional modules installed: {sorted(present) or 'none'}", present == wanted)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("amqp-locks")
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def plain(url: str) -> None:
    import amqp_locks
    from amqp_locks import (
        Broker,
        BrokerClosed,
        Mutex,
        PersistentSemaphore,
        SemaphoreAdmin,
        TokenSemaphore,
        aio,
    )

    only_extra(None)
    check(f"import amqp_locks {amqp_locks.__version__} (Python {sys.version.split()[0]})", True)
    typed = Path(amqp_locks.__file__).with_name("py.typed")
    check("py.typed installed", typed.exists())

    with Broker(url) as broker:
        n = name()
        with Mutex(broker, n, timeout=10) as lease:
            check("Mutex acquire", lease.fencing_token >= 1)
            check("Mutex held elsewhere", Mutex(broker, n).locked())
        SemaphoreAdmin(broker, n).create(2)
        sem = PersistentSemaphore(broker, n)
        a, b = sem.acquire(timeout=10), sem.acquire(timeout=10)
        check("PersistentSemaphore: two slots", a is not None and b is not None)
        check("PersistentSemaphore: full", sem.acquire(blocking=False) is None)
        assert a is not None and b is not None
        a.release()
        b.release(wait=True)
        SemaphoreAdmin(broker, n).destroy()
        tokens = TokenSemaphore(broker, n + "-t")
        tokens.setup(1)
        with tokens.acquire(timeout=10) as permit:
            check("TokenSemaphore acquire", permit is not None)
        tokens.destroy()
    try:
        Mutex(broker, n).acquire(blocking=False)
    except BrokerClosed:
        check("a closed Broker raises BrokerClosed", True)

    async def asyncio_api() -> bool:
        async with aio.Broker(url) as ab, aio.Mutex(ab, name()) as held:
            return held.fencing_token >= 1

    check("asyncio Mutex", asyncio.run(asyncio_api()))

    env = {**os.environ, "AMQP_URL": url}
    r = cli("--help")
    check("amqp-locks --help", r.returncode == 0 and "Usage: amqp-locks" in r.stdout)
    n = name()
    r = cli("run", n, "-w", "10", "--", sys.executable, "-c", "print('ran')", env=env)
    check("amqp-locks run", r.returncode == 0 and "ran" in r.stdout)
    r = cli("semaphore", "create", n, "2", env=env)
    check("amqp-locks semaphore create", r.returncode == 0)
    r = cli("status", n, "--json", env=env)
    check("amqp-locks status", r.returncode == 0 and f'"name": "{n}"' in r.stdout)
    cli("semaphore", "destroy", n, env=env)
    with tempfile.TemporaryDirectory() as d:
        r = cli(
            "elect",
            n,
            "--locker",
            "lease-database",
            "--db-url",
            f"sqlite:///{d}/x.db",
            "--",
            "true",
            env=env,
        )
    check(
        "elect --locker lease-database: exit 2, one line naming the extra, no traceback",
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and "pip install 'amqp-locks[sqlite]'" in r.stderr
        and "Traceback" not in r.stderr,
    )


def database(extra: str, url: str) -> None:
    from amqp_locks import DatabaseLocker, LeaseDatabaseLocker, LockedElsewhere

    only_extra(extra)
    n = name()
    # A lease of its own length: it defaults to the retry interval, and a 0.2 s lease ran
    # out before the second locker asked on a busy machine (rehearsal 125), which then
    # rightly took it.
    lease = LeaseDatabaseLocker(
        url, n, lease_holder_id="smoke-a", lock_acquire_sleep_interval=0.2, lease_duration=60
    )
    lease.start()
    check(f"{extra}: LeaseDatabaseLocker master", lease.keep_alive())
    other = LeaseDatabaseLocker(url, n, lease_holder_id="smoke-b", fail_if_locked=True)
    try:
        other.start()
        check(f"{extra}: a second lease holder is refused", False)
    except LockedElsewhere:
        check(f"{extra}: a second lease holder is refused (LockedElsewhere)", True)
    finally:
        other.close()
    lease.stop()
    lease.close()
    db = DatabaseLocker(url, n)
    db.start()
    check(f"{extra}: DatabaseLocker master", db.keep_alive())
    db.stop()
    db.close()


def metrics(url: str) -> None:
    import prometheus_client

    from amqp_locks import Broker, Mutex
    from amqp_locks import metrics as m

    only_extra("metrics")
    registry = prometheus_client.CollectorRegistry()
    m.enable(registry)
    with Broker(url) as broker, Mutex(broker, name(), timeout=10):
        pass
    text = prometheus_client.generate_latest(registry).decode()
    recorded = "amqp_locks_acquire_seconds_count" in text
    check("metrics: amqp_locks_acquire_seconds recorded", recorded)
    m.disable()


def tooz_driver(url: str) -> None:
    from tooz import coordination

    only_extra("tooz")
    backend = url.replace("amqp://", "rabbit://", 1)
    coordinator = coordination.get_coordinator(backend, b"smoke-member")
    coordinator.start()
    try:
        lock = coordinator.get_lock(name().encode())
        check("tooz: lock acquired", lock.acquire(blocking=5))
        check("tooz: lock released", lock.release())
    finally:
        coordinator.stop()


def celery_tasks(url: str) -> None:
    from celery import Celery

    from amqp_locks.celery import Singleton
    from amqp_locks.celery.config import close_all

    only_extra("celery")
    app = Celery("smoke", broker=url, set_as_current=False)

    @app.task(base=Singleton, bind=True, shared=False)
    def task(self: Singleton, x: int) -> int:
        return self.lock.fencing_token if self.lock is not None else -1

    try:  # called in-process: the lock is taken and released through the broker
        check("celery: a Singleton task ran holding its lock", task(1) > 0)
    finally:
        close_all()


def otel(url: str) -> None:
    from importlib.metadata import entry_points

    from amqp_locks import Broker, Mutex
    from amqp_locks.otel import AmqpLocksInstrumentor

    only_extra("otel")
    found = [e.value for e in entry_points(group="opentelemetry_instrumentor")]
    check("otel: entry point registered", "amqp_locks.otel:AmqpLocksInstrumentor" in found)
    instrumentor = AmqpLocksInstrumentor()
    instrumentor.instrument()  # the API's no-op providers: the SDK is the application's
    try:
        with Broker(url) as broker, Mutex(broker, name(), timeout=10) as lease:
            check("otel: a grant under the no-op providers", lease.fencing_token > 0)
    finally:
        instrumentor.uninstrument()


def main(argv: list[str]) -> None:
    what, *args = argv
    runs: dict[str, Callable[[], None]] = {
        "plain": lambda: plain(args[0]),
        "sqlite": lambda: database("sqlite", f"sqlite:///{tempfile.mkdtemp()}/smoke.db"),
        "postgresql": lambda: database("postgresql", args[0]),
        "mysql": lambda: database("mysql", args[0]),
        "metrics": lambda: metrics(args[0]),
        "tooz": lambda: tooz_driver(args[0]),
        "celery": lambda: celery_tasks(args[0]),
        "otel": lambda: otel(args[0]),
    }
    runs[what]()


if __name__ == "__main__":
    main(sys.argv[1:])
