"""Lease database locker: a lease row with an expiry, renewed by its holder.

No long transaction: the master takes the lease with a conditional UPDATE (only when it is
free or expired), renews it by keep-alive before it runs out, and clears it on stop. A
standby retries every `lock_acquire_sleep_interval` and wins once the lease has expired,
so a master that froze or lost the database is replaced after at most one lease.

Time comes from the database (UTC epoch seconds) on every operation: master and standby
compare expiries against one clock whatever their own clocks say. The master's *local*
judgement of whether its lease still holds (used to ride out a database blip) needs its
own clock: with `max_allowable_diff_from_db_time` > 0, a local clock that differs from the
database's by more than that is corrected by the difference (ActiveMQ's rule); with 0 it
is trusted as is.

The lease must outlive the keep-alive period, or the master would lose it between two
renewals: a keep-alive period not shorter than the lease is refused. `version` rises on
every obtain: the fencing token. Every statement runs in autocommit, so no row lock spans a
round trip: a master cut off mid-renewal cannot keep the row locked against the standby.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from sqlalchemy import case, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..errors import ConfigurationError
from .base import Locker
from .sql import (
    DEFAULT_CONNECT_TIMEOUT,
    db_now,
    ensure_row,
    is_lock_conflict,
    lease_table,
    make_engine,
    process_holder_id,
)

log = logging.getLogger("amqp_locks.lockers")


class LeaseDatabaseLocker(Locker):
    def __init__(
        self,
        url: str,
        name: str = "default",
        *,
        lease_holder_id: str | None = None,
        max_allowable_diff_from_db_time: float = 0.0,
        lease_duration: float | None = None,
        clock: Callable[[], float] = time.time,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        **options: object,
    ) -> None:
        super().__init__(name, **options)  # type: ignore[arg-type]
        if max_allowable_diff_from_db_time < 0:
            raise ConfigurationError(
                "max_allowable_diff_from_db_time must be >= 0, "
                f"got {max_allowable_diff_from_db_time}"
            )
        # ActiveMQ extends the lease by lockAcquireSleepInterval on every renewal.
        self.lease_duration = float(lease_duration or self.lock_acquire_sleep_interval)
        if self.lease_duration <= 0:
            raise ConfigurationError(f"lease_duration must be > 0, got {lease_duration}")
        self.max_allowable_diff_from_db_time = float(max_allowable_diff_from_db_time)
        self.url = url
        self._id = lease_holder_id or process_holder_id()
        if len(self._id) > 200:
            raise ConfigurationError("lease_holder_id must be at most 200 characters")
        self._clock = clock
        self._engine = make_engine(url, connect_timeout=connect_timeout)
        self._row_ready = False
        self.expires_at = 0.0  # database time
        self._db_minus_local = 0.0
        # The lease's end on this process's monotonic clock, counted from *before* the
        # statement that set it (so never later than the database's end, whatever the wall
        # clocks say): what the service's hard deadline uses.
        self._valid_until_mono = 0.0

    @property
    def holder_id(self) -> str:
        return self._id

    def check_keep_alive_period(self, period: float) -> None:
        if period <= 0 or period >= self.lease_duration:
            raise ConfigurationError(
                f"{self!r}: the keep-alive period ({period}s) must be > 0 and shorter than the "
                f"lease ({self.lease_duration}s), or the lease expires between renewals"
            )

    def _observe(self, now_db: float) -> None:
        self._db_minus_local = now_db - self._clock()

    def clock_offset(self) -> float:
        """The correction applied to the local clock (database minus local time), per
        `max_allowable_diff_from_db_time`: 0 when disabled or within the allowance."""
        diff = self._db_minus_local
        limit = self.max_allowable_diff_from_db_time
        return diff if limit > 0 and abs(diff) > limit else 0.0

    def lease_valid_locally(self) -> bool:
        """Does the lease still hold, judged by the local clock (no database needed)?"""
        return self._held and self._clock() + self.clock_offset() < self.expires_at

    def valid_without_server(self) -> bool:
        return self.lease_valid_locally()

    def default_lease_margin(self, period: float) -> float:
        """Half the slack between the lease and the keep-alive period."""
        return max(0.0, (self.lease_duration - period) / 2)

    def valid_until(self) -> float | None:
        """When the lease runs out, as a ``time.monotonic()`` instant: the monotonic time
        just before the obtain/renewal that set it, plus what the database granted from its
        own now. Independent of wall clocks (offset or stepped); None when not held."""
        return self._valid_until_mono if self._held else None

    def _connect(self) -> Connection:
        """A connection in autocommit: every statement commits on the server by itself, so
        no row lock ever spans a round trip. A renewal cut off (partition, freeze) between
        an UPDATE and its COMMIT would otherwise leave the row locked by a silent session
        for as long as the server keeps it: the standby's UPDATE waits on that lock instead
        of taking the expired lease (and on MariaDB a standby's failed conditional UPDATE
        would lock the row against the master's renewals the same way)."""
        return self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    @contextlib.contextmanager
    def _at_db_time(self) -> Iterator[tuple[Connection, float, float]]:
        """A connection, the database's time (checked against ours by `_observe`) and the
        monotonic time just before asking: what acquiring and renewing both start with."""
        started = time.monotonic()
        with self._connect() as conn:
            now = db_now(conn)
            self._observe(now)
            yield conn, now, started

    def _try_acquire(self) -> bool:
        row = lease_table.c
        try:
            if not self._row_ready:
                ensure_row(self._engine, lease_table, self.name)
                self._row_ready = True
            with self._at_db_time() as (conn, now, started):
                expires = now + self.lease_duration
                version = conn.execute(
                    select(row.version).where(row.name == self.name)
                ).scalar_one()
                # Compare-and-set on the version: if it matches, no one else obtained in
                # between, and the token is exactly version + 1.
                result = conn.execute(
                    update(lease_table)
                    .where(
                        row.name == self.name,
                        row.version == version,
                        or_(row.holder.is_(None), row.expires_at < now, row.holder == self._id),
                    )
                    .values(holder=self._id, expires_at=expires, version=version + 1)
                )
                if result.rowcount != 1:
                    return False
        except SQLAlchemyError as exc:
            if self.fail_if_locked and not is_lock_conflict(exc):
                raise  # nobody stands by to ride it out: not "held elsewhere"
            log.warning("%r: database unavailable while standing by: %s", self, exc)
            return False
        self.expires_at = expires
        self._valid_until_mono = started + self.lease_duration
        self.fencing_token = int(version) + 1
        return True

    def _keep_alive(self) -> bool:
        """Renew (only if we still hold it; never shortening it). Raises on DB errors."""
        row = lease_table.c
        with self._at_db_time() as (conn, now, started):
            wanted = now + self.lease_duration
            result = conn.execute(
                update(lease_table)
                .where(row.name == self.name, row.holder == self._id)
                .values(expires_at=case((row.expires_at > wanted, row.expires_at), else_=wanted))
            )
            if result.rowcount != 1:
                return False
            self.expires_at = max(self.expires_at, wanted)
            self._valid_until_mono = max(self._valid_until_mono, started + (self.expires_at - now))
            return True

    def _release(self) -> None:
        row = lease_table.c
        try:
            with self._connect() as conn:
                conn.execute(
                    update(lease_table)
                    .where(row.name == self.name, row.holder == self._id)
                    .values(holder=None, expires_at=0.0)
                )
        except SQLAlchemyError as exc:
            log.warning(
                "%r: could not clear the lease on stop (it expires by itself): %s", self, exc
            )
        self.expires_at = 0.0

    def close(self) -> None:
        super().close()
        self._engine.dispose()

    def __repr__(self) -> str:
        return f"LeaseDatabaseLocker({self.name!r}, holder={self._id!r})"
