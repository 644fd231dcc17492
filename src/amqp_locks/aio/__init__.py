"""The asyncio facade: the same objects as :mod:`amqp_locks`, with awaitable methods.

The protocol still runs on the Broker's private I/O thread; these classes only await its
results (``asyncio.wrap_future``), so a busy or blocked user event loop never stops the
heartbeats. Cancelling an awaiting ``acquire`` cancels the attempt, and a half-made grant is
undone on the I/O thread. The admin classes await the same coroutines their sync twins run
(`TokenAdminCore`, `SemaphoreAdminCore`): no worker thread waits for a drain or a poll, and
cancelling a call cancels it on the I/O loop (which lets the admin mutex go).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import sys
import threading
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any, TypeVar

from .. import fencing as _fencing
from .. import holders as _holders
from .. import mutex as _mutex
from .. import rwlock as _rwlock
from .. import status as _status
from .. import tokens as _tokens
from ..errors import LockError
from ..held import HeldState
from ..lockobject import LockObject, timeout_error
from ..semaphore import admin as _admin
from ..semaphore import client as _client
from ..transport.broker import CLOSE_TIMEOUT, BrokerBase
from ..transport.core import RELEASE_HANDOFF

T = TypeVar("T")

__all__ = [
    "Broker",
    "Lease",
    "Mutex",
    "PersistentSemaphore",
    "ReadWriteLock",
    "SemaphoreAdmin",
    "TokenAdmin",
    "TokenSemaphore",
    "lock_status",
    "prepare_fences",
]


async def _on_loop(broker: BrokerBase, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the broker's I/O loop and await its result here."""
    return await _settle(broker, broker.core.submit(coro))


async def _settle(broker: BrokerBase, fut: concurrent.futures.Future[T]) -> T:
    """Await an operation on the I/O loop. One that ``close()`` ended raises
    BrokerClosed; a cancellation of our own task stays a CancelledError (and cancels
    the operation on the I/O loop)."""
    try:
        return await asyncio.wrap_future(fut)
    except (asyncio.CancelledError, Exception) as exc:
        task = asyncio.current_task()
        ours = task is not None and task.cancelling() > 0
        closed = None if ours else broker.core.closed_error(exc)
        if closed is not None:
            raise closed from None
        raise


class Broker(BrokerBase):
    """asyncio twin of :class:`amqp_locks.Broker` (same arguments)."""

    async def connect(self) -> Broker:
        await _on_loop(self, self.core.session())
        return self

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """See :meth:`amqp_locks.Broker.close`: tasks awaiting this Broker get BrokerClosed,
        releases in flight and held leases are released first (within `timeout`)."""
        # Closing ends with joining the I/O thread (IOThread.stop): a blocking join that
        # cannot run on that thread's own loop and would stall the caller's, so it waits
        # on a worker thread. Only close does; every lock and admin call awaits the loop.
        await asyncio.get_running_loop().run_in_executor(None, self.core.close, timeout)

    async def __aenter__(self) -> Broker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Lease:
    """asyncio twin of :class:`amqp_locks.Lease`."""

    def __init__(self, state: HeldState, broker: Broker) -> None:
        self._state = state
        self._broker = broker

    number = property(lambda self: self._state.number)
    fencing_token = property(lambda self: self._state.fencing_token)
    name = property(lambda self: self._state.name)
    lost_reason = property(lambda self: self._state.lost_reason)
    released = property(lambda self: self._state.released)

    @property
    def lost(self) -> threading.Event:
        """Set the moment the lease is known lost: the same object as the sync Lease's
        (``lease.lost.is_set()``; await :meth:`wait_lost` to wait for it)."""
        return self._state.lost_event

    @property
    def held(self) -> bool:
        return not self._state.released and self._state.lost_reason is None

    async def wait_lost(self) -> str:
        """Return (with the reason) once the lease is lost; cancel to stop waiting."""
        if self._state.lost_reason is None:
            event = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._state.async_waiters.append((loop, event))
            try:
                if self._state.lost_reason is None:
                    await event.wait()
            finally:
                self._state.async_waiters.remove((loop, event))
        return self._state.lost_reason or ""

    def on_lost(self, callback: Callable[[Lease], Any]) -> None:
        """Call ``callback(lease)`` (on a helper thread) once the lease is lost."""
        self._state.add_callback(lambda: callback(self))

    async def verify(self) -> bool:
        self._state.check_process()
        return await _on_loop(self._broker, self._state.verify())

    async def release(self, wait: bool = False) -> None:
        """See :meth:`amqp_locks.Lease.release`: ``await lease.release(wait=True)`` returns
        once the broker has confirmed the release (ReleaseUnconfirmed if it could not)."""
        self._state.check_process()
        core = self._broker.core
        if core.closed:
            core.release(self._state, wait)  # nothing to do but report (no I/O)
            return
        fut = core.submit_release(self._state, wait)
        if not wait:  # as the sync release: a silent broker holds us RELEASE_HANDOFF at most
            done, _ = await asyncio.wait({asyncio.wrap_future(fut)}, timeout=RELEASE_HANDOFF)
            if not done:
                return
        await _settle(self._broker, fut)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


F = TypeVar("F", bound=Callable[..., Any])

if sys.version_info >= (3, 12):
    _coroutine_function = inspect.markcoroutinefunction
else:  # 3.11 has no marker: acquire() still returns a coroutine asyncio takes

    def _coroutine_function(func: F) -> F:
        return func


class _Acquirable:
    """`await x.acquire()`, `async with x.acquire() as lease`, and `async with x as lease`
    (with the lock's own `timeout`/`blocking`, raising LockTimeout; leases per task)."""

    #: The sync lock class this twin wraps (its protocol core and wait settings).
    _lock_class: Callable[..., LockObject]
    _sync: LockObject

    def __init__(self, broker: Broker, name: str, **options: Any) -> None:
        self._broker = broker
        self._sync = self._lock_class(broker, name, **options)
        #: The leases each task's `async with` holds (innermost last).
        self._held: dict[asyncio.Task[Any] | None, list[Lease]] = {}

    def _start(
        self, blocking: bool, timeout: float | None
    ) -> Coroutine[Any, Any, HeldState | None]:
        return self._sync.acquire_on_loop(blocking, timeout)

    @property
    def name(self) -> str:
        return self._sync.name

    @_coroutine_function
    def acquire(self, blocking: bool = True, timeout: float | None = None) -> _AcquireCall:
        """Hold the lock: a coroutine whose result is a :class:`Lease`, or None when not
        blocking / timed out (``blocking=False`` with a timeout: ValueError). Await it,
        hand it to ``asyncio.create_task``, ``TaskGroup.create_task`` or
        ``asyncio.wait_for``, or use it as ``async with lock.acquire(...) as lease:``
        (raises LockTimeout instead of giving None; releases at the end)."""
        return _AcquireCall(self, self._broker, self._start, blocking, timeout)

    async def __aenter__(self) -> Lease:
        sync = self._sync
        leases = self._held.setdefault(asyncio.current_task(), [])
        if leases and not sync.reentrant_with:
            raise LockError(f"{self!r} is already held by this task's enclosing `async with`")
        lease = await self.acquire(sync.blocking, sync.timeout)
        if lease is None:
            raise timeout_error(self, sync.blocking, sync.timeout)
        leases.append(lease)
        return lease

    async def __aexit__(self, *exc: object) -> None:
        task = asyncio.current_task()
        leases = self._held[task]
        lease = leases.pop()
        if not leases:
            del self._held[task]
        await lease.release()

    def __repr__(self) -> str:
        return f"aio.{self._sync!r}"


class _AcquireCall(Coroutine[Any, Any, "Lease | None"]):
    """What ``acquire()`` returns: a coroutine (``collections.abc.Coroutine``, so asyncio
    takes it wherever it takes one: ``create_task``, ``TaskGroup``, ``wait_for``,
    ``gather``) that is also an async context manager, as aiohttp's ``session.get()`` is.
    The underlying coroutine is made on first use: an acquire never awaited costs nothing
    and warns of nothing."""

    def __init__(
        self,
        owner: _Acquirable,
        broker: Broker,
        start: Callable[[bool, float | None], Coroutine[Any, Any, HeldState | None]],
        blocking: bool,
        timeout: float | None,
    ) -> None:
        self._owner = owner
        self._broker = broker
        self._start = start
        self._blocking = blocking
        self._timeout = timeout
        self._lease: Lease | None = None
        self._coro: Coroutine[Any, Any, Lease | None] | None = None

    async def _go(self) -> Lease | None:
        broker = self._broker
        state = await _on_loop(broker, self._start(self._blocking, self._timeout))
        return None if state is None else Lease(state, broker)

    def _inner(self) -> Coroutine[Any, Any, Lease | None]:
        if self._coro is None:
            self._coro = self._go()
        return self._coro

    def send(self, value: Any) -> Any:
        return self._inner().send(value)

    def throw(self, *args: Any) -> Any:
        return self._inner().throw(*args)

    def close(self) -> None:
        if self._coro is not None:
            self._coro.close()

    def __await__(self) -> Generator[Any, None, Lease | None]:
        return self._inner().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._inner()
        if self._lease is None:
            raise timeout_error(self._owner, self._blocking, self._timeout)
        return self._lease

    async def __aexit__(self, *exc: object) -> None:
        if self._lease is not None:
            await self._lease.release()

    def __repr__(self) -> str:
        return f"<{self._owner!r}.acquire(blocking={self._blocking}, timeout={self._timeout})>"


class _HolderQueries:
    """asyncio twins of ``locked()`` and ``holders()`` (``amqp_locks.holders``)."""

    _broker: Broker
    #: The sync object whose ``kind`` and ``name`` the queries are about.
    _sync: Any

    async def locked(self) -> bool:
        """See :meth:`amqp_locks.Mutex.locked`."""
        core = self._broker.core
        return await _on_loop(
            self._broker, _holders.read_locked(core, self._sync.own_status, self.name)
        )

    async def holders(
        self, timeout: float = _holders.HOLDER_TIMEOUT
    ) -> list[_holders.HolderRecord]:
        """See :meth:`amqp_locks.Mutex.holders`."""
        core = self._broker.core
        read = _holders.read_holders(core, self._sync.own_status, self.name, timeout)
        return await _on_loop(
            self._broker, _holders.bounded(read, timeout, f"holders of {self.name!r}")
        )

    @property
    def name(self) -> str:
        return str(self._sync.name)


class PersistentSemaphore(_HolderQueries, _Acquirable):
    """asyncio twin of :class:`amqp_locks.PersistentSemaphore`."""

    _lock_class = _client.PersistentSemaphore


class Mutex(_HolderQueries, _Acquirable):
    """asyncio twin of :class:`amqp_locks.Mutex`."""

    _lock_class = _mutex.Mutex

    async def holder(
        self, timeout: float = _holders.HOLDER_TIMEOUT
    ) -> _holders.HolderRecord | None:
        """See :meth:`amqp_locks.Mutex.holder`."""
        return _holders.pick_holder(await self.holders(timeout))


class TokenSemaphore(_HolderQueries, _Acquirable):
    """asyncio twin of :class:`amqp_locks.TokenSemaphore`: acquire and the admin methods
    (those of :attr:`admin`, an :class:`aio.TokenAdmin <TokenAdmin>`) await the I/O loop."""

    _lock_class = _tokens.TokenSemaphore

    def __init__(
        self,
        broker: Broker,
        name: str,
        *,
        quorum: bool | None = None,
        mutex_timeout: float | None = _tokens.MUTEX_TIMEOUT,
        **options: Any,
    ) -> None:
        super().__init__(broker, name, quorum=quorum, mutex_timeout=mutex_timeout, **options)
        self.admin = TokenAdmin(
            broker,
            name,
            quorum=self._sync.quorum,
            mutex_timeout=mutex_timeout,
            first_use=True if self._sync.first_use else None,
        )

    async def setup(self, permits: int) -> int:
        return await self.admin.setup(permits)

    async def add_permits(self, count: int) -> list[int]:
        return await self.admin.add_permits(count)

    async def remove_permits(self, count: int, timeout: float | None = None) -> list[int]:
        return await self.admin.remove_permits(count, timeout)

    async def status(self) -> _tokens.TokenStatus:
        return await self.admin.status()

    async def audit(self, timeout: float = 5.0) -> _tokens.Audit:
        return await self.admin.audit(timeout)

    async def repair(self, timeout: float = 5.0) -> _tokens.Audit:
        return await self.admin.repair(timeout)

    async def destroy(self, *, purge_fence: bool = False) -> None:
        await self.admin.destroy(purge_fence=purge_fence)


class TokenAdmin:
    """asyncio twin of :class:`amqp_locks.TokenAdmin`: the same methods, awaitable. Each
    awaits its coroutine on the Broker's I/O loop; no thread waits for a drain or audit."""

    def __init__(self, broker: Broker, name: str, **options: Any) -> None:
        self._broker = broker
        self._ops = _tokens.TokenAdminCore(broker, name, **options)
        self.name = self._ops.name

    async def setup(self, permits: int) -> int:
        return await _on_loop(self._broker, self._ops.setup(permits))

    async def add_permits(self, count: int) -> list[int]:
        return await _on_loop(self._broker, self._ops.add_permits(count))

    async def remove_permits(self, count: int, timeout: float | None = None) -> list[int]:
        return await _on_loop(self._broker, self._ops.remove_permits(count, timeout))

    async def status(self) -> _tokens.TokenStatus:
        return await _on_loop(self._broker, self._ops.status())

    async def audit(self, timeout: float = 5.0) -> _tokens.Audit:
        return await _on_loop(self._broker, self._ops.audit(timeout))

    async def repair(self, timeout: float = 5.0) -> _tokens.Audit:
        return await _on_loop(self._broker, self._ops.repair(timeout))

    async def destroy(self, *, purge_fence: bool = False) -> None:
        await _on_loop(self._broker, self._ops.destroy(purge_fence=purge_fence))

    def __repr__(self) -> str:
        return f"aio.TokenAdmin({self.name!r})"


class _RWHalf(_Acquirable):
    """asyncio twin of one side of a :class:`amqp_locks.ReadWriteLock`."""

    def __init__(self, broker: Broker, sync: _rwlock.ReadLock | _rwlock.WriteLock) -> None:
        self._broker = broker
        self._sync = sync
        self._held = {}


class ReadWriteLock(_HolderQueries):
    """asyncio twin of :class:`amqp_locks.ReadWriteLock`: ``read_lock`` and ``write_lock``
    are awaitable lock objects; setup/status/destroy await the same core."""

    _sync: _rwlock.ReadWriteLock

    def __init__(self, broker: Broker, name: str, **options: Any) -> None:
        self._broker = broker
        self._sync = _rwlock.ReadWriteLock(broker, name, **options)
        self.read_lock = _RWHalf(broker, self._sync.read_lock)
        self.write_lock = _RWHalf(broker, self._sync.write_lock)

    async def setup(self) -> int:
        return await _on_loop(self._broker, self._sync.setup_on_loop())

    async def status(self) -> _rwlock.RWLockStatus | None:
        return await _on_loop(self._broker, self._sync.status_on_loop())

    async def destroy(self) -> None:
        await _on_loop(self._broker, self._sync.destroy_on_loop())

    def __repr__(self) -> str:
        return f"aio.{self._sync!r}"


async def lock_status(
    broker: Broker,
    name: str,
    kinds: Sequence[_status.Kind] = _status.ALL_KINDS,
    *,
    records: bool = False,
    timeout: float = _holders.HOLDER_TIMEOUT,
) -> list[_status.LockStatus]:
    """asyncio twin of :func:`amqp_locks.lock_status`."""
    read = _status.read_lock_status(broker.core, name, kinds, records=records, timeout=timeout)
    return await _on_loop(broker, _holders.bounded(read, timeout, f"status of {name!r}"))


async def prepare_fences(broker: Broker) -> list[str]:
    """asyncio twin of :func:`amqp_locks.prepare_fences`."""
    return await _on_loop(broker, _fencing.prepare_on_loop(broker.core))


class SemaphoreAdmin:
    """asyncio twin of :class:`amqp_locks.SemaphoreAdmin`: the same methods, awaitable.

    Each awaits its coroutine on the Broker's I/O loop (polling for holders included), so
    no thread is taken and the caller's loop runs on meanwhile.
    """

    def __init__(self, broker: Broker, name: str, **options: Any) -> None:
        self._broker = broker
        self._ops = _admin.SemaphoreAdminCore(broker, name, **options)
        self.name = self._ops.name

    async def create(self, slots: int) -> int:
        return await _on_loop(self._broker, self._ops.create(slots))

    async def destroy(self, *, purge_fence: bool = False) -> _admin.Removal:
        return await _on_loop(self._broker, self._ops.destroy(purge_fence=purge_fence))

    async def max_slots(self) -> int:
        return await _on_loop(self._broker, self._ops.max_slots())

    async def add_slots(self, count: int) -> int:
        return await _on_loop(self._broker, self._ops.add_slots(count))

    async def remove_slots(self, count: int, *, wait: float | None = 0) -> _admin.Removal:
        return await _on_loop(self._broker, self._ops.remove_slots(count, wait=wait))

    async def holders(self, *, beyond: int = 0) -> list[int]:
        return await _on_loop(self._broker, self._ops.holders(beyond=beyond))

    async def wait_for_holders(
        self, slots: Sequence[int], timeout: float | None = None, *, interval: float = 0.1
    ) -> list[int]:
        return await _on_loop(
            self._broker, self._ops.wait_for_holders(slots, timeout, interval=interval)
        )

    async def repair_fence(self, base: int) -> bool:
        return await _on_loop(self._broker, self._ops.repair_fence(base))

    def __repr__(self) -> str:
        return f"aio.SemaphoreAdmin({self.name!r})"
