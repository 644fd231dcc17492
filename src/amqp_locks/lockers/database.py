"""Database locker: a long transaction holding `SELECT ... FOR UPDATE` on the lock's row.

As in ActiveMQ's JDBC locker, the master keeps a transaction open for as long as it is
master; a standby's `SELECT ... FOR UPDATE NOWAIT` fails until that transaction ends. The
keep-alive is an UPDATE inside the same transaction; `stop()` rolls it back. If the
master's connection dies, the database ends the transaction — at once for a clean close,
only after its TCP timeout for a half-open socket (the shortcoming that motivated the lease
locker). SQLite has no row locks: there `BEGIN IMMEDIATE` takes the database write lock.

While it holds the lock the master watches its connection's socket: the server has nothing
to say on an idle transaction, so anything readable there (a shutdown notice, an error, the
end of the connection) means the session may be over — a restart, a crash, an administrator
— and the service is alarmed to run its keep-alive at once rather than at the next period,
before the restarted server lets a standby in.

Fencing: the row's `version` rises on every acquisition. A raise inside the long
transaction would be rolled back with it, so acquisition commits the raise and re-locks at
once; if someone else slipped in between, the row no longer names us and we stand by.
"""

from __future__ import annotations

import logging
import select as selectmod
import threading
import time

from sqlalchemy import select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

from .base import Locker
from .sql import (
    DEFAULT_CONNECT_TIMEOUT,
    ensure_row,
    is_lock_conflict,
    lock_table,
    make_engine,
    process_holder_id,
)

log = logging.getLogger("amqp_locks.lockers")


class DatabaseLocker(Locker):
    def __init__(
        self,
        url: str,
        name: str = "default",
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        **options: object,
    ) -> None:
        super().__init__(name, **options)  # type: ignore[arg-type]
        self.url = url
        self._engine = make_engine(
            url, manual_sqlite_transactions=True, connect_timeout=connect_timeout
        )
        self._sqlite = self._engine.dialect.name == "sqlite"
        self._conn: Connection | None = None
        self._id = process_holder_id()
        self._row_ready = False
        self._in_call = False
        self._called = threading.Event()

    @property
    def holder_id(self) -> str:
        return self._id

    # --- transactions (SQLite's by hand) ------------------------------------------------

    def _begin_and_lock(self, conn: Connection) -> bool:
        """Start the transaction and lock the row; False when someone else holds it."""
        try:
            if self._sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
                return True
            conn.begin()
            conn.execute(
                select(lock_table.c.name)
                .where(lock_table.c.name == self.name)
                .with_for_update(nowait=True)
            ).first()
            return True
        except (OperationalError, DBAPIError) as exc:
            if not self._sqlite and conn.in_transaction():
                conn.rollback()
            if is_lock_conflict(exc):
                return False
            raise

    def _commit(self, conn: Connection) -> None:
        if self._sqlite:
            conn.exec_driver_sql("COMMIT")
        else:
            conn.commit()

    def _rollback(self, conn: Connection) -> None:
        if self._sqlite:
            conn.exec_driver_sql("ROLLBACK")
        elif conn.in_transaction():
            conn.rollback()

    # --- the locker -------------------------------------------------------------------------

    def _try_acquire(self) -> bool:
        try:
            if not self._row_ready:
                ensure_row(self._engine, lock_table, self.name)
                self._row_ready = True
            conn = self._engine.connect()
        except SQLAlchemyError as exc:
            if self.fail_if_locked and not is_lock_conflict(exc):
                raise  # nobody stands by to ride it out: not "held elsewhere"
            log.warning("%r: database unavailable while standing by: %s", self, exc)
            return False
        try:
            if not self._begin_and_lock(conn):
                conn.close()
                return False
            row = lock_table.c
            conn.execute(
                update(lock_table)
                .where(row.name == self.name)
                .values(version=row.version + 1, holder=self._id)
            )
            version = conn.execute(select(row.version).where(row.name == self.name)).scalar_one()
            self._commit(conn)  # the raise must survive our eventual rollback
            if not self._begin_and_lock(conn):
                conn.close()
                return False
            current = conn.execute(
                select(row.holder, row.version).where(row.name == self.name)
            ).one()
            if (current.holder, current.version) != (self._id, version):
                self._rollback(conn)
                conn.close()
                return False
        except SQLAlchemyError as exc:
            conn.close()
            if self.fail_if_locked and not is_lock_conflict(exc):
                raise
            log.warning("%r: acquisition failed: %s", self, exc)
            return False
        self._conn = conn
        self.fencing_token = int(version)
        fd = _socket_of(conn)
        if fd is not None:
            threading.Thread(
                target=self._watch, args=(conn, fd), name="amqp-locks-db-watch", daemon=True
            ).start()
        return True

    def _watch(self, conn: Connection, fd: int) -> None:
        """While `conn` holds the lock: alarm when the server says anything on it."""
        while self._conn is conn:
            try:
                ready, _, _ = selectmod.select([fd], [], [], 0.2)
            except (OSError, ValueError):
                return  # closed under us: released
            if not ready or self._conn is not conn:
                continue
            if self._in_call:  # the reply to our own keep-alive: look again shortly
                time.sleep(0.01)
                continue
            self._called.clear()
            log.warning("%r: the server spoke on the idle lock connection: checking now", self)
            self._alarm()
            # What arrived stays readable until a keep-alive reads it: wait for one.
            while self._conn is conn and not self._called.wait(0.2):
                pass

    def _keep_alive(self) -> bool:
        conn = self._conn
        if conn is None:
            return False
        row = lock_table.c
        self._in_call = True
        try:
            result = conn.execute(
                update(lock_table)
                .where(row.name == self.name, row.holder == self._id)
                .values(holder=self._id)
            )
        finally:
            self._in_call = False
            self._called.set()
        return result.rowcount == 1

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self._rollback(conn)
        except SQLAlchemyError as exc:
            log.info("%r: rollback on stop failed (connection already gone?): %s", self, exc)
        finally:
            conn.close()

    def close(self) -> None:
        super().close()
        self._engine.dispose()

    def __repr__(self) -> str:
        return f"DatabaseLocker({self.name!r} on {self._engine.url.render_as_string()!r})"


def _socket_of(conn: Connection) -> int | None:
    """The client socket under a SQLAlchemy connection (psycopg, PyMySQL); None for SQLite
    or a driver we cannot see into."""
    dbapi = conn.connection.dbapi_connection
    fileno = getattr(dbapi, "fileno", None)  # psycopg 3 (and 2)
    try:
        if callable(fileno):
            return int(fileno())
        sock = getattr(dbapi, "_sock", None)  # PyMySQL
        if sock is not None:
            return int(sock.fileno())
    except Exception:
        return None
    return None
