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
from typing import Any

import aiormq
from aiormq.abc import AbstractChannel
from yarl import URL

from ..errors import ConnectionLost
from .aiormq_compat import (
    ChannelNumbers,
    TimedTransport,
    connection_blocked,
    keep_every_close_ok,
)
from .errors import censor, connect_error
from .holders import HeldLeases, HolderReader, HolderResponder, default_holder_id
from .logfilters import OUR_LOOPS
from .ports import LostCallback
from .queue_ops import QueueOps
from .quorum_guard import ClusterTiming, QuorumGuard
from .recent import RecentDict, RecentSet

log = logging.getLogger("amqp_locks.transport")

CLOSED_BY_CLIENT = "closed by the client"

#: The watchdog asks the broker for a reply this many times per ``loss_timeout``.
PINGS_PER_LOSS_TIMEOUT = 4

#: Silence from the broker, in heartbeat periods, taken for a loss while it blocks us (a
#: resource alarm). Idle, RabbitMQ sends a heartbeat every full period, not every half
#: (rabbit_heartbeat.erl: it checks every half period and counts its own heartbeat as
#: traffic), so one period of silence is normal then: CI on 3.10.8 saw 1.0x s and gave up
#: a held lock. The broker drops us no sooner than 2 periods after the last frame it read
#: (3 after it resumes reading), so 1.5 keeps half a period of margin.
BLOCKED_SILENCE = 1.5

#: Seconds a connection given up waits for its test-and-set creations before its socket
#: is aborted (Session.drop).
CREATE_SETTLE = 5.0


class Session(QueueOps):
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
        #: When the watchdog last found the connection healthy, and when it last woke
        #: late (this process had not run) and put its judgement off by one step.
        self.judged_at = 0.0
        self.stalled_at = 0.0
        #: Late wakes seen (each put one judgement off), for logs and tests.
        self.stalls = 0
        #: Set by the watchdog after a stall: the pinger asks at once.
        self._ping_now = asyncio.Event()
        self.transport_writer: asyncio.StreamWriter | None = None
        self.conn: aiormq.Connection | None = None
        self.lost_reason: str | None = None
        self.held: set[str] = set()
        #: Fence queues that answered a take on this connection. This and every per-name
        #: map below remember the names used last only (recent.py): a process may use
        #: names without end.
        self.fences_known: RecentSet[str] = RecentSet()
        #: The newest generation seen per fence shard (fencing.py: where a take starts).
        self.fence_gens: RecentDict[int, int] = RecentDict()
        #: Locks this session checked are not also used in the other mode (mutex.py).
        self.modes_checked: RecentSet[str] = RecentSet()
        #: When this process last released each lock, by wake-up queue, and whether its
        #: wake-up notice found the queue, i.e. someone waits (waiting.py lets the waiters
        #: go first when it asks again at once).
        self.released_at: RecentDict[str, tuple[float, asyncio.Future[bool]]] = RecentDict()
        #: (permits, lock delay ms) read from the arguments of a lock queue whose tokens
        #: say no shape (minted by an earlier release; shape.py): read once per queue and
        #: session, forgotten when the session sees the queue gone.
        self.shapes_read: RecentDict[str, tuple[int | None, int | None]] = RecentDict()
        #: First-use quorum queues this session saw running, with when: a consume of one
        #: seen lately needs no check first (tokens/fresh.py, until_running).
        self.running_seen: RecentDict[str, float] = RecentDict()
        #: Since when such a queue has shown this session neither a message nor a
        #: consumer (still starting, or tokenless): counted across acquires.
        self.quiet_since: RecentDict[str, float] = RecentDict()
        #: Runs of samples that showed a first-use queue short of its tokens
        #: (tokens/heal.py), by queue: counted across acquires.
        self.heal_runs: RecentDict[str, Any] = RecentDict()
        #: Sentinel queues declared on this connection (declared once, not per grant).
        self.sentinels_declared: RecentSet[str] = RecentSet()
        #: The slot this process released last, per semaphore (tried first next time).
        self.slot_hints: RecentDict[str, int] = RecentDict()
        #: Last size seen per semaphore: where the next slot search's first window ends.
        self.size_hints: RecentDict[str, int] = RecentDict()
        #: Whether each semaphore's slots are quorum queues, as its marker said when last
        #: asked (semaphore/burial.py: such slots are looked at tombstones first).
        self.quorum_slots: RecentDict[str, bool] = RecentDict()
        #: Last token-semaphore ledger version read per name (tokens/ledger.py).
        self.ledger_versions: RecentDict[str, int] = RecentDict()
        #: Locks held through this session (released cleanly on Broker.close()); holding
        #: a name keeps it bound to our holder queue, so readers can ask who holds it.
        self.leases = HeldLeases(HolderResponder(self))
        self._holder_reader: HolderReader | None = None
        #: Waiters sleeping on wake-up queues (woken when the session dies).
        self.waiters: set[Any] = set()
        self._listeners: dict[int, LostCallback] = {}
        self._next_listener = 0
        self._init_pools()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The tasks among them that wait on purpose (`spawn(deferred=True)`).
        self.deferred: set[asyncio.Task[Any]] = set()
        self.creating = set()
        self._watchdog_task: asyncio.Task[None] | None = None
        self._ping_task: asyncio.Task[None] | None = None

    # --- life cycle ---------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        hb = max(1, round(self.heartbeat))
        url = self.url.update_query(heartbeat=str(hb))
        OUR_LOOPS.add(asyncio.get_running_loop())
        self.numbers = ChannelNumbers()
        self.conn = aiormq.Connection(
            url,
            context=self.ssl_context,
            transport_factory=TimedTransport(
                url, self._heard_bytes, self._got_writer, self.numbers
            ),
            client_properties={"connection_name": self.connection_name},
        )
        keep_every_close_ok(self.conn)
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
    def queue_types(self) -> tuple[bool, bool]:
        """Quorum or not, in the order a lock's queue is looked for: this Broker's mode's
        own type first, then the other (a lock made by a client of the other mode is
        still found, and its shape or mode refused)."""
        return (self.cluster, not self.cluster)

    @property
    def alive(self) -> bool:
        return self.lost_reason is None and self.conn is not None and not self.conn.is_closed

    def spawn(self, coro: Any, *, deferred: bool = False) -> asyncio.Task[Any]:
        """Run a background task tied to this session (kept referenced until done). A
        `deferred` one waits on purpose before it acts (a fence generation's retirement,
        RETIRE_AFTER later) and may be dropped (a later take does its work): closing
        cancels it at once instead of waiting for it."""
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if deferred:
            self.deferred.add(task)
            task.add_done_callback(self.deferred.discard)
        return task

    async def _watchdog(self) -> None:
        """Declare the connection dead after `loss_timeout` of silence from the broker, or
        of no answer to what we sent (heartbeats only prove the broker talks to us)."""
        step = max(0.05, min(1.0, self.loss_timeout / 10))
        woke = time.monotonic()
        put_off = False
        while self.alive:
            await asyncio.sleep(step)
            now = time.monotonic()
            slept, woke = now - woke, now
            if slept > 2 * step and not put_off:
                # This process did not run for a while (a GIL held by user code, a
                # starved machine): the broker's answers may wait unread in the socket,
                # and no ping went out meanwhile, so the silence is ours, not the
                # broker's. Ping now and judge one step later; a second late wake in a
                # row is judged as it is, so a loss is told at most one step later.
                put_off = True
                self.stalled_at = now
                self.stalls += 1
                log.debug(
                    "%r: the I/O loop did not run for %.1fs; next judgement in %.2fs",
                    self.connection_name,
                    slept,
                    step,
                )
                self._ping_now.set()
                continue
            put_off = False
            silence_limit = self.loss_timeout
            if self._blocked():
                # A resource alarm: the broker stops reading us and pauses its own
                # heartbeat timeout for us, so an unanswered ping means nothing yet, and
                # its heartbeats are all we hear.
                self.heard_at = now
                silence_limit = max(self.loss_timeout, BLOCKED_SILENCE * self.heartbeat)
            silent, unheard = now - self.last_rx, now - self.heard_at
            if silent > silence_limit:
                reason = f"no frame from the broker for {silent:.1f}s (missed heartbeats)"
            elif unheard > self.loss_timeout:
                reason = (
                    f"the broker answered nothing we sent for {unheard:.1f}s "
                    "(it may not hear us: heartbeats arrive one way only)"
                )
            else:
                self.judged_at = now
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
                self._ping_now.clear()  # a stall told after this asks again at once
                asked = time.monotonic()
                await ch.basic_qos(prefetch_count=0)
                self.heard_at = max(self.heard_at, asked)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watchdog decides; a broken channel is reopened
                log.debug("ping on %r failed: %s", self.connection_name, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ping_now.wait(), interval)

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

    def carry_from(self, lost: Session) -> None:
        """Go on with what the session this one replaces saw of the queues themselves
        (not of its connection): since when a first-use queue showed nothing
        (``quiet_since``) and the runs of samples that showed it short of tokens
        (``heal_runs``). So a waiter whose connection was dropped (its quorum guard, a
        reset) and who waits on does not start its heal clocks again: rehearsal 74 (4.3.6,
        four CI lanes) saw a waiter dropped by its guard miss a 12.8 s bound it keeps
        undropped (10-11 s). The samples stay continuous or the run starts again
        (heal.MAX_GAP), as across acquires; what they judge is the queue's counts, which
        no connection of ours changes while we only wait."""
        for queue, quiet in lost.quiet_since.items():
            self.quiet_since.setdefault(queue, quiet)
        for queue, run in lost.heal_runs.items():
            self.heal_runs.setdefault(queue, run)

    def drop(self, reason: str) -> None:
        """Give the connection up for `reason`: every lease through it is lost at once and
        the socket is aborted (the broker then drops what the connection held).

        A test-and-set creation in flight (a first use's queue with its tokens in one
        write) is let finish first, for up to :data:`CREATE_SETTLE` seconds: the broker
        drops the tokens of a creation whose connection ends while it makes the queue,
        which would leave the name tokenless until it expires (tokens/fresh.py, residual
        window). Measured: 16 processes holding 125 fresh cluster-mode names each on a
        loaded 3-node 4.3.6 cluster, every connection dropped by the quorum guard, left
        11 names tokenless when aborted at once. Waiting delays only the abort: the
        leases are told first, and a connection kept open longer delays others' grants,
        never hastens them."""
        if not self.alive:
            return
        self._lose(reason)
        if self.creating:
            pending = list(self.creating)

            async def abort_after() -> None:
                try:
                    await asyncio.wait(pending, timeout=CREATE_SETTLE)
                finally:
                    self._abort()

            self.spawn(abort_after())
        else:
            self._abort()

    def _abort(self) -> None:
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
        finishing = self._tasks - self.deferred
        if finishing:  # let channel closes and notices started by releases finish
            await asyncio.wait(finishing, timeout=2.0)
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
