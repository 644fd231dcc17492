"""tooz locks: the read-write locks of amqp-locks behind tooz's ``Lock`` API."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import tooz
from tooz import locking, utils

from .. import Lease, ReadWriteLock
from .names import as_bytes, tooz_name
from .snapshot import translated

if TYPE_CHECKING:
    from .base import DriverBase


class AmqpLock(locking.Lock):
    """A tooz lock on :class:`amqp_locks.ReadWriteLock`: ``acquire()`` takes its write
    hold, ``acquire(shared=True)`` a read hold (many readers, no writer; a waiting writer
    keeps new readers out and waiting readers go before the next writer).

    Extras beyond tooz's API: :attr:`fencing_token` (strictly rising with every grant of
    this lock, shared or exclusive) and :attr:`lease` (the newest hold's
    :class:`amqp_locks.Lease`: ``lost``, ``on_lost``).
    """

    def __init__(self, driver: DriverBase, name: bytes) -> None:
        super().__init__(name)
        self._driver = driver
        queue = tooz_name(as_bytes(name), "lock")
        self._rw = ReadWriteLock(driver.broker, queue)
        # The fencing counter of this lock's earlier, mutex-based versions: tokens go on
        # rising across the upgrade.
        self._rw.fence = queue
        self._mu = threading.Lock()
        #: Holds of this object, newest last (several only for shared holds).
        self._leases: list[Lease] = []
        self._token = 0

    @property
    def fencing_token(self) -> int:
        """The fencing token of the newest hold of this object (0 before the first)."""
        return self._token

    @property
    def lease(self) -> Lease | None:
        with self._mu:
            return self._leases[-1] if self._leases else None

    def acquire(
        self,
        blocking: bool | float = True,
        shared: bool = False,
        timeout: float | None = None,
    ) -> bool:
        wait, limit = utils.convert_blocking(blocking, timeout)
        side = self._rw.read_lock if shared else self._rw.write_lock
        with translated():
            lease = side.acquire(blocking=wait, timeout=limit if wait else None)
        if lease is None:
            return False
        with self._mu:
            self._leases.append(lease)
            self._token = lease.fencing_token
        return True

    def release(self) -> bool:
        with self._mu:
            if not self._leases:
                return False
            lease = self._leases.pop()
        with translated():
            held = lease.held
            lease.release()
            return held

    def is_still_owner(self) -> bool:
        lease = self.lease
        if lease is None:
            return False
        with translated():
            return lease.held and lease.verify()

    def break_(self) -> bool:
        raise tooz.NotImplemented(
            "a held lock cannot be broken: its reader tokens and the writer's turn are "
            "unacknowledged deliveries of the holder's connection, which RabbitMQ returns "
            "only when the holder releases them or its connection dies"
        )
