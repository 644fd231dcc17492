"""One incarnation of the AMQP connection, and the operations every lock is built from.

A :class:`Session` lives on the I/O loop. It owns the aiormq connection, a pool of
channels (a channel-breaking error costs only that channel), the pipelined existence probes,
and the loss watchdog: when no byte has arrived from the broker for ``loss_timeout`` seconds
(two missed heartbeats), or the broker has answered nothing we sent for as long (it may not
hear us: a one-way partition lets its heartbeats through), every lease held through the
session is marked lost *before* the transport is aborted, so the holder learns of the loss
before the broker can re-grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiormq
import aiormq.exceptions as ex
from aiormq.abc import AbstractChannel, ChannelFrame
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from yarl import URL

from ..errors import AmqpLocksError, ConnectionLost, QueueNotFound, ResourceLocked
from .aiormq_compat import LOGGER_NAMES, TimedTransport, connection_blocked
from .errors import censor, channel_error, connect_error
from .holders import HeldLeases, HolderReader, HolderResponder, default_holder_id
from .ports import LostCallback
from .quorum_guard import ClusterTiming, QuorumGuard
from .shield import close_quietly

log = logging.getLogger("amqp_locks.transport")

CLOSED_BY_CLIENT = "closed by the client"

_CHANNEL_ERRORS = (ex.AMQPError, ConnectionError, ex.ChannelInvalidStateError, RuntimeError)

#: The watchdog asks the broker for a reply this many times per ``loss_timeout``.
PINGS_PER_LOSS_TIMEOUT = 4
#: Idle holder channels kept per kind (more are closed): one per concurrent holder.
HOLDER_POOL = 16
#: Spare ready channels kept open for the next leases' watch and sentinel consumers.
READY_SPARES = 2
#: Ready channels kept when leases give theirs back (more are closed).
READY_POOL = 16
#: Spare pooled channels for single RPCs kept open after an error closed one: a waiter's
#: refused attempt (405) costs its channel, and the attempt its wake-up notice starts
#: should not wait for a `channel.open` + `confirm.select`.
CALL_SPARES = 1


class _OwnCancelsFilter(logging.Filter):
    """aiormq warns on every broker-side consumer cancel; for us those are expected
    (our own release deletes the watched queue) and leases log the ones that matter."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Consumer %r cancelled by the broker")


logging.getLogger("aiormq.channel").addFilter(_OwnCancelsFilter())

#: Event loops our sessions run on (the Broker's I/O threads): what aiormq logs there is
#: about our connections.
_OUR_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

#: The broker saying we broke the protocol, or a frame we could not parse: worth a
#: traceback, unlike the other ways a connection ends.
_PROTOCOL_ERRORS = (
    ex.ConnectionSyntaxError,
    ex.ConnectionFrameError,
    ex.ConnectionCommandInvalid,
    ex.ConnectionUnexpectedFrame,
    ex.ConnectionNotImplemented,
    ex.ProtocolSyntaxError,
)
_CONNECTION_FORCED = 320


def _expected(record: logging.LogRecord) -> bool:
    """A connection ending as connections do (reset, EOF, timeout, a broker's forced
    close), which the session reports itself, once, with the reason; a connection attempt
    failing, which the caller gets as an exception; or a channel closed because we
    cancelled its call (a timed-out acquire, a closing Broker)."""
    msg = str(record.msg)
    if msg.startswith("Closing channel") and "cancelled" in msg:
        return True
    if msg.startswith("error when creating transport"):
        return True  # the caller gets it as BrokerUnreachable (connect_error)
    if msg.startswith("Unexpected connection close from remote"):
        return len(record.args or ()) >= 2 and record.args[1] == _CONNECTION_FORCED  # type: ignore[index]
    exc = record.exc_info[1] if record.exc_info else None
    return isinstance(exc, (ConnectionError, OSError, asyncio.IncompleteReadError)) and (
        not isinstance(exc, _PROTOCOL_ERRORS)
    )


class _OwnConnectionsFilter(logging.Filter):
    """aiormq logs an ordinary connection loss as a WARNING with two chained tracebacks
    ("Cancelling cause reader exited abnormally" ... "AMQPConnectionError: Server
    connection reset") and a broker's close as an ERROR: on a user's stderr through
    logging's last resort when the application configured no logging, for a loss the lease
    already reports; and a WARNING for every channel whose call we cancelled. Records
    emitted on our I/O loops go to `amqp_locks.transport` instead: DEBUG for those, their
    own level (with the traceback) for the rest (a malformed frame, a protocol error).
    Other aiormq users' records pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return True
        if loop not in _OUR_LOOPS:
            return True
        level = logging.DEBUG if _expected(record) else record.levelno
        log.log(level, "aiormq: %s", record.getMessage(), exc_info=record.exc_info)
        return False


for _name in LOGGER_NAMES:
    logging.getLogger(_name).addFilter(_OwnConnectionsFilter())


class Session:
    """One live AMQP connection; dies once, never reconnects (the Broker makes a new one)."""

    def __init__(
        self,
        url: URL,
        *,
        heartbeat: float,
        loss_timeout: float,
        connection_name: str,
        cluster: bool = False,
        ssl_context: ssl.SSLContext | None = None,
        holder_id: str | None = None,
        timing: ClusterTiming | None = None,
    ) -> None:
        self.url = url
        #: What this connection's holder records say (transport/holders.py).
        self.holder_id = holder_id or default_holder_id()
        #: For ``amqps://`` URLs; None lets aiormq build one from the URL's options.
        self.ssl_context = ssl_context
        #: The broker is one node of a cluster (see `Broker(cluster=...)`): quorum queues
        #: are read by consumers, never `basic.get` (fencing.take_token says why).
        self.cluster = cluster
        #: Cluster mode's timing (transport/quorum_guard.py); its guard runs per session.
        self.timing = timing or ClusterTiming()
        self.guard: QuorumGuard | None = None
        self._guard_task: asyncio.Task[None] | None = None
        self.heartbeat = heartbeat
        self.loss_timeout = loss_timeout
        self.connection_name = connection_name
        self.last_rx = time.monotonic()
        #: When the newest request the broker answered was sent: the broker had read all
        #: we sent until then (its heartbeat timeout counts from the last frame it read).
        self.heard_at = time.monotonic()
        self.transport_writer: asyncio.StreamWriter | None = None
        self.conn: aiormq.Connection | None = None
        self.lost_reason: str | None = None
        self.held: set[str] = set()
        self.fences_known: set[str] = set()
        #: Locks this session checked are not also used in the other mode (mutex.py).
        self.modes_checked: set[str] = set()
        #: When this process last released each lock, by wake-up queue, and whether its
        #: wake-up notice found the queue, i.e. someone waits (waiting.py lets the waiters
        #: go first when it asks again at once).
        self.released_at: dict[str, tuple[float, asyncio.Future[bool]]] = {}
        #: Sentinel queues declared on this connection (declared once, not per grant).
        self.sentinels_declared: set[str] = set()
        #: The slot this process released last, per semaphore (tried first next time).
        self.slot_hints: dict[str, int] = {}
        #: Last size seen per semaphore: where the next slot search's first window ends.
        self.size_hints: dict[str, int] = {}
        #: Last token-semaphore ledger version read per name (tokens/ledger.py).
        self.ledger_versions: dict[str, int] = {}
        #: Locks held through this session (released cleanly on Broker.close()); holding
        #: a name keeps it bound to our holder queue, so readers can ask who holds it.
        self.leases = HeldLeases(HolderResponder(self))
        self._holder_reader: HolderReader | None = None
        #: Waiters sleeping on wake-up queues (woken when the session dies).
        self.waiters: set[Any] = set()
        self._listeners: dict[int, LostCallback] = {}
        self._next_listener = 0
        self._idle: list[AbstractChannel] = []
        #: Channels ready to hold a token (prefetch 1 set; transactional ones for the
        #: token semaphore's counter-carrying release), so an acquire opens none.
        self._holder_idle: dict[bool, list[AbstractChannel]] = {False: [], True: []}
        #: Spare channels with prefetch 1 set (`ready_channel`).
        self._ready: list[AbstractChannel] = []
        #: Spares being opened per pool (`_refill`), by the pool's id.
        self._opening: dict[int, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watchdog_task: asyncio.Task[None] | None = None
        self._ping_task: asyncio.Task[None] | None = None

    # --- life cycle ---------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        hb = max(1, round(self.heartbeat))
        url = self.url.update_query(heartbeat=str(hb))
        _OUR_LOOPS.add(asyncio.get_running_loop())
        self.conn = aiormq.Connection(
            url,
            context=self.ssl_context,
            transport_factory=TimedTransport(url, self._heard_bytes, self._got_writer),
            client_properties={"connection_name": self.connection_name},
        )
        try:
            await asyncio.wait_for(self.conn.connect(), timeout)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await self.conn.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise connect_error(exc, self.url) from exc
        self.last_rx = self.heard_at = time.monotonic()
        self.conn.closing.add_done_callback(self._on_connection_closed)
        loop = asyncio.get_running_loop()
        if self.cluster:
            self.guard = QuorumGuard(self, self.timing, self.drop, self._probe_link)
            try:
                await self.guard.prepare(timeout)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.conn.close()
                raise
            self._guard_task = loop.create_task(self.guard.run())
        self._watchdog_task = loop.create_task(self._watchdog())
        self._ping_task = loop.create_task(self._pinger())
        log.debug("connected to %s as %r", censor(self.url), self.connection_name)

    async def _probe_link(self) -> Session:
        """The quorum guard's own connection to this session's node (quorum_guard.py)."""
        link = Session(
            self.url,
            heartbeat=self.heartbeat,
            loss_timeout=self.loss_timeout,
            connection_name=f"{self.connection_name} (quorum probe)",
            ssl_context=self.ssl_context,
            holder_id=self.holder_id,
        )
        await link.connect(self.loss_timeout)
        return link

    @property
    def alive(self) -> bool:
        return self.lost_reason is None and self.conn is not None and not self.conn.is_closed

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run a background task tied to this session (kept referenced until done)."""
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _watchdog(self) -> None:
        """Declare the connection dead after `loss_timeout` of silence from the broker, or
        of no answer to what we sent (heartbeats only prove the broker talks to us)."""
        step = max(0.05, min(1.0, self.loss_timeout / 10))
        while self.alive:
            await asyncio.sleep(step)
            now = time.monotonic()
            if self._blocked():
                # A resource alarm: the broker stops reading us and pauses its own
                # heartbeat timeout for us, so an unanswered ping means nothing yet.
                self.heard_at = now
            silent, unheard = now - self.last_rx, now - self.heard_at
            if silent > self.loss_timeout:
                reason = f"no frame from the broker for {silent:.1f}s (missed heartbeats)"
            elif unheard > self.loss_timeout:
                reason = (
                    f"the broker answered nothing we sent for {unheard:.1f}s "
                    "(it may not hear us: heartbeats arrive one way only)"
                )
            else:
                continue
            self.drop(reason)
            return

    async def _pinger(self) -> None:
        """Ask for a reply (`basic.qos` on a channel of its own) `PINGS_PER_LOSS_TIMEOUT`
        times per `loss_timeout`: each answer moves `heard_at` to when it was asked."""
        interval = self.loss_timeout / PINGS_PER_LOSS_TIMEOUT
        ch: AbstractChannel | None = None
        while self.alive:
            try:
                if ch is None or ch.is_closed:
                    ch = await self.open_channel()
                asked = time.monotonic()
                await ch.basic_qos(prefetch_count=0)
                self.heard_at = max(self.heard_at, asked)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watchdog decides; a broken channel is reopened
                log.debug("ping on %r failed: %s", self.connection_name, exc)
            await asyncio.sleep(interval)

    def _blocked(self) -> bool:
        """RabbitMQ sent connection.blocked (a resource alarm) and not yet unblocked."""
        return connection_blocked(self.conn)

    def _heard_bytes(self, at: float) -> None:
        self.last_rx = at

    def _got_writer(self, writer: asyncio.StreamWriter) -> None:
        self.transport_writer = writer

    def _on_connection_closed(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            reason = "connection closed"
        else:
            exc = fut.exception()
            reason = f"connection closed: {exc}" if exc else "connection closed"
        self._lose(reason)

    def drop(self, reason: str) -> None:
        """Give the connection up for `reason`: every lease through it is lost at once and
        the socket is aborted (the broker then drops what the connection held)."""
        if self.alive:
            self._lose(reason)
            if self.transport_writer is not None:
                self.transport_writer.transport.abort()

    def _lose(self, reason: str) -> None:
        """Mark the session lost and tell every listener (leases) at once."""
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        level = logging.DEBUG if reason == CLOSED_BY_CLIENT else logging.WARNING
        log.log(level, "connection %r ended: %s", self.connection_name, reason)
        listeners = list(self._listeners.values())
        self._listeners.clear()
        for cb in listeners:
            try:
                cb(reason)
            except Exception:
                log.exception("lost-listener failed")
        for waiter in list(self.waiters):
            waiter.event.set()

    async def close(self) -> None:
        """Release every lease cleanly (waiters get their notices), then close."""
        if self.alive:
            for lease in list(self.leases):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(lease.release(), 5.0)
        if self.lost_reason is None:
            self._lose(CLOSED_BY_CLIENT)
        if self._tasks:  # let channel closes and notices started by releases finish
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for task in list(self._tasks):
            task.cancel()
        if self.guard is not None:
            await self.guard.aclose()
        for job in (self._watchdog_task, self._ping_task, self._guard_task):
            if job is not None:
                job.cancel()
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.conn.close(), 5.0)

    @property
    def holder_reader(self) -> HolderReader:
        """Asks other connections who holds a lock (created on first use)."""
        if self._holder_reader is None:
            self._holder_reader = HolderReader(self)
        return self._holder_reader

    def add_listener(self, cb: LostCallback) -> int:
        """Call `cb(reason)` when the session is lost; returns a handle for removal."""
        if self.lost_reason is not None:
            cb(self.lost_reason)
            return -1
        self._next_listener += 1
        self._listeners[self._next_listener] = cb
        return self._next_listener

    def remove_listener(self, handle: int) -> None:
        self._listeners.pop(handle, None)

    def check(self) -> None:
        if not self.alive:
            raise ConnectionLost(f"connection to {censor(self.url)} lost: {self.lost_reason}")

    # --- channels -----------------------------------------------------------------------

    async def open_channel(self) -> AbstractChannel:
        self.check()
        assert self.conn is not None
        try:
            return await self.conn.channel(publisher_confirms=True)
        except _CHANNEL_ERRORS as exc:
            raise channel_error(exc) from exc

    def idle_holder_channel(self, transactional: bool) -> AbstractChannel | None:
        """A pooled holder channel, if one is idle (no round trip, no await)."""
        return _take_open(self._holder_idle[transactional])

    async def holder_channel(self, transactional: bool) -> AbstractChannel:
        """A channel with prefetch 1 (and, if `transactional`, tx selected) for holding a
        token; hand it back with :meth:`return_holder_channel` once it holds nothing."""
        ch = self.idle_holder_channel(transactional)
        if ch is not None:
            return ch
        self.check()
        assert self.conn is not None
        try:
            # Transactions and publisher confirms exclude each other on a channel.
            ch = await self.conn.channel(publisher_confirms=not transactional)
            await ch.basic_qos(prefetch_count=1)
            if transactional:
                await ch.tx_select()
        except _CHANNEL_ERRORS as exc:
            raise channel_error(exc) from exc
        return ch

    async def ready_channel(self) -> AbstractChannel:
        """A fresh channel with prefetch 1 already set, for one lease's watch or sentinel
        consumers (handed back clean by `recycle_ready` when the lease ends, else closed).
        Spares are opened in the background so an acquire waits for none."""
        ch = _take_open(self._ready) or await self._open_ready()
        self._refill_ready()
        return ch

    async def _open_ready(self) -> AbstractChannel:
        self.check()
        assert self.conn is not None
        try:
            ch = await self.conn.channel(publisher_confirms=True)
            await ch.basic_qos(prefetch_count=1)
        except _CHANNEL_ERRORS as exc:
            raise channel_error(exc) from exc
        return ch

    def _refill_ready(self) -> None:
        self._refill(self._ready, READY_SPARES, self._open_ready)

    def _refill(
        self,
        pool: list[AbstractChannel],
        spares: int,
        opener: Callable[[], Awaitable[AbstractChannel]],
    ) -> None:
        """Open channels for `pool` in the background until it holds `spares` (counting
        those still being opened), so the next taker waits for none."""
        opening = self._opening.get(id(pool), 0)
        for _ in range(max(0, spares - len(pool) - opening) if self.alive else 0):
            self._opening[id(pool)] = self._opening.get(id(pool), 0) + 1
            self.spawn(self._add_spare(pool, opener))

    async def _add_spare(
        self, pool: list[AbstractChannel], opener: Callable[[], Awaitable[AbstractChannel]]
    ) -> None:
        try:
            ch = await opener()
        except AmqpLocksError as exc:
            log.debug("could not open a spare channel: %s", exc)
        else:
            self._keep(pool, ch, READY_POOL)
        finally:
            self._opening[id(pool)] -= 1

    def return_ready(self, ch: AbstractChannel) -> None:
        """Keep a ready channel that was taken but never used (clean as it came)."""
        self._keep(self._ready, ch, READY_POOL)

    def recycle_ready(self, ch: AbstractChannel, clean: Callable[[], Awaitable[Any]]) -> None:
        """In the background, run `clean` (what makes `ch` a clean ready channel again:
        prefetch 1, no consumer, nothing unacked) and keep the channel for the next lease;
        a channel that fails to clean is closed (what it holds goes back)."""

        async def go() -> None:
            try:
                await clean()
            except Exception:
                await close_quietly(ch)
            else:
                self._keep(self._ready, ch, READY_POOL)

        self.spawn(go())

    def return_holder_channel(self, ch: AbstractChannel, transactional: bool) -> None:
        """Keep a channel that holds no delivery and no consumer for the next acquire."""
        self._keep(self._holder_idle[transactional], ch, HOLDER_POOL)

    def _keep(self, pool: list[AbstractChannel], ch: AbstractChannel, size: int) -> None:
        """Put a clean channel in `pool` (at most `size`); close it if the pool is full."""
        if self.alive and not ch.is_closed and len(pool) < size:
            pool.append(ch)
        elif not ch.is_closed and self.alive:
            self.spawn(close_quietly(ch))

    @contextlib.asynccontextmanager
    async def channel(self) -> AsyncIterator[AbstractChannel]:
        """A pooled channel; one broken by an error is dropped, never reused."""
        ch = self._idle.pop() if self._idle else await self.open_channel()
        while ch.is_closed:
            ch = self._idle.pop() if self._idle else await self.open_channel()
        try:
            yield ch
        except BaseException:
            # Errors and cancellations may leave replies in flight on this channel
            # (confirms of cancelled probes): never hand it to someone else.
            if not ch.is_closed and self.alive:
                self.spawn(close_quietly(ch))
            self._refill(self._idle, CALL_SPARES, self.open_channel)
            raise
        if not ch.is_closed and self.alive:
            self._idle.append(ch)

    async def call(self, queue: str | None, op: Callable[[AbstractChannel], Any]) -> Any:
        """Run one RPC on a pooled channel, translating errors to typed ones."""
        async with self.channel() as ch:
            try:
                return await op(ch)
            except AmqpLocksError:
                raise
            except _CHANNEL_ERRORS as exc:
                if not self.alive:
                    raise ConnectionLost(
                        f"connection to {censor(self.url)} lost: {self.lost_reason}"
                    ) from exc
                raise channel_error(exc, queue) from exc

    # --- queue operations ---------------------------------------------------------------

    async def declare(
        self,
        queue: str,
        *,
        durable: bool = False,
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> int:
        """Declare `queue`; returns its message count."""
        ok = await self.call(
            queue,
            lambda ch: ch.queue_declare(
                queue, durable=durable, exclusive=exclusive, arguments=arguments
            ),
        )
        return int(ok.message_count or 0)

    async def delete(self, queue: str) -> None:
        """Delete `queue` and wait for delete-ok (deleting a missing queue is not an error)."""
        await self.call(queue, lambda ch: ch.queue_delete(queue))

    async def declare_passive_counts(self, queue: str) -> tuple[int, int]:
        """Passive declare: (ready messages, consumers); raises QueueNotFound."""
        ok = await self.call(queue, lambda ch: ch.queue_declare(queue, passive=True))
        return int(ok.message_count or 0), int(ok.consumer_count or 0)

    async def declare_passive_count(self, queue: str) -> int:
        return (await self.declare_passive_counts(queue))[0]

    async def exists_passive(self, queue: str) -> bool:
        """Passive declare: True if the queue exists and this connection may use it."""
        try:
            await self.call(queue, lambda ch: ch.queue_declare(queue, passive=True))
        except (QueueNotFound, ResourceLocked):
            return False
        return True

    async def probe(self, queues: Sequence[str]) -> list[bool]:
        """Existence of each queue by mandatory publish with confirms, all in one round trip.

        A NO_ROUTE return (always sent before the ack) means the queue is absent. Probe
        messages expire at once (and our queues have ``x-max-length: 0``): nothing is left.
        """
        if not queues:
            return []
        found: list[bool] = await self.call(None, lambda ch: _bulk_probe(ch, queues))
        return found

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes = b"",
        *,
        persistent: bool = False,
        mandatory: bool = False,
    ) -> bool:
        """Publish with confirm; `persistent` for records that must survive a restart.
        With `mandatory`, False when no queue took it (the broker returned it)."""
        props = Basic.Properties(delivery_mode=2 if persistent else 1)

        async def send(ch: AbstractChannel) -> bool:
            try:
                await ch.basic_publish(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=props,
                    mandatory=mandatory,
                )
            except ex.PublishError:  # returned: the channel stays usable
                return False
            return True

        routed: bool = await self.call(None, send)
        return routed

    def notify_soon(self, wakeup_queue: str, slots: Sequence[int] = (0,)) -> asyncio.Future[bool]:
        """Fire-and-forget wake-up notices, one per freed slot, each naming its slot (a
        hint for the woken waiter; 0: no hint). Nobody waiting means no queue, and the
        notice is simply dropped; a lost notice costs a waiter one back-off interval.

        The returned future says whether a notice found the queue (someone waits); it is
        False when the notices were returned, lost, or could not be sent."""

        async def go() -> bool:
            try:
                if len(slots) == 1:  # the usual case: written in this task's first step
                    return await self.publish(
                        "", wakeup_queue, str(slots[0]).encode(), mandatory=True
                    )
                routed = await asyncio.gather(
                    *(
                        self.publish("", wakeup_queue, str(k).encode(), mandatory=True)
                        for k in slots
                    )
                )
            except AmqpLocksError:
                return False
            return any(routed)

        if self.alive:
            return self.spawn(go())
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        done.set_result(False)
        return done


def _take_open(pool: list[AbstractChannel]) -> AbstractChannel | None:
    """The newest channel of `pool` still open (closed ones are dropped), or None."""
    while pool:
        ch = pool.pop()
        if not ch.is_closed:
            return ch
    return None


async def _bulk_probe(ch: AbstractChannel, queues: Sequence[str]) -> list[bool]:
    """Write every probe publish in one buffer, then await all the confirms.

    aiormq's `basic_publish` costs ~0.2 ms of client CPU per message (a write-queue round
    and a future per frame set); a search over 1000 slots sends 2000 probes. Here the
    publishes are registered in the channel's own confirm bookkeeping (`confirmations`,
    `message_id_delivery_tag`, exactly what `basic_publish` does) and marshalled together.
    """
    if not hasattr(ch, "confirmations") or not hasattr(ch, "message_id_delivery_tag"):
        return await _probe_one_by_one(ch, queues)  # pragma: no cover - other aiormq
    chan: Any = ch
    pending: list[tuple[asyncio.Future[Any], str]] = []
    frames: list[Any] = []
    async with chan.lock:
        for q in queues:
            chan.delivery_tag += 1
            tag = chan.delivery_tag
            message_id = f"amqp-locks-probe-{id(ch):x}-{tag}"
            fut: asyncio.Future[Any] = chan.create_future()
            chan.confirmations[tag] = fut
            chan.message_id_delivery_tag[message_id] = tag
            props = Basic.Properties(delivery_mode=1, expiration="0", message_id=message_id)
            frames.append(Basic.Publish(routing_key=q, mandatory=True))
            frames.append(ContentHeader(properties=props, body_size=0))
            pending.append((fut, message_id))
        await chan.write_queue.put(ChannelFrame.marshall(channel_number=chan.number, frames=frames))
    try:
        results = await asyncio.gather(*(f for f, _ in pending), return_exceptions=True)
    finally:
        for _, message_id in pending:
            chan.message_id_delivery_tag.pop(message_id, None)
    found: list[bool] = []
    for r in results:
        if isinstance(r, ex.PublishError):
            found.append(False)
        elif isinstance(r, ex.DeliveryError):
            found.append(True)  # nacked: the queue exists but refused the message
        elif isinstance(r, BaseException):
            raise r
        else:
            found.append(True)
    return found


async def _probe_one_by_one(ch: AbstractChannel, queues: Sequence[str]) -> list[bool]:
    async def one(q: str) -> bool:
        # A fresh properties object each time: aiormq writes the message id into it,
        # and returns are matched to publishes by that id.
        props = Basic.Properties(delivery_mode=1, expiration="0")
        try:
            await ch.basic_publish(b"", routing_key=q, mandatory=True, properties=props)
        except ex.PublishError:
            return False
        except ex.DeliveryError:
            return True
        return True

    return list(await asyncio.gather(*(one(q) for q in queues)))
