"""A lock held as an exclusive queue: the seed's holder queue `B[k]`, or the mutex `N`.

:class:`LeaseState` holds one exclusive queue and *consumes* from the queues whose deletion
ends the lease, so the broker pushes a `basic.cancel` the moment an administrator deletes
the slot or someone deletes the holder queue; connection loss and missed heartbeats arrive
through the session. :func:`grant` is the grant step both kinds share (declare, watch,
fencing token), undone whatever fails after the declare.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import AmqpLocksError, ConnectionLost, LeaseReleased, QueueNotFound, ResourceLocked
from .held import HeldState
from .transport.channel_ops import (
    ack,
    ack_through,
    cancel,
    consume_at,
    declare_on,
    publish_plain,
)
from .transport.errors import channel_error, undelivered_to
from .transport.features import helper_queue
from .transport.shield import close_quietly
from .transport.wakeups import HOLDER_PRIORITY
from .transport.wire import AbstractChannel, Basic, DeliveredMessage

log = logging.getLogger("amqp_locks.lease")

#: Seconds a watch consumer keeps one probe message unacked (see `LeaseState.watch`);
#: far below RabbitMQ's default consumer_timeout of 30 minutes.
PARK_REFRESH = 300.0


@dataclass(eq=False, kw_only=True)
class LeaseState(HeldState):
    """A held exclusive queue and everything that may take it away."""

    held_queue: str
    watch_queues: Sequence[str]
    must_exist: Sequence[str]
    #: A classic queue whose existence says a `must_exist` queue is being removed (a quorum
    #: slot's tombstone, semaphore/burial.py): verify asks it first and touches the
    #: `must_exist` queues only when it is absent.
    tombstone: str | None = None
    notice_key: str
    #: The lock's sentinel queue (transport/wakeups.py): our death wakes a waiter.
    sentinels: str | None = None
    watch_channel: AbstractChannel | None = None
    _tags: dict[str, str] = field(default_factory=dict)
    _sentinel_tag: int | None = None
    _sentinel_consumer: str | None = None
    #: A watched queue pushed us a probe (left unacked): the watch channel is not clean.
    _parked: bool = False
    #: The sentinel is held on a channel of its own: a failure there never costs the lease.
    _sentinel_ch: AbstractChannel | None = None

    # --- setting up the watch (runs as the last acquire step) -------------------------

    async def watch(self, channel: AbstractChannel | None = None) -> None:
        """Consume from every watched queue (on `channel`, a fresh one the lease will own);
        a 404 here means the slot vanished (raises :class:`QueueNotFound`)."""
        self._listener = self.session.add_listener(self._on_session_lost)
        self.session.leases.add(self)
        ch = channel if channel is not None else await self.session.ready_channel()
        self.watch_channel = ch
        ch.on_consumer_cancel_callbacks.add(self._on_cancel)
        ch.closing.add_done_callback(self._on_watch_closed)

        # Probes routed to a watched queue would be pushed to this consumer, costing the
        # holder and the broker for every probe of every searcher. With prefetch 1 and
        # the first delivery left unacked ("parked") the consumer is never ready, so
        # later probes are dropped by `x-max-length: 0` instead. The parked message is
        # acked every PARK_REFRESH seconds, well inside the broker's consumer_timeout.
        # (`ready_channel` set prefetch 1.)

        async def park(message: DeliveredMessage) -> None:
            self._parked = True
            tag = getattr(message.delivery, "delivery_tag", None)
            if isinstance(tag, int):
                asyncio.get_running_loop().call_later(PARK_REFRESH, self._unpark, ch, tag)

        for q in self.watch_queues:
            try:
                tag = await consume_at(ch, q, park)
            except Exception as exc:
                raise channel_error(exc, q) from exc
            self._tags[tag] = q

    async def hold_sentinel(self) -> None:
        """Publish a sentinel and hold one unacked (consuming ahead of the waiters): if our
        connection dies, the broker hands it to a waiter. Best effort, on a channel of its
        own and concurrently with the rest of the grant: without it, waiters fall back to
        polling after a crash. The sentinel queue is declared once per connection (and
        again if it expired meanwhile)."""
        queue = self.sentinels
        if queue is None:
            return
        session = self.session

        async def hold(message: DeliveredMessage) -> None:
            tag = getattr(message.delivery, "delivery_tag", None)
            if self.released:  # delivered after the release: `_drop_sentinel` acks it
                return
            if isinstance(tag, int) and message.channel is not None:
                self._sentinel_tag = tag
                # consumer_timeout would close a channel holding it for 30 min: re-arm
                asyncio.get_running_loop().call_later(
                    PARK_REFRESH, self._rearm, message.channel, tag
                )

        for attempt in range(2):
            ch = None
            try:
                ch = await session.ready_channel()
                self._sentinel_ch = ch
                if attempt:  # on a pooled channel: adapts to another line's queue
                    await session.declare(queue, **helper_queue(session, wakeups=False))
                elif queue not in session.sentinels_declared:
                    await declare_on(ch, queue, **helper_queue(session, wakeups=False))
                session.sentinels_declared.add(queue)
                self._sentinel_consumer = await consume_at(
                    ch, queue, hold, priority=HOLDER_PRIORITY
                )
                # The confirm is not waited for: the sentinel only has to be there by the
                # time we might die, and our own consumer takes it either way.
                session.spawn(_publish_quietly(ch, queue, str(self.number).encode()))
                if self.released and self._sentinel_ch is ch:
                    # Released while the consume was in flight (`_drop_sentinel` left the
                    # channel to us): clean it here, the one way every release does.
                    self._drop_sentinel()
                return
            except Exception as exc:
                session.sentinels_declared.discard(queue)  # expired? declare next time
                if ch is not None:
                    if self._sentinel_ch is ch:
                        self._sentinel_ch = None
                    session.spawn(close_quietly(ch))
                if attempt or not session.alive:
                    log.debug("no sentinel for %r (%s): waiters poll after a crash", self.name, exc)

    def _rearm(self, ch: AbstractChannel, tag: int) -> None:
        if ch.is_closed or self.released or self._sentinel_tag != tag or self.sentinels is None:
            return
        queue = self.sentinels

        async def rearm() -> None:
            with contextlib.suppress(Exception):
                await ack(ch, tag)
                await publish_plain(ch, queue, str(self.number).encode())

        self.session.spawn(rearm())

    def _unpark(self, ch: AbstractChannel, tag: int) -> None:
        if not ch.is_closed and not self.released:
            self.session.spawn(_ack_quietly(ch, tag))

    def _on_cancel(self, frame: Basic.Cancel) -> None:
        queue = self._tags.get(str(frame.consumer_tag))
        if queue is None:
            return
        if queue == self.held_queue:
            self.lose(f"lock queue {queue!r} was deleted by someone else")
        else:
            self.lose(f"{self.kind} {self.number} of {self.name!r} was removed ({queue!r} deleted)")

    def _on_watch_closed(self, fut: asyncio.Future[Any]) -> None:
        if self.released or self.lost_reason is not None:
            return
        exc = None if fut.cancelled() else fut.exception()
        self.lose(f"watch channel closed: {exc}" if exc else "watch channel closed")

    # --- verify / release --------------------------------------------------------------

    async def verify(self) -> bool:
        """The seed's verification: our connection is alive and every `must_exist` queue
        routes; we also check the holder queue is still ours (passive declare)."""
        if self.released:
            raise LeaseReleased(f"{self.kind} {self.number} of {self.name!r} was released")
        if self.lost_reason is not None or not self.session.alive:
            return False
        try:
            if self.tombstone is not None and (await self.session.probe([self.tombstone]))[0]:
                self.lose(f"{self.kind} {self.number} of {self.name!r} is being removed")
                return False
            routes, mine = await asyncio.gather(
                self.session.probe(list(self.must_exist)),
                self.session.exists_passive(self.held_queue),
            )
        except AmqpLocksError as exc:
            log.info("verify of %s %d of %r failed: %s", self.kind, self.number, self.name, exc)
            return False
        ok = all(routes) and mine
        if not ok:
            missing = [q for q, r in zip(self.must_exist, routes, strict=True) if not r]
            if not mine:
                missing.append(self.held_queue)
            self.lose(f"verification failed: {', '.join(repr(q) for q in missing)} missing")
        return ok

    async def release(self) -> None:
        """Delete the held queue and tell waiters it is free, in one round trip
        (`Session.delete_and_notify`: the notice follows the delete on one channel)."""
        if not self.begin_release():
            return
        session = self.session
        watch, self.watch_channel = self.watch_channel, None
        if not session.alive:
            session.held.discard(self.held_queue)
            self.release_failure = f"the connection had ended ({session.lost_reason})"
            return
        slot = self.number if self.kind == "semaphore" else 0
        try:
            routed = await session.delete_and_notify(self.held_queue, self.notice_key, slot)
        except BaseException as exc:
            self._let_go(watch)
            if isinstance(exc, ConnectionLost) and not session.alive:
                if undelivered_to(f"{session.lost_reason} {exc}") == self.notice_key:
                    # Our notice met the wake-up queue in the instant of its delete (its
                    # last waiter left; RabbitMQ 4.2+ then closes the connection): the
                    # broker handled the delete before it, on the same channel. Released,
                    # and our sentinel, returned with the connection, wakes any waiter.
                    log.info(
                        "released %r; its wake-up notice met the wake-up queue being "
                        "deleted, and the broker closed the connection: %s",
                        self.name,
                        session.lost_reason,
                    )
                    return
                # The connection died under the release: the broker deletes the exclusive
                # queue with it, so the lock is free all the same. No waiter notice.
                log.debug("connection lost releasing %r: released by the broker", self.name)
                self.release_failure = f"the connection ended during it ({exc})"
                return
            raise
        if self.kind == "semaphore":
            session.slot_hints[self.name] = self.number
        answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        answered.set_result(routed)
        session.released_at[self.notice_key] = (time.monotonic(), answered)
        self._let_go(watch)
        log.debug(
            "released %s %d of %r after %.3fs",
            self.kind,
            self.number,
            self.name,
            time.monotonic() - self.acquired_at,
        )

    async def abandon(self) -> None:
        """Undo a half-made grant (acquire failed or was cancelled after the declare)."""
        self.released = True
        self.session.remove_listener(self._listener)
        self.session.leases.discard(self)
        with contextlib.suppress(Exception):
            if self.session.alive:
                await self.session.delete(self.held_queue)
        if self.watch_channel is not None:
            await close_quietly(self.watch_channel)
        self._drop_sentinel()
        self.session.held.discard(self.held_queue)

    def _let_go(self, watch: AbstractChannel | None) -> None:
        """After the held queue's delete (or its failure): this session may take the lock
        again, and the lease's channels go back clean."""
        self.session.held.discard(self.held_queue)
        self._end_watch(watch)
        self._drop_sentinel()

    def _end_watch(self, watch: AbstractChannel | None) -> None:
        """After the held queue's delete (which ended our consumer on it), make the watch
        channel clean again and give it back to the session's ready channels: cancel the
        other watch consumers (waiting for cancel-ok, so nothing more is pushed to us),
        then ack whatever probe is still parked (ack of tag 0 with `multiple`: every
        outstanding delivery). Saves the broker a channel close and open per grant; a
        channel that fails any step is closed instead."""
        if watch is None or watch.is_closed:
            return
        watch.on_consumer_cancel_callbacks.discard(self._on_cancel)
        watch.closing.remove_done_callback(self._on_watch_closed)
        others = [tag for tag, q in self._tags.items() if q != self.held_queue]

        async def clean() -> None:
            for tag in others:
                await cancel(watch, tag)
            if self._parked or others:  # a probe may have been pushed until cancel-ok
                await ack_through(watch, 0)

        self.session.recycle_ready(watch, clean)

    def _drop_sentinel(self) -> None:
        """A clean end wakes a waiter by its notice: cancel our sentinel consumer, then
        ack the sentinel (in that order: nothing else can be pushed to us in between, and
        closing first would hand it to a waiter); the channel, clean again, goes back to
        the session's ready channels. Released before the sentinel came back to us, the
        same two methods: the cancel waits for its answer (whatever was pushed to us came
        before it) and the ack takes every delivery (tag 0, multiple), if any. Released
        before the consume was answered, `hold_sentinel` calls this again once it is."""
        ch, tag, consumer = self._sentinel_ch, self._sentinel_tag, self._sentinel_consumer
        if ch is not None and consumer is None and not ch.is_closed:
            return  # the consume is in flight: hold_sentinel drops it once answered
        self._sentinel_ch = self._sentinel_tag = self._sentinel_consumer = None
        if ch is None or consumer is None or ch.is_closed:
            return

        async def clean() -> None:
            if tag is None:  # not delivered yet
                await cancel(ch, consumer, answered=True)
                await ack_through(ch, 0)
            else:
                await cancel(ch, consumer, answered=False)
                await ack(ch, tag)

        self.session.recycle_ready(ch, clean)


#: Where a grant takes its fencing token: the lock kind's own source (see ``grant``).
FenceSource = Callable[["LeaseState"], Awaitable[int]]


async def grant(
    state: LeaseState, arguments: dict[str, Any] | None, *, fence: FenceSource | None
) -> bool:
    """The grant step of every exclusive-queue lock: declare the held queue exclusive,
    watch, take a fencing token from `fence` (None: no token). True when granted; False
    when a watched queue vanished meanwhile (undone). Raises :class:`ResourceLocked` when
    another connection holds it. Whatever fails or is cancelled after the declare is
    undone (the queue is deleted).

    The fence source is passed in by the lock kind (``mutex.mutex_fence``,
    ``semaphore.client.semaphore_fence``), so this module never imports the mutex back.
    """
    fencing = fence is not None
    session = state.session
    watch_channel: AbstractChannel | None = None
    try:
        # The declare and getting the lease's watch channel overlap.
        declared, opened = await asyncio.gather(
            session.declare(state.held_queue, exclusive=True, arguments=arguments),
            session.ready_channel(),
            return_exceptions=True,
        )
        if not isinstance(opened, BaseException):
            watch_channel = opened
        for result in (declared, opened):
            if isinstance(result, BaseException):
                raise result
        # The consume on the watched queues verifies they exist (the seed's "verify before
        # returning success"); the fencing token is taken meanwhile on another channel.
        jobs: list[Any] = [state.watch(watch_channel)]
        if fence is not None:
            jobs.append(fence(state))
        # The sentinel is not waited for (hold_sentinel: best effort; it only has to be
        # there by the time we might die): a name's first grant would otherwise wait for
        # its sentinel queue's declaration, a durable queue made on the broker's disk.
        session.spawn(state.hold_sentinel())
        results = await asyncio.gather(*jobs, return_exceptions=True)
        if isinstance(results[0], QueueNotFound):
            await state.abandon()
            return False
        for result in results:
            if isinstance(result, BaseException):
                raise result
        if fencing:
            token = results[1]
            assert isinstance(token, int)
            state.fencing_token = token
        return True
    except ResourceLocked:
        session.held.discard(state.held_queue)
        if watch_channel is not None:  # untouched: the next attempt takes it again
            session.return_ready(watch_channel)
        raise
    except BaseException:
        if state.watch_channel is None and watch_channel is not None:
            state.watch_channel = watch_channel
        await asyncio.shield(state.abandon())
        raise


async def _ack_quietly(ch: AbstractChannel, tag: int) -> None:
    with contextlib.suppress(Exception):
        await ack(ch, tag)


async def _publish_quietly(channel: AbstractChannel, queue: str, body: bytes) -> None:
    with contextlib.suppress(Exception):
        await publish_plain(channel, queue, body)
