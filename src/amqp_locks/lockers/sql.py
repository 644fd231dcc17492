"""What the database lockers share: engines, the lock tables, and the database's clock.

Tables are created on first use (one row per lock name, many locks per table). Time always
comes from the database, in UTC seconds since the epoch, so lockers on hosts with skewed
clocks still agree on when a lease expires.
"""

from __future__ import annotations

import math
import os
import socket
import uuid

from ..errors import ConfigurationError, FeatureUnavailable
from ..extras import missing_driver
from ..transport.errors import censor_text

try:
    from sqlalchemy import (
        BigInteger,
        Column,
        Float,
        MetaData,
        String,
        Table,
        create_engine,
        insert,
        text,
    )
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.exc import IntegrityError
    from sqlalchemy.pool import NullPool
except ImportError as exc:  # the extra is not installed
    raise FeatureUnavailable(
        "the database lockers need SQLAlchemy: pip install 'amqp-locks[postgresql]' "
        "(or [mysql], [sqlite])"
    ) from exc

metadata = MetaData()

#: DatabaseLocker: a row per lock, held by `SELECT ... FOR UPDATE` in a long transaction.
lock_table = Table(
    "amqp_locks_lock",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("holder", String(200), nullable=True),
    Column("version", BigInteger, nullable=False, default=0),
)

#: LeaseDatabaseLocker: a row per lock with its holder and the lease's expiry (epoch s).
lease_table = Table(
    "amqp_locks_lease",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("holder", String(200), nullable=True),
    Column("expires_at", Float(precision=53), nullable=False, default=0.0),
    Column("version", BigInteger, nullable=False, default=0),
)


#: Seconds a connection attempt may take before it fails (libpq would wait for ever on a
#: server that accepts TCP but never answers; PyMySQL's own default is also 10 s).
DEFAULT_CONNECT_TIMEOUT = 10.0


def make_engine(
    url: str,
    *,
    manual_sqlite_transactions: bool = False,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> Engine:
    """An engine without pooling: a locker owns its connections and closes them itself,
    so a stopped locker leaves no connection behind. Connection attempts to a server time
    out after `connect_timeout` seconds (unless the URL sets ``connect_timeout``), and so
    does every round trip on PyMySQL: a standby stuck connecting could neither take over
    nor be stopped."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"database URL must look like dialect://..., got {censor_text(str(url))!r}"
        )
    if not connect_timeout > 0:
        raise ConfigurationError(f"connect_timeout must be > 0 seconds, got {connect_timeout}")
    options: dict[str, object] = {"poolclass": NullPool}
    if not url.startswith("sqlite") and "connect_timeout" not in url:
        # libpq counts whole seconds and treats less than 2 as 2.
        args: dict[str, object] = {"connect_timeout": max(2, math.ceil(connect_timeout))}
        if "pymysql" in url.split("://", 1)[0]:
            # PyMySQL's connect_timeout covers only the TCP connect; the server's greeting
            # (and every later reply) is read with read_timeout, None by default.
            args["read_timeout"] = args["write_timeout"] = connect_timeout
        options["connect_args"] = args
    if url.startswith("sqlite") and manual_sqlite_transactions:
        # We issue BEGIN IMMEDIATE ourselves; the driver must not start transactions, and
        # a locked database must answer at once (the standby retries on its interval).
        options["isolation_level"] = "AUTOCOMMIT"
        options["connect_args"] = {"timeout": 0.0, "check_same_thread": False}
    elif url.startswith("sqlite"):
        options["connect_args"] = {"timeout": 5.0, "check_same_thread": False}
    try:
        return create_engine(url, **options)
    except ImportError as exc:  # the URL's DBAPI driver: another extra, or another driver
        raise missing_driver(url, exc) from None
    except Exception as exc:
        raise ConfigurationError(
            f"cannot use database URL {censor_text(url)!r}: {censor_text(str(exc), url)}"
        ) from None


def ensure_row(engine: Engine, table: Table, name: str) -> None:
    """Create the table and the lock's row if missing (racing creators are fine)."""
    metadata.create_all(engine, tables=[table], checkfirst=True)
    with engine.connect() as conn:
        exists = conn.execute(table.select().where(table.c.name == name)).first()
        if exists is None:
            try:
                with conn.begin() if not conn.in_transaction() else conn.begin_nested():
                    conn.execute(insert(table).values(name=name, holder=None, version=0))
            except IntegrityError:
                pass  # another locker created it first
        if conn.in_transaction():
            conn.commit()


def db_now(conn: Connection) -> float:
    """The database's current time, UTC seconds since the epoch, read now."""
    dialect = conn.dialect.name
    if dialect == "postgresql":
        sql = "SELECT EXTRACT(EPOCH FROM clock_timestamp())"
    elif dialect in ("mysql", "mariadb"):
        sql = "SELECT UNIX_TIMESTAMP(NOW(6))"
    elif dialect == "sqlite":
        sql = "SELECT (julianday('now') - 2440587.5) * 86400.0"
    else:
        raise ConfigurationError(f"no database clock query for dialect {dialect!r}")
    value = conn.execute(text(sql)).scalar_one()
    return float(value)


def process_holder_id() -> str:
    """``HOST:PID:RANDOM``: a holder id unique to this locker object, readable by people."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def is_lock_conflict(exc: BaseException) -> bool:
    """Lock held by someone else: PostgreSQL 55P03, MySQL/MariaDB 1205/3572, SQLite busy."""
    orig = getattr(exc, "orig", exc)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if code == "55P03":
        return True
    args = getattr(orig, "args", ())
    if args and args[0] in (1205, 3572):
        return True
    text = str(orig).lower()
    return "database is locked" in text or ("lock" in text and "nowait" in text)
