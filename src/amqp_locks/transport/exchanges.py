"""Exchange and binding operations of a session, each one broker round trip on a pooled
channel (`Session.call`: errors typed, the exchange named in them), for celery/once.py's
claims: a key is busy while its claim exchange exists (see that module).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..errors import QueueNotFound
from .absent import while_absent
from .channel_ops import declare_and_hold
from .channel_pools import CHANNEL_ERRORS
from .errors import channel_error
from .session import Session
from .shield import close_quietly
from .wire import AbstractChannel

#: Loop steps a declare with `on_sent` waits for aiormq to write it before telling.
SEND_STEPS = 3


async def declare_exchange(
    session: Session,
    exchange: str,
    exchange_type: str,
    *,
    durable: bool,
    auto_delete: bool,
    arguments: dict[str, Any],
    on_sent: Callable[[], None] | None = None,
) -> None:
    """Declare `exchange`; raises PreconditionFailed when it exists with other arguments.
    `on_sent` is called once the method is on its way to the socket (a few loop steps
    take it through aiormq's writer), before the answer comes."""

    async def declare(ch: AbstractChannel) -> Any:
        reply = asyncio.ensure_future(
            ch.exchange_declare(
                exchange,
                exchange_type=exchange_type,
                durable=durable,
                auto_delete=auto_delete,
                arguments=arguments,
            )
        )
        if on_sent is not None:
            for _ in range(SEND_STEPS):
                if reply.done():
                    break
                await asyncio.sleep(0)
            on_sent()
        return await reply

    await session.call(exchange, declare)


async def exchange_exists(session: Session, exchange: str) -> bool:
    """Passive declare: whether `exchange` exists."""
    try:
        await session.call(exchange, lambda ch: ch.exchange_declare(exchange, passive=True))
    except QueueNotFound:
        return False
    return True


async def delete_exchange(session: Session, exchange: str, *, if_unused: bool) -> None:
    """Delete `exchange`; with `if_unused`, PreconditionFailed while something is bound."""
    await session.call(exchange, lambda ch: ch.exchange_delete(exchange, if_unused=if_unused))


async def bind_exchange(session: Session, destination: str, source: str, key: str) -> None:
    """Bind `destination` to `source` with `key` (QueueNotFound: `source` is missing)."""
    await session.call(source, lambda ch: ch.exchange_bind(destination, source, key))


async def unbind_exchange(session: Session, destination: str, source: str, key: str) -> None:
    await session.call(source, lambda ch: ch.exchange_unbind(destination, source, key))


async def bind_queue(session: Session, queue: str, exchange: str, key: str) -> None:
    """Bind `queue` to `exchange` with `key` (QueueNotFound names what is missing)."""
    await session.call(exchange, lambda ch: ch.queue_bind(queue, exchange, key))


async def unbind_queue(session: Session, queue: str, exchange: str, key: str) -> None:
    await session.call(exchange, lambda ch: ch.queue_unbind(queue, exchange, key))


async def declare_exclusive(session: Session, queue: str, arguments: dict[str, Any]) -> None:
    """Declare the exclusive `queue` (this connection's, gone with it)."""
    await session.call(
        queue, lambda ch: ch.queue_declare(queue, exclusive=True, arguments=arguments)
    )


async def consume_on_own_channel(
    session: Session,
    queue: str,
    arguments: dict[str, Any],
    *,
    durable: bool = True,
    auto_delete: bool = False,
) -> AbstractChannel:
    """Declare `queue` and consume it (no ack, no message expected) on a channel of its
    own: the caller keeps the channel, and the consumer, open while it needs the queue
    used (an expiring queue lives as long). Used by the once claim's watch queue and a
    heal's waiting queue (tokens/heal.py). The channel is closed if the declaration
    fails or is cancelled: a consumer left on it would count for ever."""

    async def attempt() -> AbstractChannel:
        ch = await session.open_channel()
        try:
            await declare_and_hold(
                ch, queue, durable=durable, auto_delete=auto_delete, arguments=arguments
            )
        except CHANNEL_ERRORS as exc:
            await close_quietly(ch)
            raise channel_error(exc, queue) from exc
        except BaseException:
            await close_quietly(ch)
            raise
        return ch

    return await while_absent(queue, attempt)  # racers: absent.py
