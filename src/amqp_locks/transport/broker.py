"""`Broker`: the connection every lock of a process shares, and the core both facades drive.

:class:`BrokerCore` runs on the private I/O thread and hands out the current
:class:`~amqp_locks.transport.session.Session`, opening a new one after a loss (leases of
the old one are already marked lost). :class:`Broker` is the thread-safe sync facade;
`amqp_locks.aio.Broker` is the asyncio one. Neither re-implements any protocol step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import ssl
import threading
import weakref
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar

from yarl import URL

from .. import events
from ..errors import (
    AccessRefused,
    AmqpLocksError,
    AuthenticationFailed,
    BrokerClosed,
    ClusterUnreachable,
    ConfigurationError,
    ConnectionLost,
    ReleaseUnconfirmed,
)
from .errors import censor, censor_text
from .holders import check_holder_id, default_holder_id
from .iothread import IOThread
from .ports import Releasable
from .quorum_guard import ClusterTiming
from .session import Session

log = logging.getLogger("amqp_locks.transport")

T = TypeVar("T")

#: Seconds ``Broker.close()`` gives releases in flight and held leases before it closes the
#: connection anyway (which frees whatever is still held).
CLOSE_TIMEOUT = 5.0
#: What the session's own close may take after that (its bounded waits: background tasks,
#: connection.close-ok).
SESSION_CLOSE_BOUND = 10.0

#: Where ``Broker()`` connects with no `url` and no ``$AMQP_URL``: what other AMQP clients
#: (pika, aio-pika, kombu) default to. Never a server of our own: the library starts none.
DEFAULT_URL = "amqp://guest:guest@localhost:5672/"


#: What ``Broker(url=...)`` takes: one URL, several comma-separated, or a sequence.
UrlSpec = str | Sequence[str] | None


def _parse_url(raw: str) -> URL:
    try:
        parsed = URL(raw)
        parsed.port  # noqa: B018 - yarl checks the port's range lazily
    except (TypeError, ValueError) as exc:
        # Never the password in a message: the raw text is censored, and the parser's own
        # message too (it may quote the URL); the cause is dropped for the same reason.
        raise ConfigurationError(
            f"invalid AMQP URL {censor_text(raw)!r}: {censor_text(str(exc), raw)}"
        ) from None
    if parsed.scheme not in ("amqp", "amqps") or not parsed.host:
        raise ConfigurationError(
            f"invalid AMQP URL {censor(parsed)!r}: expected amqp://user:pass@host:port/vhost"
        )
    return parsed


def resolve_urls(url: UrlSpec) -> list[URL]:
    """The nodes to connect to, in order of preference: `url`, else `$AMQP_URL`, else
    :data:`DEFAULT_URL` (a broker on this host with RabbitMQ's default user).

    A string may list several nodes of one cluster separated by commas (a comma inside a
    password must be percent-encoded as ``%2C``)."""
    if url is not None and not isinstance(url, str):
        raws = [str(u).strip() for u in url]
        if not raws:
            raise ConfigurationError("empty list of AMQP URLs")
    else:
        text = url or os.environ.get("AMQP_URL") or DEFAULT_URL
        raws = [part.strip() for part in text.split(",")]
    if any(not r for r in raws):
        raise ConfigurationError(f"empty URL in the AMQP URL list {raws!r}")
    return [_parse_url(r) for r in raws]


def resolve_url(url: str | None) -> URL:
    """The first node of :func:`resolve_urls` (for callers that want exactly one)."""
    return resolve_urls(url)[0]


def default_connection_name(purpose: str = "") -> str:
    """Connection names say host and pid, so status tools show who holds what."""
    extra = f" {purpose}" if purpose else ""
    return f"amqp-locks{extra} host={socket.gethostname()} pid={os.getpid()}"


#: Every live core, so a forked child can drop what it inherited (see `_after_fork`).
_cores: weakref.WeakSet[BrokerCore] = weakref.WeakSet()
#: What a fork child inherited of its parent's cores: kept referenced and never used, so
#: no finalizer of the child closes (or writes a goodbye frame on) the parent's connection.
_inherited: list[object] = []


def _after_fork() -> None:
    for core in list(_cores):
        core._forked()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork)


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
        self.timing = ClusterTiming.of(net_ticktime, quorum_timeout)
        plain = [censor(u) for u in self.urls if u.scheme != "amqps"]
        if ssl_context is not None and plain:
            raise ConfigurationError(
                f"ssl_context is for TLS, but {', '.join(plain)} is not amqps:// "
                "(the connection would not use it)"
            )
        self.ssl_context = ssl_context
        self.heartbeat = float(heartbeat)
        # The broker declares us dead after two heartbeat periods of silence at the
        # earliest (it checks every period, needs two checks without data). One period of
        # silence from the broker (which sends every half period) is two missed frames:
        # we give up first, with a full period of margin.
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

    def _forked(self) -> None:
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
            "no broker node reachable: "
            + "; ".join(f"{censor(u)}: {e}" for u, e in failures),
            [(censor(u), e) for u, e in failures],
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

    def _wait(self, fut: concurrent.futures.Future[T]) -> T:
        """Wait for `fut` in the calling thread. An interrupt (KeyboardInterrupt) cancels
        the coroutine, which undoes any half-made grant before it finishes; an operation
        that close() ended raises BrokerClosed (never an internal CancelledError)."""
        try:
            return fut.result()
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
        return self._wait(self.submit(coro))

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
        self._wait(self.submit_release(state, wait))

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


class BrokerLike(Protocol):
    """What the lock classes need of a broker: its core (both facades have one)."""

    _core: BrokerCore


class BrokerBase:
    """What both facades share: the arguments, and the core they drive."""

    def __init__(
        self,
        url: UrlSpec = None,
        heartbeat: float = 10.0,
        *,
        loss_timeout: float | None = None,
        connect_timeout: float = 10.0,
        connection_name: str | None = None,
        cluster: bool | None = None,
        ssl_context: ssl.SSLContext | None = None,
        holder_id: str | None = None,
        net_ticktime: float | None = None,
        quorum_timeout: float | None = None,
    ) -> None:
        self._core = BrokerCore(
            url,
            heartbeat=heartbeat,
            loss_timeout=loss_timeout,
            connect_timeout=connect_timeout,
            connection_name=connection_name,
            cluster=cluster,
            ssl_context=ssl_context,
            holder_id=holder_id,
            net_ticktime=net_ticktime,
            quorum_timeout=quorum_timeout,
        )

    @property
    def url(self) -> str:
        """The URL of the node connected to (or to be tried first), password censored."""
        return censor(self._core.url)

    @property
    def urls(self) -> list[str]:
        """Every node's URL, in the order given, passwords censored."""
        return [censor(u) for u in self._core.urls]

    @property
    def cluster(self) -> bool:
        """Cluster mode (see the class docstring): several URLs, or ``cluster=True``."""
        return self._core.cluster

    @property
    def heartbeat(self) -> float:
        return self._core.heartbeat

    @property
    def net_ticktime(self) -> float:
        """The cluster's Erlang ``net_ticktime`` cluster mode assumes (seconds)."""
        return self._core.timing.net_ticktime

    @property
    def quorum_timeout(self) -> float:
        """Cluster mode: seconds without a quorum-confirmed probe before this connection's
        locks are reported lost (transport/quorum_guard.py)."""
        return self._core.timing.quorum_timeout

    @property
    def holder_id(self) -> str:
        """What the holder records of locks held through this Broker say (``holder_id``
        given, else ``host:pid`` of this process)."""
        return self._core.holder_id or default_holder_id()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, heartbeat={self.heartbeat})"


class Broker(BrokerBase):
    """A connection to RabbitMQ, owned by a private I/O thread. Thread-safe.

    ``url`` defaults to ``$AMQP_URL``, then to ``amqp://guest:guest@localhost:5672/`` (the
    library never starts a broker of its own); several nodes
    of a cluster may be given (a list, or one string with comma-separated URLs): the
    Broker connects to the first that answers and, when that connection is lost, to the
    next one (leases held through the lost connection are reported lost). ``cluster``
    (default: whether several URLs were given) says the broker is a cluster whose queue
    leaders can die: fencing tokens are then read by a consumer, because RabbitMQ answers
    a ``basic.get`` on a quorum queue without a leader by closing the whole connection;
    set it for a single URL that fronts a cluster (a load balancer). ``heartbeat``
    (seconds) bounds how long a dead peer goes unnoticed; leases are marked lost after
    ``loss_timeout`` (default: one heartbeat period) without a frame from the broker.

    In cluster mode every connection also proves, every few seconds, that its node is on
    the cluster's majority side (a probe confirmed by a quorum queue): after
    ``quorum_timeout`` seconds without such a proof (default ``net_ticktime / 2``) its
    locks are reported lost and it moves to another node, before the majority can grant
    them again. ``net_ticktime`` is the cluster's Erlang setting (default 60, RabbitMQ's);
    give the value your nodes run with (docs/cluster.md).

    TLS: an ``amqps://`` URL connects over TLS, verifying the broker's certificate against
    the system's CAs, or against ``?cafile=PATH`` (also ``certfile``, ``keyfile`` for a
    client certificate; aiormq's URL options); or pass ``ssl_context`` (an
    :class:`ssl.SSLContext`) for full control.

    ``holder_id`` (default ``host:pid``) is what readers of this Broker's locks see as
    their holder (``Mutex.holder()``, ``amqp-locks status``): every client of the vhost
    can read it, so it must not be a secret (1-128 printable characters, not a URL).
    """

    def connect(self) -> Broker:
        """Open the connection now (it otherwise opens on first use); raises typed errors."""
        self._core.run(self._core.session())
        return self

    def round_trip(self) -> None:
        """One broker round trip (a passive declare of `amq.direct`'s twin queue check)."""

        async def rt() -> None:
            session = await self._core.session()
            await session.call(None, lambda ch: ch.exchange_declare("amq.direct", passive=True))

        self._core.run(rt())

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the connection. Every thread waiting on this Broker (an acquire, an admin
        call) gets :class:`~amqp_locks.errors.BrokerClosed` at once; releases in flight
        and the leases still held are released first, within `timeout` seconds (then the
        connection's close frees whatever is left). Using the Broker afterwards raises
        BrokerClosed."""
        self._core.close(timeout)

    def __enter__(self) -> Broker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
