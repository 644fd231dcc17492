"""`BrokerCore`: connection management on the private I/O thread, shared by both facades.

It hands out the current :class:`~amqp_locks.transport.session.Session`, opening a new one
after a loss (leases of the old one are already marked lost), runs what the facades submit,
tracks releases in flight and closes in order. broker.py holds the facades.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import ssl
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from yarl import URL

from .. import events, signals
from ..errors import (
    AccessRefused,
    AmqpLocksError,
    AuthenticationFailed,
    BrokerClosed,
    BrokerUnreachable,
    ClusterUnreachable,
    ConfigurationError,
    ConnectionLost,
    ReleaseUnconfirmed,
)
from .errors import censor
from .holders import check_holder_id
from .iothread import IOThread
from .ports import Releasable
from .quorum_guard import ClusterTiming
from .session import Session
from .urls import UrlSpec, default_connection_name, resolve_urls

log = logging.getLogger("amqp_locks.transport")

T = TypeVar("T")

#: Seconds ``Broker.close()`` gives releases in flight and held leases before it closes the
#: connection anyway (which frees whatever is still held).
CLOSE_TIMEOUT = 5.0
#: How long a release (without ``wait``) may hold its caller when the broker stops
#: answering; a healthy broker answers in milliseconds.
RELEASE_HANDOFF = 2.0
#: What the session's own close may take after that (its bounded waits: background tasks,
#: connection.close-ok).
SESSION_CLOSE_BOUND = 10.0

#: Every live core, so a forked child can drop what it inherited (see `_after_fork`).
_cores: weakref.WeakSet[BrokerCore] = weakref.WeakSet()
#: What a fork child inherited of its parent's cores: kept referenced and never used, so
#: no finalizer of the child closes (or writes a goodbye frame on) the parent's connection.
_inherited: list[object] = []


def _after_fork() -> None:
    for core in list(_cores):
        core.after_fork()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork)


def _handed_off(fut: concurrent.futures.Future[None], state: Releasable, what: str) -> bool:
    """Whether release `fut` ended within RELEASE_HANDOFF, asked after the wait (a release
    that ended as the wait ran out counts: tests/test_signal_waits.py); else logged as
    going on in the background."""
    with contextlib.suppress(concurrent.futures.TimeoutError):
        fut.result(timeout=RELEASE_HANDOFF)
    if fut.done():
        return True
    log.warning(
        "release of %s %s of %r not %s within %.0f s: it goes on in the background",
        state.kind,
        state.number,
        state.name,
        what,
        RELEASE_HANDOFF,
    )
    return False


class BrokerCore:
    """Connection management on the I/O loop; shared by the sync and asyncio facades.

    Fork-safe: the I/O thread does not survive ``fork()``, and the parent's connection
    stays the parent's, so a child starts its own thread and connection on first use
    (gunicorn ``--preload``, Celery prefork, multiprocessing's fork start method). Leases
    granted before the fork remain the parent's (:class:`~amqp_locks.errors.WrongProcess`
    in the child).
    """

    def __init__(
        self,
        url: UrlSpec = None,
        *,
        heartbeat: float = 10.0,
        loss_timeout: float | None = None,
        connect_timeout: float = 10.0,
        connection_name: str | None = None,
        cluster: bool | None = None,
        ssl_context: ssl.SSLContext | None = None,
        holder_id: str | None = None,
        net_ticktime: float | None = None,
        quorum_timeout: float | None = None,
        lock_delay: float | None = None,
    ) -> None:
        if heartbeat <= 0:
            raise ConfigurationError(f"heartbeat must be > 0 seconds, got {heartbeat}")
        if connect_timeout <= 0:
            raise ConfigurationError(f"connect_timeout must be > 0, got {connect_timeout}")
        self.urls = resolve_urls(url)
        #: Index in `urls` of the node the next connection tries first.
        self._next = 0
        #: The node of the current (or last) connection.
        self.url = self.urls[0]
        self.cluster = len(self.urls) > 1 if cluster is None else bool(cluster)
        #: What cluster mode assumes of the cluster and gives a holder (quorum_guard.py).
        self.timing = ClusterTiming.of(net_ticktime, quorum_timeout, lock_delay)
        plain = [censor(u) for u in self.urls if u.scheme != "amqps"]
        if ssl_context is not None and plain:
            raise ConfigurationError(
                f"ssl_context is for TLS, but {', '.join(plain)} is not amqps:// "
                "(the connection would not use it)"
            )
        self.ssl_context = ssl_context
        self.heartbeat = float(heartbeat)
        # The broker declares us dead after two heartbeat periods of silence at the
        # earliest (it checks every period, needs two checks without data). We give up
        # after one period with no answer: the watchdog's pings (session.py) are answered
        # several times a period, so one period of silence is several missed replies, and
        # we give up first with a full period of margin.
        self.loss_timeout = float(loss_timeout if loss_timeout is not None else heartbeat)
        if self.loss_timeout <= 0:
            raise ConfigurationError(f"loss_timeout must be > 0, got {loss_timeout}")
        self.connect_timeout = connect_timeout
        #: What holder records of this Broker's locks say (None: ``host:pid``, per process).
        self.holder_id = None if holder_id is None else check_holder_id(holder_id)
        self._named = connection_name is not None
        self.connection_name = connection_name or default_connection_name()
        self._io: IOThread | None = None
        self._io_lock = threading.Lock()
        self._session: Session | None = None
        self._lock: asyncio.Lock | None = None
        self._closed = False
        #: close() has begun: new operations are refused, waiting ones end in BrokerClosed.
        self._closing = False
        #: Callers' operations on the I/O loop (acquires, admin calls, queries): close()
        #: cancels them first, so nothing is granted while it closes and every caller
        #: waiting on one gets BrokerClosed at once. Touched on the I/O loop only.
        self._ops: set[asyncio.Task[Any]] = set()
        #: Releases in flight (their coroutines and what they left running): close()
        #: lets them finish before it closes the connection. Touched on the I/O loop only.
        self._releases: set[asyncio.Future[Any]] = set()
        _cores.add(self)

    @property
    def io(self) -> IOThread:
        """The I/O thread, started on first use (a Broker that is never used costs none)."""
        io = self._io
        if io is None:
            with self._io_lock:
                if self._io is None:
                    self._io = IOThread()
                io = self._io
        return io

    def after_fork(self) -> None:
        """In a fork child: forget the parent's thread and connection without any I/O on
        them (a frame written from here would corrupt the parent's stream)."""
        _inherited.append((self._io, self._session, self._lock, self._ops, self._releases))
        self._io = None
        self._io_lock = threading.Lock()
        self._session = None
        self._lock = None
        self._ops = set()
        self._releases = set()
        if not self._named:
            self.connection_name = default_connection_name()

    async def session(self) -> Session:
        """The live session, connecting (again) when there is none."""
        if self._closed or self._closing:
            raise self._closed_error()
        current = self._session
        if current is not None and current.alive:
            return current
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            current = self._session
            if current is not None and current.alive:
                return current
            session = await self._connect()
            if current is not None:
                session.carry_from(current)  # a waiter's clocks go on (Session.carry_from)
            events.emit(events.connection(session, self.connection_name, self._session is not None))
            self._session = session
            return session

    async def _connect(self) -> Session:
        """Connect to the first node that answers, starting after the one whose connection
        was lost (it is likely dead). Credentials and vhost errors are the same on every
        node of a cluster: they are raised at once, not hidden by trying the others."""
        failures: list[tuple[URL, AmqpLocksError]] = []
        count = len(self.urls)
        for i in range(count):
            index = (self._next + i) % count
            url = self.urls[index]
            session = Session(
                url,
                heartbeat=self.heartbeat,
                loss_timeout=self.loss_timeout,
                connection_name=self.connection_name,
                cluster=self.cluster,
                ssl_context=self.ssl_context,
                holder_id=self.holder_id,
                timing=self.timing,
            )
            try:
                await session.connect(self.connect_timeout)
            except (AuthenticationFailed, AccessRefused):
                raise
            except AmqpLocksError as exc:
                if count == 1:
                    raise
                log.info("node %s unreachable: %s", censor(url), exc)
                failures.append((url, exc))
                continue
            self.url = url
            # After a loss, try the next node first: this one may be the one that died.
            self._next = (index + 1) % count
            return session
        raise ClusterUnreachable(
            "no broker node reachable: " + "; ".join(f"{censor(u)}: {e}" for u, e in failures),
            [(censor(u), e) for u, e in failures],
        )

    @property
    def connected(self) -> bool:
        """A connection is up now (opened and not lost)."""
        session = self._session
        return session is not None and session.alive

    def unconnected_error(self, seconds: float, what: str) -> BrokerUnreachable | None:
        """Why a wait cut after `seconds` (transport/shield.py, `within`) got nothing: when
        no connection is up, the broker was never asked for `what` (it accepts TCP but
        never answers the handshake, or a reconnect hangs), which is not "busy". None
        while connected: a hung but connected broker is the caller's plain timeout."""
        if self.connected:
            return None
        return BrokerUnreachable(
            f"broker {censor(self.url)} did not answer within {seconds:g} s: no connection "
            f"was made, so {what} could not be asked for"
        )

    def _closed_error(self) -> BrokerClosed:
        what = "closed" if self._closed else "being closed"
        return BrokerClosed(f"the Broker is {what}; open a new Broker")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a caller's operation on the I/O loop (thread-safe future); ``close()``
        cancels it, and :meth:`closed_error` turns that into BrokerClosed for the caller."""
        if self._closed or self._closing:
            coro.close()
            raise self._closed_error()
        return self.io.submit(self._op(coro))

    async def _op(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`, registered as a caller's operation while it runs (see ``_ops``)."""
        if self._closing:  # close() began between the submit and this first step
            coro.close()
            raise self._closed_error()
        task = asyncio.current_task()
        assert task is not None
        self._ops.add(task)
        try:
            return await coro
        finally:
            self._ops.discard(task)

    def closed_error(self, exc: BaseException) -> BrokerClosed | None:
        """The BrokerClosed a caller gets instead of `exc`, when `exc` is how close() ended
        its operation (cancelled, or the connection closed under it); None otherwise."""
        if not (self._closing or self._closed):
            return None
        if isinstance(exc, concurrent.futures.CancelledError | asyncio.CancelledError):
            return self._closed_error()
        if isinstance(exc, ConnectionLost):
            return self._closed_error()
        return None

    def wait(self, fut: concurrent.futures.Future[T]) -> T:
        """Wait for `fut` in the calling thread. An interrupt (KeyboardInterrupt) cancels
        the coroutine, which undoes any half-made grant before it finishes; an operation
        that close() ended raises BrokerClosed (never an internal CancelledError)."""
        try:
            return signals.result(fut)  # in slices: a Ctrl-C taken by another thread
        except BaseException as exc:
            if not fut.done():
                fut.cancel()
                concurrent.futures.wait([fut], timeout=5.0)
            closed = self.closed_error(exc)
            if closed is not None:
                raise closed from None
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the I/O loop and wait for it (the sync facade's one entry point)."""
        return self.wait(self.submit(coro))

    async def read(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """A read that changes nothing on the broker (status, holders, a Celery key),
        tried once more on a new connection when the connection is lost under it. In a
        cluster a node's death drops the connections through it, and the quorum guard
        drops one whose probe queue's leader died while a new one is elected (seen in CI,
        4.3.6 under load: a status read on a surviving node failed 5 s after another node
        was killed); a read has nothing to lose, so the caller need not see that."""
        try:
            return await attempt()
        except ConnectionLost:
            if self._closing or self._closed:
                raise
            return await attempt()

    # --- releases -----------------------------------------------------------------------

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._releases.add(fut)
        fut.add_done_callback(self._releases.discard)

    async def release_state(self, state: Releasable, wait: bool) -> None:
        """Release `state` on the I/O loop: the release (and, with `wait`, the broker's
        confirmation of it). Tracked, with whatever it leaves running, so that close()
        completes it before closing the connection; never cancelled by close()."""
        task = asyncio.current_task()
        if task is not None:
            self._track(task)
        try:
            if wait:
                await state.release_confirmed()
            else:
                await state.release()
        finally:
            job = state.release_job
            if job is not None and not job.done():
                self._track(job)

    def submit_release(self, state: Releasable, wait: bool) -> concurrent.futures.Future[None]:
        """Start releasing `state` (allowed while close() runs: it is what close() waits
        for)."""
        return self.io.submit(self.release_state(state, wait))

    def release(self, state: Releasable, wait: bool) -> None:
        """The sync facade's release (see :meth:`amqp_locks.Lease.release`). After close()
        there is nothing left to do: the close released every lease (or closed the
        connection, which frees them); only an unconfirmed release is still reported."""
        if self._closed:
            if wait and state.release_failure is not None:
                raise ReleaseUnconfirmed(
                    f"release of {state.kind} {state.number} of {state.name!r} not "
                    f"confirmed: {state.release_failure}"
                )
            return
        fut = self.submit_release(state, wait)
        # wait=False: handed to the connection; a broker that stopped answering does not
        # hold the caller (the release goes on, tracked; close() waits for it, and the loss
        # watchdog frees the lock with a connection that stays silent).
        if not wait and not _handed_off(fut, state, "answered"):
            return
        self.wait(fut)

    def release_leaving(self, state: Releasable) -> None:
        """Leaving a `with` block: the release and the broker's confirmation of it, so a
        process that reads ``locked()`` next sees the lock free (a queue's delete-ok, a
        commit-ok, or a barrier on the holding channel: :meth:`HeldState.release_confirmed`).
        Bounded like a plain release: a broker that stopped answering does not hold the
        block's exit longer than RELEASE_HANDOFF (the release goes on, tracked), and an
        unconfirmed release is logged, never raised over the block's own outcome (the
        broker frees the lock when it sees the connection end; ``on_lost`` reports it)."""
        if self._closed:
            return
        fut = self.submit_release(state, True)
        if not _handed_off(fut, state, "confirmed"):
            return
        try:
            fut.result(0)
        except ReleaseUnconfirmed as exc:
            log.warning("%s", exc)
        except concurrent.futures.TimeoutError as exc:  # the release's own, e.g. BrokerTimeout
            log.warning(
                "release of %s %s of %r not confirmed: %s",
                state.kind,
                state.number,
                state.name,
                exc,
            )

    # --- closing ------------------------------------------------------------------------

    async def _shutdown(self, timeout: float) -> None:
        """close() on the I/O loop, in order, within `timeout` seconds for steps 1-2:

        1. cancel every caller's operation (their callers get BrokerClosed; a waiter is
           not granted what step 2 frees);
        2. complete the releases in flight and release the leases still held, each as its
           kind does (its notice or give-back sent, a token's commit answered);
        3. close the session: what is still held (a release that did not finish in time)
           is freed by the broker with the connection.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ops = [t for t in self._ops if not t.done()]
        for task in ops:
            task.cancel()
        if ops:
            await asyncio.wait(ops, timeout=max(0.0, deadline - loop.time()))
        session = self._session
        held = list(session.leases) if session is not None and session.alive else []
        pending = {f for f in self._releases if not f.done()}
        pending.update(loop.create_task(self.release_state(state, wait=False)) for state in held)
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
            # What those releases left running (a token's give-back) counts too.
            jobs = {f for f in self._releases if not f.done()}
            if jobs:
                await asyncio.wait(jobs, timeout=max(0.0, deadline - loop.time()))
            late = sum(1 for f in self._releases if not f.done())
            if late:
                log.info(
                    "%d release(s) unfinished after %.1fs: the connection's close frees them",
                    late,
                    timeout,
                )
        if self._session is not None:
            await self._session.close()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the connection: waiting operations end in BrokerClosed, releases in flight
        and the leases still held are released (within `timeout` seconds; then the
        connection's close frees the rest), then the connection is closed."""
        if self._closed:
            return
        self._closing = True
        io = self._io
        if io is not None and io.alive:
            try:
                # The session's own close has bounded steps of its own after ours.
                io.submit(self._shutdown(timeout)).result(timeout + SESSION_CLOSE_BOUND)
            except Exception:
                log.debug("error while closing the connection", exc_info=True)
        self._closed = True
        if io is not None:
            io.stop()

    @property
    def closed(self) -> bool:
        return self._closed
