"""What the three lock kinds share: ``acquire() -> Lease | None`` and ``with lock:``.

``Mutex``, ``PersistentSemaphore`` and ``TokenSemaphore`` implement one coroutine,
``_wait(blocking, timeout)``, run on the Broker's I/O thread; this base observes it (the
"acquire" event) and turns it into the sync API. ``with lock as lease:`` acquires with the
lock's own ``blocking``/``timeout`` (given to its constructor) and raises
:class:`~amqp_locks.errors.LockTimeout` instead of returning None, as filelock and redis-py
users expect. The leases a ``with`` block took are kept per thread, so one lock object can
be shared by threads.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import ConfigurationError, LockError, LockTimeout
from .events import observed
from .held import HeldState
from .lease import Lease
from .transport.shield import within
from .waiting import check_timeout

if TYPE_CHECKING:
    from .transport.broker import BrokerLike


#: How long past its timeout an acquire's wait may run before it is cut (`within`). Less
#: than an administration call's `CUT_GRACE`: a cut acquire answers None, as its own
#: deadline does (a grant made meanwhile is released), so cutting a healthy broker's
#: last round trip costs nothing but that release, while the promise (timeout + 1 s)
#: keeps 0.4 s for a busy machine. Measured under four CI lanes on 2 cores: the hop to
#: the I/O thread up to 0.15 s, the cut's timer 0.15 s late, the way back 0.05 s, when
#: the grace was 0.6 s counted on the I/O thread (0.2 s left). CI of 2026-12-02 failed the
#: promise's test once (tests/test_timeout_promise.py, its message not kept).
ACQUIRE_GRACE = 0.4


async def _undo(state: HeldState | None) -> None:
    """Give back a grant that came after its caller was told None."""
    if state is not None:
        await state.release()


def timeout_error(lock: object, blocking: bool, timeout: float | None) -> LockTimeout:
    """The error ``with lock:`` raises when the lock was not obtained."""
    how = "at once (blocking=False)" if not blocking else f"within {timeout:g} s"
    return LockTimeout(f"{lock!r} was not obtained {how}; another holder has it")


def check_wait(blocking: bool, timeout: float | None) -> float | None:
    """An acquire's wait settings, read as ``threading.Lock.acquire`` reads them: a
    timeout with ``blocking=False`` would be ignored, so it is a ValueError
    (:class:`ConfigurationError`); ``-1`` means no timeout. Returns the timeout of the
    wait (None: for ever, or not blocking)."""
    if timeout == -1:
        return None
    if not blocking:
        if timeout is not None:
            raise ConfigurationError(
                f"timeout={timeout!r} given with blocking=False: a non-blocking acquire "
                "never waits (threading.Lock refuses it too)"
            )
        return None
    return check_timeout(timeout)


class LockObject(ABC):
    """Base of the sync lock classes (see the module docstring)."""

    #: The lock kind in events, metrics and errors: "mutex", "semaphore" or "token"
    #: (the same words as :data:`amqp_locks.status.Kind` and the CLI).
    kind: ClassVar[str]
    #: A ``with`` block inside another on the same object and thread would wait for itself.
    reentrant_with: ClassVar[bool] = True

    broker: BrokerLike
    name: str
    blocking: bool
    timeout: float | None

    def _init_wait(self, blocking: bool, timeout: float | None) -> None:
        self.blocking = bool(blocking)
        self.timeout = check_wait(self.blocking, timeout)  # what `with lock:` waits
        self._local = threading.local()

    @abstractmethod
    async def _wait(self, blocking: bool, timeout: float | None) -> HeldState | None:
        """The kind's own acquire, on the I/O loop: the held state, or None (not blocking /
        timed out)."""

    def acquire_on_loop(
        self, blocking: bool, timeout: float | None
    ) -> Coroutine[Any, Any, HeldState | None]:
        """One acquire, observed (its "acquire" event: granted, timeout or error), as a
        coroutine for the I/O loop. A timeout is a promise: the answer comes within
        ``timeout`` + 1 s of this call even from a broker that keeps the connection alive
        but answers nothing (`within`): None. A wait cut while no connection is up (the
        broker accepts TCP but never answers the handshake, or a reconnect hangs) never
        asked for the lock: it raises :class:`BrokerUnreachable`, so "busy" and "broker
        down" are never confused.

        Called in the caller's thread, so the promise counts from the call: the hop to
        the I/O thread is inside it. The cut comes :data:`ACQUIRE_GRACE` after the
        timeout, and what it cuts gets `CUT_SETTLE` to wind down: 0.4 s of the promise are
        left for a busy machine's lateness."""
        timeout = check_wait(blocking, timeout)  # in the caller, before any I/O
        return self._acquire_observed(blocking, timeout, time.monotonic())

    async def _acquire_observed(
        self, blocking: bool, timeout: float | None, called: float
    ) -> HeldState | None:
        # What the hop to this loop took is taken from the cut's bound, never from the
        # kind's own wait (a healthy broker's answer at its deadline is kept).
        bound = None if timeout is None else max(0.0, timeout - (time.monotonic() - called))
        core = self.broker.core

        def unconnected() -> BaseException | None:
            assert timeout is not None  # only a bounded wait is cut
            return core.unconnected_error(timeout, repr(self))

        return await observed(
            self.kind,
            self.name,
            within(
                self._wait(blocking, timeout), bound, _undo, cut=unconnected, grace=ACQUIRE_GRACE
            ),
        )

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Lease | None:
        """Hold the lock: a :class:`Lease`, or None when not blocking / timed out.
        ``blocking=False`` with a timeout is a ValueError, as for ``threading.Lock``."""
        check_wait(blocking, timeout)  # before any I/O
        state = self.broker.core.run(self.acquire_on_loop(blocking, timeout))
        return None if state is None else Lease(state)

    def acquire_later(
        self, timeout: float | None = None
    ) -> concurrent.futures.Future[Lease | None]:
        """Start a blocking acquire and return at once: a future of its :class:`Lease`
        (None after `timeout` seconds; default: wait for ever). For a caller that must
        stay responsive while it waits (a standby checking for ``stop()``) without asking
        the broker again each time it looks: one wait, one consumer, however long.
        ``future.cancel()`` gives the wait up, undoing a grant that was being made; when
        it returns False the wait had already ended: take its result and release it."""
        check_timeout(timeout)

        async def wait() -> Lease | None:
            state = await self.acquire_on_loop(True, timeout)
            return None if state is None else Lease(state)

        return self.broker.core.submit(wait())

    def _stack(self) -> list[Lease]:
        stack: list[Lease] | None = getattr(self._local, "leases", None)
        if stack is None:
            stack = self._local.leases = []
        return stack

    def __enter__(self) -> Lease:
        stack = self._stack()
        if stack and not self.reentrant_with:
            raise LockError(f"{self!r} is already held by this thread's enclosing `with`")
        lease = self.acquire(self.blocking, self.timeout)
        if lease is None:
            raise timeout_error(self, self.blocking, self.timeout)
        stack.append(lease)
        return lease

    def __exit__(self, *exc: object) -> None:
        self._stack().pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
