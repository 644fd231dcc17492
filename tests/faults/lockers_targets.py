"""The lockers under test and where they run: files, SQLite, PostgreSQL, MariaDB, RabbitMQ.

A :class:`Target` is one locker on one backend with the tuned (short) periods of the fault
scenarios, the worker config that builds it, and the documented detection time a fresh
locker needs after a crash. Database servers are private ``devdb`` instances named
``lockfaults`` (never a server other tests use); AMQP runs on the shared test node.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from amqp_locks_dev import devbroker, devdb

from ..faultproxy import FaultProxy

#: Standby polling, keep-alive period, lease and AMQP heartbeat of the fast scenarios.
INTERVAL = 0.1
PERIOD = 0.25
#: A master demotes when no renewal has answered for `LEASE - lease_margin` (here 3 - 1.375
#: = 1.625 s): that must outlast a database round trip on a loaded 2-core machine. At 1.5 s
#: (0.875 s) a keep-alive stalled by scheduling alone demoted masters before any fault.
LEASE = 3.0
HEARTBEAT = 1.0
#: A database master's keep-alive on a server (PostgreSQL, MariaDB; not SQLite's local
#: file) may go unanswered this long before it counts as failed (the default is one
#: PERIOD, 0.25 s). Rehearsal 43 (two CPU burners beside the suite)
#: saw a PostgreSQL master demote itself before any fault and be granted again: its
#: keep-alive UPDATE took longer than 0.25 s. Three periods still end a partitioned
#: master's lock well before the database ends its session (SESSION_ENDS_AFTER, 1.5 s).
DB_KEEP_ALIVE_TIMEOUT = 0.75
CONNECT_TIMEOUT = 2.0
#: Slack for process scheduling on a loaded 2-core machine (bounds, not measurements).
SLACK = 2.0

DB_NAME = "lockfaults"

LOCAL = ["file", "database-sqlite", "lease-sqlite", "amqp"]
SERVERS = [
    "database-postgresql",
    "lease-postgresql",
    "database-mariadb",
    "lease-mariadb",
]
ALL = LOCAL + SERVERS
#: Where a TCP partition can be made (a FaultProxy between worker and server).
NETWORKED = ["amqp", *SERVERS]
#: Lockers that re-grant under a paused or partitioned holder (expiring lease, heartbeats).
EXPIRING = {"lease-sqlite", "lease-postgresql", "lease-mariadb", "amqp"}


@dataclass
class Target:
    label: str
    kind: str  # file | database | lease | amqp
    backend: str  # fs | sqlite | postgresql | mariadb | rabbitmq
    cfg: dict[str, Any]
    #: After the holder's crash, a standby or fresh locker has the lock within this.
    detection: float
    db: devdb.DbInfo | None = None
    node: devbroker.NodeInfo | None = None
    proxies: list[FaultProxy] = field(default_factory=list)

    @property
    def expiring(self) -> bool:
        return self.label in EXPIRING

    def proxied_cfg(self) -> tuple[dict[str, Any], FaultProxy]:
        """A worker config whose connections go through a new FaultProxy."""
        if self.kind == "amqp":
            assert self.node is not None
            url = URL(self.node.url)
            proxy = FaultProxy(url.host or "127.0.0.1", url.port or 5672)
            cfg = {**self.cfg, "amqp_url": str(url.with_port(proxy.port))}
        else:
            assert self.db is not None
            proxy = FaultProxy("127.0.0.1", self.db.port)
            cfg = {**self.cfg, "url": dataclasses.replace(self.db, port=proxy.port).url}
        self.proxies.append(proxy)
        return cfg, proxy

    def close(self) -> None:
        for p in self.proxies:
            p.close()


def detection_time(kind: str, cfg: dict[str, Any]) -> float:
    """The documented bound for a crashed holder's lock to reach a waiting locker."""
    interval = cfg["interval"]
    if kind == "file":  # flock ends with the process; the new master settles one period
        return interval + cfg["period"] + SLACK
    if kind == "database":  # the server ends the transaction when the socket closes
        return interval + SLACK
    if kind == "lease":  # the lease must run out
        return cfg["lease"] + interval + SLACK
    return SLACK  # amqp: the broker deletes the exclusive queue when the connection closes


@pytest.fixture(scope="session")
def lockfaults_dbs() -> Iterator[dict[str, devdb.DbInfo]]:
    """Private PostgreSQL and MariaDB servers of these scenarios, started on first use."""
    base = devdb.db_fixture_base("amqp-locks-lockfaults-")
    started: dict[str, devdb.DbInfo] = {}

    class Servers(dict[str, devdb.DbInfo]):
        def __missing__(self, kind: str) -> devdb.DbInfo:
            info = devdb.start(kind, name=DB_NAME, base_dir=base / kind)
            started[kind] = info
            self[kind] = info
            return info

    try:
        yield Servers()
    finally:
        for kind in started:
            devdb.stop(kind, name=DB_NAME, base_dir=base / kind)
        shutil.rmtree(base, ignore_errors=True)


def build_target(
    label: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    *,
    interval: float = INTERVAL,
    period: float = PERIOD,
    lease: float = LEASE,
    heartbeat: float = HEARTBEAT,
) -> Target:
    kind, _, backend = label.partition("-")
    name = f"lf{uuid.uuid4().hex[:10]}"
    cfg: dict[str, Any] = {
        "kind": kind,
        "name": name,
        "interval": interval,
        "period": period,
        "lease": lease,
    }
    db = node = None
    if kind == "file":
        backend = "fs"
        cfg["dir"] = str(tmp_path / "lockdir")
    elif kind == "amqp":
        backend = "rabbitmq"
        node = request.getfixturevalue("node")
        cfg["amqp_url"] = node.url
        cfg["heartbeat"] = heartbeat
    elif backend == "sqlite":
        cfg["url"] = f"sqlite:///{tmp_path / 'locks.db'}"
    else:
        db = request.getfixturevalue("lockfaults_dbs")[backend]
        cfg["url"] = db.url
        cfg["connect_timeout"] = CONNECT_TIMEOUT
        if kind == "database":
            cfg["keep_alive_timeout"] = DB_KEEP_ALIVE_TIMEOUT
    return Target(label, kind, backend, cfg, detection_time(kind, cfg), db, node)


def upstream_ports(proxy: FaultProxy) -> list[int]:
    """The local ports of the proxy's connections to the server: how the server sees the
    proxied clients (PostgreSQL's client_port, MariaDB's PROCESSLIST host)."""
    return proxy.upstream_ports()


def end_sessions_from(db: devdb.DbInfo, ports: list[int]) -> int:
    """The database ends the sessions of clients on `ports` (as its idle-in-transaction
    timeout, TCP keepalive or an administrator would); returns how many it ended."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db.url)
    ended = 0
    try:
        with engine.connect() as conn:
            if db.kind == "postgresql":
                rows = conn.execute(
                    text("SELECT pid, client_port FROM pg_stat_activity WHERE usename = :u"),
                    {"u": db.user},
                ).all()
                for pid, port in rows:
                    if port in ports:
                        conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                        ended += 1
            else:
                rows = conn.execute(
                    text("SELECT ID, HOST FROM information_schema.PROCESSLIST WHERE USER = :u"),
                    {"u": db.user},
                ).all()
                for pid, host in rows:
                    port = int(str(host).rpartition(":")[2] or 0)
                    if port in ports:
                        conn.execute(text(f"KILL CONNECTION {int(pid)}"))
                        ended += 1
            conn.commit()
    finally:
        engine.dispose()
    return ended


def db_sessions(db: devdb.DbInfo) -> list[tuple[Any, ...]]:
    """The test user's sessions as the server sees them (for a failing run's message)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db.url)
    try:
        with engine.connect() as conn:
            if db.kind == "postgresql":
                sql = (
                    "SELECT pid, client_port, state, backend_xid IS NOT NULL, "
                    "now() - state_change, left(query, 60) FROM pg_stat_activity "
                    "WHERE usename = :u AND pid <> pg_backend_pid()"
                )
            else:
                sql = (
                    "SELECT ID, HOST, COMMAND, STATE, TIME, LEFT(INFO, 60) "
                    "FROM information_schema.PROCESSLIST WHERE USER = :u "
                    "AND ID <> CONNECTION_ID()"
                )
            return [tuple(r) for r in conn.execute(text(sql), {"u": db.user}).all()]
    finally:
        engine.dispose()


def params(cases: list[Any], fast: set[Any]) -> list[Any]:
    """`cases` for a parametrize; those not in `fast` are marked slow (the soak command
    runs them, CI's ``-m "not slow"`` does not)."""
    out = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        ident = "-".join(str(v) for v in values)
        marks = () if case in fast else (pytest.mark.slow,)
        out.append(pytest.param(*values, marks=marks, id=ident))
    return out


@pytest.fixture(scope="session")
def lockfaults_node() -> Iterator[devbroker.NodeInfo]:
    """A private RabbitMQ node these scenarios may restart (the shared test node is not
    ours to restart); ~7 s to start, so only slow scenarios use it."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="amqp-locks-lockfaults-node-"))
    # A fresh directory, so a fresh node name too: Erlang node names are machine-wide.
    name = f"{DB_NAME}-{base.name.rsplit('-', 1)[-1]}"
    info = devbroker.start(name=name, base_dir=base)
    yield info
    devbroker.stop(name=name, base_dir=base)
    shutil.rmtree(base, ignore_errors=True)
