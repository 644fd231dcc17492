"""The read-write lock objects: ``ReadWriteLock`` and its ``read_lock`` / ``write_lock``."""

from __future__ import annotations

import time

from ..admin_mutex import held_mutex
from ..errors import ClusterUnreachable, ConnectionLost, QueueNotFound
from ..holders import HolderQueries, Reading
from ..lease import Lease
from ..lockobject import LockObject
from ..records import LockStatus
from ..replication import choose_quorum
from ..transport.broker import BrokerCore, BrokerLike
from ..transport.shield import shielded
from ..waiting import Backoff, check_timeout, pause_for_a_node
from .admin import (
    RWLockStatus,
    base_name,
    check_name,
    check_readers,
    first_use,
    ledger_queue,
    read_rwlock,
    read_status,
    readers_queue,
    setup,
    writer_queue,
)
from .protocol import HoldState, acquire_read, acquire_write

#: How many times one acquire makes (or finds made) the lock's missing queues.
FIRST_USE_ROUNDS = 8


class _Half(LockObject):
    """The read or the write side of a :class:`ReadWriteLock`."""

    kind = "rwlock"
    #: A nested hold on one thread waits for itself once a writer queues up.
    reentrant_with = False
    shared: bool

    def __init__(self, rw: ReadWriteLock, blocking: bool, timeout: float | None) -> None:
        self.rw = rw
        self.broker = rw.broker
        self.name = rw.name
        self._init_wait(blocking, timeout)

    async def _wait(self, blocking: bool, timeout: float | None) -> HoldState | None:
        """Set a missing lock up; wait on a new connection when the old one dies."""
        timeout = check_timeout(timeout)
        nonblocking = not blocking or timeout == 0
        deadline = None if timeout is None else time.monotonic() + timeout
        acquire = acquire_read if self.shared else acquire_write
        retried = False
        rounds = 0
        make = False
        while True:
            try:
                if make:
                    # In the try: a connection lost while making the queues is waited
                    # through as one lost while waiting (each step is a test-and-set, so
                    # making them again on the new connection finishes what was begun).
                    rw = self.rw
                    made = first_use(rw.broker.core, self.name, rw.readers, rw.quorum, self.shared)
                    await shielded(made)
                    make = False
                return await acquire(
                    self.rw.broker.core,
                    self.name,
                    deadline=deadline,
                    nonblocking=nonblocking,
                    fence=self.rw.fence if self.rw.fencing else None,
                    readers=self.rw.readers,
                    check_running=self.rw.quorum,
                )
            except QueueNotFound:
                # First use, or expired: make what is missing (test-and-sets, admin.py),
                # never left half-way by a cut wait. A name that keeps vanishing is being
                # deleted by someone, which is worth an error.
                if rounds >= FIRST_USE_ROUNDS:
                    raise
                rounds += 1
                make = True
            except ConnectionLost:
                expired = deadline is not None and time.monotonic() >= deadline
                if (nonblocking and retried) or expired:
                    raise
                retried = True
            except ClusterUnreachable as exc:
                if nonblocking:
                    raise
                await pause_for_a_node(exc, deadline)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Lease | None:
        """A read (or write) hold: a :class:`Lease`, or None when not blocking / timed out."""
        return super().acquire(blocking, timeout)

    def __repr__(self) -> str:
        return f"{self.rw!r}.{'read_lock' if self.shared else 'write_lock'}"


class ReadLock(_Half):
    """Shared hold: any number of readers (up to R at once), no writer."""

    shared = True


class WriteLock(_Half):
    """Exclusive hold: no reader, no other writer."""

    shared = False


class ReadWriteLock(HolderQueries):
    """A distributed read-write lock ``name``: ``read_lock`` and ``write_lock`` are lock
    objects (``acquire()``, ``with``) whose leases carry fencing tokens and loss reports.

    ``readers`` (R, default 64) is the number of reader tokens, used when the lock is set
    up (on first use, or by :meth:`setup`): at most R readers hold at once, and a write
    receives and returns R messages. ``quorum=True`` sets the queues up as quorum queues.
    ``fencing=False`` skips the fence round trip (``fencing_token`` is then 0).
    ``mutex_timeout`` bounds :meth:`destroy`'s wait for the administration mutex.
    ``timeout`` / ``blocking`` are what ``with rw.read_lock:`` waits (default: for ever).
    ``locked()`` is true while anyone holds it (read or write); ``holders()`` lists a
    record per hold (a write hold's ``number`` is 0).
    """

    kind = "rwlock"

    @staticmethod
    async def own_status(core: BrokerCore, name: str) -> Reading:
        reading = await read_rwlock(core, name)
        return reading or Reading(LockStatus(name, "rwlock", 0, 0, 0))  # not set up: free

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        readers: int | None = None,
        timeout: float | None = None,
        blocking: bool = True,
        quorum: bool | None = None,
        fencing: bool = True,
        mutex_timeout: float | None = 30.0,
    ) -> None:
        self.broker = broker
        self.name = check_name(name)
        self.readers = check_readers(readers)
        self.quorum = choose_quorum(broker, quorum, f"read-write lock {name!r}")
        self.fencing = bool(fencing)
        #: Whose fence queue (`<fence>-fence`) the grants count on: the lock's own. The
        #: tooz driver points it at the queue its earlier, mutex-based locks counted on.
        self.fence = base_name(self.name)
        self.mutex_timeout = check_timeout(mutex_timeout)
        self.read_lock = ReadLock(self, blocking, timeout)
        self.write_lock = WriteLock(self, blocking, timeout)

    @property
    def _core(self) -> BrokerCore:
        return self.broker.core

    async def setup_on_loop(self) -> int:
        return await setup(self._core, self.name, self.readers, self.quorum)

    def setup(self) -> int:
        """Create the lock's queues and tokens unless they exist (acquires do it on first
        use); returns R. Raises LockError if ``readers`` was given and differs."""
        return self._core.run(self.setup_on_loop())

    async def status_on_loop(self) -> RWLockStatus | None:
        return await read_status(await self._core.session(), self.name)

    def status(self) -> RWLockStatus | None:
        """Reader tokens, free tokens, writer and waiters; None if not set up."""
        return self._core.run(self.status_on_loop())

    async def destroy_on_loop(self) -> None:
        admin = held_mutex(self._core, base_name(self.name), self.mutex_timeout, Backoff())
        async with admin as m:
            for queue in (ledger_queue(self.name), readers_queue(self.name)):
                await m.session.delete(queue)
            await m.session.delete(writer_queue(self.name))

    def destroy(self) -> None:
        """Delete the lock's queues (holders are told: lost). Its fence is a shared shard,
        so a lock set up again under this name keeps its fencing tokens rising."""
        self._core.run(self.destroy_on_loop())

    def __repr__(self) -> str:
        return f"ReadWriteLock({self.name!r})"
