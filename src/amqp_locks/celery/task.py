"""The :class:`Singleton` base task: hold a lock (or a permit) of the call's key while the
task runs, and, with ``once=True``, refuse to enqueue a key already queued or running.

The lock is taken in ``__call__``, which runs in the process that executes the task (the
prefork child, the thread of the threads pool, the solo worker), through that process's
own Broker (:mod:`.config`), and released in its ``finally``. Nothing is released from
``after_return``/``on_failure``: Celery calls neither when a child is SIGKILLed, and
nothing needs them here, because a killed child's connection dies with it and the broker
frees everything it held.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from celery import Task
from celery.result import AsyncResult

from ..errors import (
    AmqpLocksError,
    ConfigurationError,
    LockError,
    LockShapeMismatch,
    LockTimeout,
)
from ..lease import Lease
from ..lockobject import LockObject
from ..mutex import Mutex
from ..tokens import TokenSemaphore
from ..transport import Broker
from . import config
from . import once as once_claims
from .keys import LockKey, check_key, lock_name

log = logging.getLogger("amqp_locks.celery")

ON_CONFLICT = ("wait", "skip", "retry")


class TaskLockTimeout(LockTimeout):
    """The task's lock was not obtained: within ``lock_timeout`` (``on_conflict="wait"``),
    or in any of its retries (``on_conflict="retry"``, ``max_retries`` exhausted)."""


class AlreadyQueued(LockError):
    """``apply_async`` of a ``once`` task whose key is already queued or running."""


def skipped(name: str) -> dict[str, Any]:
    """The result of a call skipped by ``on_conflict="skip"`` (JSON-serialisable)."""
    return {"skipped": True, "lock": name}


def is_skipped(result: Any) -> bool:
    """Whether a task's result says it was skipped (see :func:`skipped`)."""
    return isinstance(result, dict) and result.get("skipped") is True and "lock" in result


@dataclass
class _Run:
    """One call holding its lock, on the thread that runs it."""

    name: str
    lease: Lease
    #: A `once` call's binding to its key's claim (once.py).
    mark: once_claims.Mark | None = None
    #: A retry of this very key was sent: keep the key queued after the run.
    hand_over: bool = False


class _Locks:
    """Lock objects per (Broker, kind, name): a semaphore's count is checked once."""

    def __init__(self, size: int = 1024) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[int, str, int, bool], LockObject] = OrderedDict()

    def get(self, broker: Broker, name: str, limit: int, fencing: bool, quorum: Any) -> LockObject:
        key = (id(broker), name, limit, fencing)
        with self._lock:
            lock = self._items.get(key)
            if lock is None or lock.broker is not broker:
                if limit == 1:
                    lock = Mutex(broker, name, fencing=fencing)
                else:  # made on first use with `limit` permits, gone once unused
                    lock = TokenSemaphore(
                        broker, name, fencing=fencing, quorum=quorum, first_use=True, permits=limit
                    )
                self._items[key] = lock
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
            return lock


_locks = _Locks()


class _Refused(Exception):
    """The key's claim failed: nothing was published."""


class _Gated:
    """The kombu producer a ``once`` call is sent with: its ``publish`` first waits for
    the key's claim, which runs on the lock connection meanwhile, so the claim's round
    trip overlaps Celery's building of the message; refused, nothing is published."""

    def __init__(self, producer: Any, claimed: Callable[[], bool]) -> None:
        self._producer = producer
        self._claimed = claimed

    def publish(self, *args: Any, **kwargs: Any) -> Any:
        if not self._claimed():
            raise _Refused
        return self._producer.publish(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)


def _claimed_quietly(claimed: Callable[[], bool]) -> bool:
    """Whether the claim succeeded (False when it failed or raised)."""
    try:
        return claimed()
    except BaseException:
        return False


class Singleton(Task[..., Any]):
    """Base task that holds the lock of the call's key while the task runs.

    ``@app.task(base=Singleton, lock_limit=1, lock_key=None, on_conflict="wait",
    lock_timeout=60)``:

    - ``lock_key``: which calls are "the same": None, the task's name and all its
      arguments; a list of argument names, those; a callable of the task's arguments,
      its result (then tasks returning the same key share one lock).
    - ``lock_limit``: 1 is a mutex; N lets N calls of one key run at once (a token
      semaphore of N permits, set up on first use).
    - ``on_conflict``: ``"wait"`` up to ``lock_timeout`` seconds (None: for ever), then
      :class:`TaskLockTimeout`; ``"skip"``: return :func:`skipped` without running;
      ``"retry"``: ``self.retry(countdown=lock_retry_countdown)``, and
      :class:`TaskLockTimeout` once ``max_retries`` are used up.
    - ``once=True``: ``apply_async`` raises :class:`AlreadyQueued` (returns None with
      ``once_graceful``) while a call of the key is queued or running (:mod:`.once`).
    - ``lock_fencing``: give each grant a fencing token (``self.lock.fencing_token``);
      False saves a durable fence queue per key.

    While the task runs, ``self.lock`` is its :class:`~amqp_locks.Lease`.
    """

    lock_limit: ClassVar[int] = 1
    lock_key: ClassVar[LockKey] = None
    on_conflict: ClassVar[str] = "wait"
    lock_timeout: ClassVar[float | None] = 60.0
    lock_retry_countdown: ClassVar[float] = 5.0
    lock_fencing: ClassVar[bool] = True
    once: ClassVar[bool] = False
    once_graceful: ClassVar[bool] = False
    once_durable: ClassVar[bool | None] = None

    _runs: ClassVar[threading.local] = threading.local()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check the lock options where the task is defined (a mistake fails the import,
        not the first call), and keep a callable ``lock_key`` from becoming a method."""
        super().__init_subclass__(**kwargs)
        key = cls.__dict__.get("lock_key")
        if callable(key) and not isinstance(key, staticmethod):
            cls.lock_key = staticmethod(key)
        run = cls.__dict__.get("run")
        bound_run: Callable[..., Any] | None = None
        if isinstance(run, staticmethod):
            bound_run = run.__func__
        elif callable(run):
            bound_run = run.__get__(object())  # drop `self` (bind=True or a method)
        check_key(cls.__dict__.get("lock_key", cls.lock_key), bound_run)
        limit = cls.lock_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(
                f"{cls.__name__}: lock_limit must be an int >= 1, got {limit!r}"
            )
        if cls.on_conflict not in ON_CONFLICT:
            raise ConfigurationError(
                f"{cls.__name__}: on_conflict must be one of {ON_CONFLICT}, got {cls.on_conflict!r}"
            )
        if cls.lock_timeout is not None and cls.lock_timeout < 0:
            raise ConfigurationError(f"{cls.__name__}: lock_timeout must be >= 0 or None")
        if cls.once and limit != 1:
            raise ConfigurationError(
                f"{cls.__name__}: once=True allows one call of a key queued or running, "
                f"so lock_limit={limit} could never be reached; leave lock_limit at 1"
            )
        cls._runs = threading.local()

    # --- what a running task sees ---------------------------------------------------------

    def _stack(self) -> list[_Run]:
        stack: list[_Run] | None = getattr(self._runs, "stack", None)
        if stack is None:
            stack = self._runs.stack = []
        return stack

    @property
    def lock(self) -> Lease | None:
        """The lease the running call holds (None outside a run): ``fencing_token`` for
        what the task writes, ``lost`` if its connection died meanwhile."""
        stack = self._stack()
        return stack[-1].lease if stack else None

    @property
    def broker(self) -> Broker:
        """This process's Broker for the app's locks."""
        return config.broker_for(self.app)

    def lock_name(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The lock name of the call ``task(*args, **kwargs)`` (see ``amqp-locks status``)."""
        return lock_name(self.name, type(self).lock_key, self.run, args, kwargs or {})

    # --- running: take the lock, run, give it back ----------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = self.lock_name(args, kwargs)
        run = self._take(name)
        if run is None:
            log.info("%s[%s] skipped: %s is held", self.name, self.request.id, name)
            return skipped(name)
        stack = self._stack()
        stack.append(run)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            stack.pop()
            self._give_back(run)

    def _take(self, name: str) -> _Run | None:
        """The held lock, None to skip; raises Retry or TaskLockTimeout. A `once` call
        also marks its key running (once.py) once it holds the lock."""
        broker = self.broker
        wait = self.on_conflict == "wait"
        lock = _locks.get(
            broker,
            name,
            self.lock_limit,
            self.lock_fencing,
            config.setting(self.app, "amqp_locks_quorum"),
        )
        lease = self._acquire(lock, wait)
        if lease is not None:
            run = _Run(name, lease)
            if self.once:
                try:
                    run.mark = self._mark(name)
                except BaseException:
                    try:
                        self._free_after_failed_start(name)  # before the lock (_give_back)
                    finally:
                        lease.release()
                    raise
            return run
        if self.on_conflict == "skip":
            return None
        if self.on_conflict == "retry":
            raise self.retry(
                countdown=self.lock_retry_countdown,
                exc=TaskLockTimeout(f"{name} was held in every try ({self.request.retries + 1})"),
            )
        raise TaskLockTimeout(f"{name} was not obtained within {self.lock_timeout} s")

    def _comes_back(self) -> bool:
        """Whether Celery delivers this call's message again if its process dies mid-run
        (measured by tests/celery/test_once_crash.py): a prefork child's, with
        ``acks_late`` and ``reject_on_worker_lost`` (its parent acknowledges it
        otherwise); a threads-pool call's, with ``acks_late``; a solo-pool call's always:
        the solo worker's early acknowledgement does not reach the broker before the
        call ends, so its message is unacknowledged when the worker dies."""
        request = self.request
        if request.called_directly or request.is_eager:
            return False
        if once_claims.SOLO_WORKER:  # (which sends worker_process_init too)
            return True
        if once_claims.IN_POOL_CHILD:
            return bool(self.acks_late and self.reject_on_worker_lost)
        return bool(self.acks_late)

    def _free_after_failed_start(self, name: str) -> None:
        """The call fails before it ran: its key must not stay busy for a call that will
        not run (best effort; a binding left behind goes with this connection)."""
        try:
            once_claims.forget(self.broker, name, self.request.id)
        except AmqpLocksError as exc:
            log.warning("%s: could not free the once key %s: %s", self.name, name, exc)

    def _durable_claims(self) -> bool:
        """``once_durable`` of the task, else the app's ``amqp_locks_once_durable``."""
        if self.once_durable is not None:
            return bool(self.once_durable)
        return bool(config.setting(self.app, "amqp_locks_once_durable"))

    def _mark(self, name: str) -> once_claims.Mark:
        request = self.request
        mark = once_claims.Mark(
            self.broker,
            name,
            str(request.id or name),
            comes_back=self._comes_back(),
            durable=self._durable_claims(),
        )
        mark.start(retried=bool(request.retries))
        return mark

    def _acquire(self, lock: LockObject, wait: bool) -> Lease | None:
        """Acquire the run lock. A semaphore (``lock_limit > 1``) is a first-use token
        semaphore: the first acquire makes its queue with ``lock_limit`` permits, and each
        grant checks the count its token says, refusing a limit other workers gave
        differently (LockShapeMismatch)."""
        try:
            return self._wait_or_try(lock, wait)
        except LockShapeMismatch as exc:  # another count (or lock delay): says which
            raise LockShapeMismatch(
                f"{self.name}: lock_limit is {self.lock_limit}, but {exc}; every worker must agree",
                exc.queue,
                held=exc.held,
                wanted=exc.wanted,
            ) from exc
        except LockError as exc:
            if type(exc) is not LockError or not isinstance(lock, TokenSemaphore):
                raise  # LockTimeout & co.
            # Made with another count (its message says which).
            raise ConfigurationError(
                f"{self.name}: lock_limit is {self.lock_limit}, but {exc}; every worker must agree"
            ) from exc

    def _wait_or_try(self, lock: LockObject, wait: bool) -> Lease | None:
        """Wait up to ``lock_timeout`` ("wait"), or try once (skip, retry)."""
        if wait:
            return lock.acquire(timeout=self.lock_timeout)
        return lock.acquire(blocking=False)

    def _give_back(self, run: _Run) -> None:
        """(``once``) Free the key, or hand it to the retry of the same key that was
        sent, then release the lock: both before Celery stores the result, so whoever
        reads it finds the key free. The key before the lock: the next call of the key
        binds to its claim only once it holds the lock, so its bind never overlaps our
        unbind (on RabbitMQ 4.3 with Khepri that overlap leaves the name unusable:
        once.Mark._bind). A failure is logged, not raised: the task's own outcome stands,
        and what a failed connection held is freed by the broker anyway."""
        try:
            if run.mark is not None:
                run.mark.end(run.hand_over)
        except AmqpLocksError as exc:
            log.warning(
                "%s: freeing the once key %s failed (%s); a connection's death frees "
                "it, else forget_once does",
                self.name,
                run.name,
                exc,
            )
        finally:
            self._release(run)
        if run.lease.lost_reason is not None:
            log.error(
                "%s: %s was lost while the task ran (%s): another call may have run meanwhile",
                self.name,
                run.name,
                run.lease.lost_reason,
            )

    def _release(self, run: _Run) -> None:
        try:
            run.lease.release(wait=True)
        except AmqpLocksError as exc:
            log.warning(
                "%s: releasing %s failed (%s); the broker frees it with the connection",
                self.name,
                run.name,
                exc,
            )

    # --- enqueueing: once ---------------------------------------------------------------

    def apply_async(  # type: ignore[override]
        self,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> AsyncResult | None:  # type: ignore[type-arg]
        """Enqueue; with ``once``, first claim the key (raise :class:`AlreadyQueued`, or
        return None with ``once_graceful=True`` here or on the task, when it is taken).
        Raises :class:`UnidentifiableKey` for a key holding an object's address."""
        graceful = bool(options.pop("once_graceful", self.once_graceful))
        # The key is computed here for every task, not only `once`: a key that cannot
        # identify its values (UnidentifiableKey) is refused before anything is sent.
        name = self.lock_name(args or (), kwargs or {})
        if not self.once:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        if options.get("retries"):
            # A retry continues a call that was queued already: no claim. If this thread
            # runs that key's call, the key stays queued for the retry (hand-over).
            stack = self._stack()
            if stack and stack[-1].name == name and stack[-1].mark is not None:
                stack[-1].hand_over = True
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        if self.app.conf.task_always_eager:  # runs here and now: nothing to overlap
            if not once_claims.claim(self.broker, name, self._durable_claims()):
                self._refused(name, graceful)
                return None
            try:
                return super().apply_async(
                    args, kwargs, task_id, producer, link, link_error, shadow, **options
                )
            except BaseException:
                self._free_unsent(name)  # claimed but not sent: free it
                raise
        try:
            return self._send_gated(
                name, args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except _Refused:
            self._refused(name, graceful)
            return None

    def _free_unsent(self, name: str) -> None:
        """Free the claim of a call that was not sent. The send's own error is the one
        worth raising: a failure here (the lock broker gone too) is logged, and the key
        stays busy (its claim, bound to nothing, never ends by itself) until
        ``forget_once(force=True)`` frees it."""
        try:
            once_claims.forget(self.broker, name)
        except Exception as exc:
            log.warning(
                "%s: the call was not sent, and its key %s could not be freed (%s); it stays "
                "busy until freed with forget_once(force=True)",
                self.name,
                name,
                exc,
            )

    def _refused(self, name: str, graceful: bool) -> None:
        """A refused claim: logged (``graceful``) or :class:`AlreadyQueued` raised."""
        if graceful:
            log.info("%s: %s is already queued or running; not sent", self.name, name)
            return
        raise AlreadyQueued(f"{self.name}: a call with key {name} is already queued or running")

    def _claim_started(self, name: str, producer: Any) -> Callable[[], bool]:
        """Start the key's claim: on the producer's own connection when the locks use
        Celery's broker (once.claim_on), else on the lock connection (once.claim_soon)."""
        durable = self._durable_claims()
        if config.setting(self.app, "amqp_locks_url") is None:
            try:
                claimed = once_claims.claim_on(producer, name, durable)
            except Exception as exc:  # the producer's connection failed: kombu recovers it
                log.debug("%s: claim on the producer's connection failed: %r", self.name, exc)
                claimed = None
            if claimed is not None:
                return claimed
        return once_claims.claim_soon(self.broker, name, durable)

    def _send_gated(self, name: str, *call: Any, **options: Any) -> AsyncResult:  # type: ignore[type-arg]
        """``apply_async`` through a :class:`_Gated` producer whose claim was started
        before Celery builds the message. A producer taken from the pool goes back to it
        as it came after a refusal: kombu replaces a pooled producer's connection when an
        exception leaves its ``with`` block (a new connection per refused call, about
        6 ms), right only for real failures. Claimed but not sent: the key is freed."""
        args, kwargs, task_id, producer, link, link_error, shadow = call
        pooled = None if producer is not None else self.app.producer_pool.acquire(block=True)
        used = producer if pooled is None else pooled
        try:
            claimed = self._claim_started(name, used)
        except BaseException:
            if pooled is not None:
                pooled.release()
            raise
        gated: Any = _Gated(used, claimed)
        try:
            result = super().apply_async(
                args, kwargs, task_id, gated, link, link_error, shadow, **options
            )
        except _Refused:
            if pooled is not None:
                pooled.release()
            raise
        except BaseException:
            exc_info = sys.exc_info()
            try:
                if _claimed_quietly(claimed):  # claimed but not sent: free the key again
                    self._free_unsent(name)
            finally:
                if pooled is not None:
                    pooled.__exit__(*exc_info)  # kombu's own exit: replace, release
            raise
        if pooled is not None:
            pooled.release()
        return result

    def forget_once(
        self,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        task_id: str | None = None,
    ) -> bool:
        """Free a ``once`` key whose queued call will never run (its message was purged or
        lost), unless a call of it runs (``force``: even then, or when a purged retry's
        hand-over holds it). ``task_id``: also drop that call's keeper. True if freed."""
        return once_claims.forget(self.broker, self.lock_name(args, kwargs), task_id, force)
