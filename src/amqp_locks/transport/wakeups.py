"""Push wake-ups that hand a freed slot to *one* waiter, not to all of them.

Every lock has a wake-up queue (`N-sem-wakeups`, `N-mutex-wakeups`): durable (RabbitMQ 4.x
refuses transient shared queues), auto-deleted when its last waiter leaves, expiring if
nobody ever consumed it; a quorum queue in cluster mode (`features.helper_queue`). A holder that
releases cleanly publishes one notice to it. Each waiting process consumes it with
prefetch 1 and manual ack, so the broker hands each notice to exactly one waiter (round
robin): that waiter retries at once and acks the notice after its attempt; the others keep
sleeping. A waiter that leaves with a notice in hand (it timed out, or got a slot anyway)
closes its channel and the broker gives the notice to the next waiter. A crashed holder
publishes nothing, but it held a *sentinel*: every holder of a persistent-semaphore slot
or mutex publishes one message to the lock's sentinel queue (`N-sem-watch`) and
consumes it back, unacked, with a higher consumer priority than the waiters. When the
holder's connection dies the broker returns that message to the queue and pushes it to a
waiter at once — a crash wakes a waiter as promptly as a clean release. Waiters still
re-check on a bounded back-off in case both pushes are lost.

Waiters take turns in the order the broker hands out notices (round robin among the
consumers, a newcomer last) only if nobody else tries in between: a re-check that finds
the lock free in the moment between a release and the woken waiter's attempt takes it
from that waiter, who then goes to the back of the line. So a waiter that is subscribed
re-checks on its own only as the last resort (`waiting.acquire_loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NamedTuple

from aiormq.abc import AbstractChannel, DeliveredMessage

from .features import helper_queue
from .shield import close_quietly

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("amqp_locks.transport")

#: Holders consume sentinels before waiters do.
HOLDER_PRIORITY = 1


class Wake(NamedTuple):
    """What woke an attempt (see :meth:`Waiter.take`)."""

    #: The notices and sentinels the attempt answers (acked after it).
    tags: list[tuple[AbstractChannel, int]]
    #: The slot the last one announced: where to look first.
    hint: int | None
    #: A sentinel was among them: a holder died. The broker may hand the sentinel on a
    #: few milliseconds before it deletes the dead holder's queue (RabbitMQ 4.0.5), so a
    #: failed attempt after a sentinel is worth repeating shortly. A clean release's
    #: notice is sent after its delete: an attempt that fails after one lost a race.
    sentinel: bool


class Waiter:
    """One waiting acquire's subscription to its lock's wake-up queue."""

    def __init__(self, sentinels: str | None = None) -> None:
        self.event = asyncio.Event()
        self.sentinels = sentinels
        self.channel: AbstractChannel | None = None
        self._tags: list[tuple[AbstractChannel, int]] = []
        self._hint: int | None = None
        self._sentinel = False
        #: True once the broker confirmed our consumer (tests and status tools read it).
        self.ready = False
        #: The broker cancelled our consumer or closed our channel: in a cluster, the
        #: node holding the (non-replicated) wake-up queue died. Subscribe again.
        self.broken = False

    def on_broken(self, *_: Any) -> None:
        if self.ready:
            self.broken = True
            self.event.set()

    async def on_notice(self, message: DeliveredMessage) -> None:
        tag = getattr(message.delivery, "delivery_tag", None)
        if isinstance(tag, int) and message.channel is not None:
            self._tags.append((message.channel, tag))
        if self.sentinels is not None:
            routed_to = getattr(message.delivery, "routing_key", None)
            self._sentinel = self._sentinel or routed_to == self.sentinels
        body = message.body.strip()
        self._hint = int(body) if body.isdigit() and int(body) > 0 else None
        self.event.set()

    def take(self) -> Wake:
        """Before an attempt: what woke it (the notices and sentinels it answers, the slot
        the last one announced, whether a holder died)."""
        self.event.clear()
        wake = Wake(self._tags, self._hint, self._sentinel)
        self._tags, self._hint, self._sentinel = [], None, False
        return wake

    async def answered(self, tags: list[tuple[AbstractChannel, int]]) -> None:
        """After the attempt: ack them, so the next ones can be delivered to us."""
        for ch, tag in tags:
            if not ch.is_closed:
                with contextlib.suppress(Exception):
                    await ch.basic_ack(tag)

    async def wait(self, timeout: float | None) -> bool:
        """Sleep until a notice (True) or the timeout (False)."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except TimeoutError:
            return False
        return True


@contextlib.asynccontextmanager
async def subscribe(
    session: Session, queue: str, sentinels: str | None = None
) -> AsyncIterator[Waiter]:
    """Consume the wake-up `queue` (and the `sentinels` queue, if the lock has one) for
    the duration of the block; degrade to polling if we cannot."""
    waiter = Waiter(sentinels)
    session.waiters.add(waiter)
    # Every waiter and holder must declare them alike (406 otherwise). The sentinel queue
    # is not auto-deleted, so it cannot vanish between a declare and a consume on a
    # lease's watch channel; unused for 10 minutes, either expires.
    wakeup_options = helper_queue(session, wakeups=True)
    sentinel_options = helper_queue(session, wakeups=False)
    try:
        try:
            ch = await session.open_channel()
            waiter.channel = ch
            _watch_channel(ch, waiter)
            await ch.basic_qos(prefetch_count=1)
            # Again after a failure: the last waiter leaving may auto-delete the queue in
            # between, or (a 406) another RabbitMQ line made it, which session.declare
            # adapts to on a pooled channel; the first try stays on the waiter's channel.
            for attempt in range(3):
                declare = session.declare if attempt else ch.queue_declare
                try:
                    await declare(queue, **wakeup_options)
                    await ch.basic_consume(queue, waiter.on_notice, no_ack=False)
                    if sentinels is not None:
                        await declare(sentinels, **sentinel_options)
                        await ch.basic_consume(sentinels, waiter.on_notice, no_ack=False)
                    waiter.ready = True
                    break
                except Exception:
                    if attempt == 2:
                        raise
                    if ch.is_closed:
                        ch = await session.open_channel()
                        waiter.channel = ch
                        _watch_channel(ch, waiter)
                        await ch.basic_qos(prefetch_count=1)
        except Exception as exc:
            log.debug("no wake-ups from %r (%s); polling only", queue, exc)
        yield waiter
    finally:
        session.waiters.discard(waiter)
        waiter.ready = False  # our own close below is no breakage
        if waiter.channel is not None and not waiter.channel.is_closed:
            # Closing returns an unanswered notice to the queue, for the next waiter.
            session.spawn(close_quietly(waiter.channel))


def _watch_channel(ch: AbstractChannel, waiter: Waiter) -> None:
    ch.on_consumer_cancel_callbacks.add(waiter.on_broken)
    ch.closing.add_done_callback(lambda _: waiter.on_broken() if ch is waiter.channel else None)
