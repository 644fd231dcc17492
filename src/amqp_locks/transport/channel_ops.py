"""Single-channel operations the layers above transport/ use on a channel they hold
(a read-under-lock of a snapshot or ledger, a release's barrier), each named for what
it does, so that those modules make no raw AMQP call of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from .aiormq_compat import forget_consumer, publish_frames, send_together
from .wire import AbstractChannel, Basic, DeliveredMessage


async def take(ch: AbstractChannel, queue: str) -> DeliveredMessage | None:
    """The next message of `queue`, taken unacknowledged (``basic.get``): it stays the
    channel's until acknowledged or given back (or the channel closes); None when the
    queue is empty."""
    message: DeliveredMessage = await ch.basic_get(queue, no_ack=False)
    return message if isinstance(message.delivery, Basic.GetOk) else None


async def ack(ch: AbstractChannel, tag: int) -> None:
    """Drop the message taken with delivery tag `tag` (a write, no answer)."""
    await ch.basic_ack(tag)


async def give_back(ch: AbstractChannel, tag: int) -> None:
    """Give the message taken with delivery tag `tag` back to its queue, at its head (a
    write, no answer; a quorum queue counts the return)."""
    await ch.basic_reject(tag, requeue=True)


async def begin_transaction(ch: AbstractChannel) -> None:
    """Make `ch` transactional (a channel without publisher confirms): its acks and
    publishes take effect together, at :func:`replace_and_commit`'s commit, or never."""
    await ch.tx_select()


async def replace_and_commit(
    ch: AbstractChannel, tag: int, queue: str, body: bytes, properties: Basic.Properties
) -> None:
    """On a transactional channel: drop the message `tag` and publish its successor
    `body` to `queue`, committed as one: the message is never lost nor doubled, whatever
    happens to us in between."""
    await ch.basic_ack(tag)
    await ch.basic_publish(body, routing_key=queue, properties=properties)
    await ch.tx_commit()


async def consume_unacked(
    ch: AbstractChannel,
    queue: str,
    on_message: Callable[[DeliveredMessage], Coroutine[Any, Any, None]],
    *,
    prefetch: int,
    priority: int | None = None,
) -> str:
    """Consume `queue` on `ch` at consumer priority `priority` (None: the default), with
    the channel's prefetch set to `prefetch` first (0: unbounded): each message stays the
    channel's until acknowledged, or goes back when the channel closes. Returns the
    consumer tag."""
    await ch.basic_qos(prefetch_count=prefetch)
    return await consume_at(ch, queue, on_message, priority=priority)


async def consume_at(
    ch: AbstractChannel,
    queue: str,
    on_message: Callable[[DeliveredMessage], Coroutine[Any, Any, None]],
    *,
    priority: int | None = None,
    consumer_tag: str | None = None,
) -> str:
    """Consume `queue` on `ch` (prefetch as the channel has it) at consumer priority
    `priority` (None: the default), messages unacknowledged; returns the consumer tag
    (`consumer_tag`, or the broker's). A 404 here means the queue is gone."""
    ok = await ch.basic_consume(
        queue,
        on_message,
        no_ack=False,
        consumer_tag=consumer_tag,
        arguments=None if priority is None else {"x-priority": priority},
    )
    return str(ok.consumer_tag)


async def cancel(ch: AbstractChannel, consumer_tag: str, *, answered: bool = True) -> None:
    """End consumer `consumer_tag`; with `answered`, once the broker said so (nothing is
    pushed to it after), else at once (the channel's later methods still come after)."""
    if answered:
        await ch.basic_cancel(consumer_tag)
    else:
        await ch.basic_cancel(consumer_tag, nowait=True)


async def declare_on(ch: AbstractChannel, queue: str, **declare: Any) -> None:
    """Declare `queue` on `ch` itself (`declare`: ``durable``, ``auto_delete``,
    ``arguments``), where a consume on it follows."""
    await ch.queue_declare(queue, **declare)


async def publish_plain(ch: AbstractChannel, queue: str, body: bytes) -> None:
    """Publish `body` to `queue`: transient, not mandatory (as the channel confirms)."""
    await ch.basic_publish(body, routing_key=queue)


async def stop_and_give_back(
    ch: AbstractChannel, consumer_tag: str, delivery_tags: Iterable[int]
) -> None:
    """Cancel the consumer `consumer_tag` (no answer awaited), then give back to their
    queue the messages it delivered (`delivery_tags`): the broker handles a channel's
    methods in order, so none comes back to this consumer."""
    await cancel(ch, consumer_tag, answered=False)
    for tag in delivery_tags:
        await give_back(ch, tag)


async def hand_on(
    ch: AbstractChannel,
    consumer_tag: str,
    delivery_tag: int,
    *,
    republish: tuple[bytes, str, Basic.Properties] | None,
    transactional: bool,
) -> None:
    """A held token's release, in one write: cancel its consumer `consumer_tag` (so the
    token never comes back to it), then give the message `delivery_tag` back (a reject),
    or with `republish` (body, queue, properties) drop it and publish its successor
    (a counter carried in the message); then, on a transactional channel, commit. None of
    these methods but the commit has an answer: the broker hands the token on when it
    handles them (at the commit, if transactional)."""
    frames: list[Any] = [Basic.Cancel(consumer_tag=consumer_tag, nowait=True)]
    if republish is not None:
        frames.append(Basic.Ack(delivery_tag=delivery_tag))
        frames += publish_frames(*republish)
    else:
        frames.append(Basic.Reject(delivery_tag=delivery_tag, requeue=True))
    forget_consumer(ch, consumer_tag)
    await send_together(ch, frames)
    if transactional:
        await ch.tx_commit()


async def _nothing(_: object) -> None:
    """The consumer of :func:`declare_and_hold`, which expects no message."""


async def declare_and_hold(ch: AbstractChannel, queue: str, **declare: Any) -> None:
    """Declare `queue` (`declare`: ``durable``, ``auto_delete``, ``arguments``) and
    consume it on `ch` without acknowledgements, expecting nothing: a consumer that marks
    the queue used (it does not expire, or is not auto-deleted) while `ch` stays open."""
    await ch.queue_declare(queue, **declare)
    await ch.basic_consume(queue, _nothing, no_ack=True)


async def ack_through(ch: AbstractChannel, tag: int) -> None:
    """Drop every message the channel took up to delivery tag `tag` (a write)."""
    await ch.basic_ack(tag, multiple=True)


async def give_back_through(ch: AbstractChannel, tag: int) -> None:
    """Give back to their queue every message the channel took up to `tag` (a write)."""
    await ch.basic_nack(tag, multiple=True, requeue=True)


async def publish_durable(ch: AbstractChannel, queue: str, body: bytes) -> None:
    """Publish `body` to `queue`, persistent and mandatory, as the channel confirms
    (with publisher confirms, once the broker has it)."""
    await ch.basic_publish(
        body, routing_key=queue, mandatory=True, properties=Basic.Properties(delivery_mode=2)
    )


async def publish_all(
    ch: AbstractChannel, queue: str, messages: Iterable[tuple[bytes, Basic.Properties]]
) -> None:
    """Publish `messages` to `queue`, mandatory, all in flight at once; returns once the
    channel confirmed every one (with publisher confirms)."""
    await asyncio.gather(
        *(
            ch.basic_publish(body, routing_key=queue, mandatory=True, properties=properties)
            for body, properties in messages
        )
    )


async def release_barrier(ch: AbstractChannel) -> None:
    """One round trip on `ch` after a release written to it (a reject, a cancel): the
    broker handles a channel's methods in order, so its answer means it has taken the
    release, and nothing that happens to us afterwards (exit, crash, lost connection)
    can keep the lock held. ``basic.qos`` with the prefetch every holder channel already
    has (1) changes nothing else."""
    await ch.basic_qos(prefetch_count=1)
