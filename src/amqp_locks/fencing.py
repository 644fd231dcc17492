"""Monotonic fencing tokens from one fence message in a quorum queue.

Every lock `N` has a durable quorum queue `N-fence` holding exactly one message. A grant
takes the message with `basic.get` (manual ack), reads its `x-delivery-count` and returns it
with `basic.reject(requeue=True)`. A quorum queue raises the count on every return — reject,
nack, or the channel closing with it unacked — and keeps it in its replicated log, so the
count is strictly increasing across grants, processes and broker restarts. While one client
holds the message nobody else can read it, so reading and raising are one atomic step.

The token handed to the holder is ``x-delivery-count + 1`` (never 0). A protected resource
keeps the highest token it has accepted per lock and rejects any request carrying a lower
one: a holder whose lock was re-granted to someone else is fenced off as soon as the new
holder has written once.

Broker limits: RabbitMQ 4.x gives quorum queues a default delivery limit of 20 and would drop
the fence message after 20 grants, so on 4.x the queue is declared with
``x-delivery-limit: -1``. RabbitMQ 3.x has no default limit, and there ``-1`` means "drop on
the first return" (checked on 3.10.8), so the argument is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp.commands import Basic

from .errors import LockError, QueueNotFound
from .names import fence_queue
from .transport.session import Session

log = logging.getLogger("amqp_locks.fencing")

#: The fence message's body is its base: tokens are ``base + x-delivery-count + 1``.
FENCE_BODY = b"0"


class FenceMissing(LockError):
    """The fence queue exists but holds no fence message (purged by hand?)."""


def broker_version(session: Session) -> tuple[int, int]:
    """The broker's (major, minor) version, from the connection's server properties."""
    assert session.conn is not None
    raw = session.conn.server_properties.get("version", b"3.0")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    parts = [*text.split("."), "0"]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return 3, 0


def broker_major(session: Session) -> int:
    return broker_version(session)[0]


def fence_arguments(session: Session) -> dict[str, Any]:
    args: dict[str, Any] = {"x-queue-type": "quorum"}
    if broker_major(session) >= 4:
        args["x-delivery-limit"] = -1
    return args


async def ensure_fence(session: Session, name: str) -> bool:
    """Create `N-fence` with its one message unless it exists. Call under the admin mutex
    (two creators could otherwise publish two fence messages). True if created now."""
    queue = fence_queue(name)
    if await session.exists_passive(queue):
        return False
    await session.declare(queue, durable=True, arguments=fence_arguments(session))
    await session.publish("", queue, FENCE_BODY, persistent=True)
    log.info("created fence queue %r", queue)
    return True


async def repair_fence(session: Session, name: str, base: int) -> bool:
    """Put a fence message with `base` back if the fence queue lost its message (someone
    purged it). `base` must exceed every token already handed out (read it from the
    protected resource): the old count died with the old message. Call under the admin
    mutex. True if a message was missing and was replaced."""
    queue = fence_queue(name)
    await session.declare(queue, durable=True, arguments=fence_arguments(session))
    try:
        await _take_pushed(session, queue, 2.0)
    except FenceMissing:
        await session.publish("", queue, str(base).encode(), persistent=True)
        log.warning("fence queue %r had no message: replaced with base %d", queue, base)
        return True
    return False


def _count(message: DeliveredMessage) -> int:
    """The message's base (its body, set by :func:`repair_fence`) plus its delivery count."""
    headers = (message.header.properties.headers or {}) if message.header else {}
    value = headers.get("x-delivery-count", 0)
    count = int(value) if isinstance(value, int) else 0
    body = message.body.strip()
    return count + (int(body) if body.isdigit() else 0)


def _tag(message: DeliveredMessage) -> int:
    tag = getattr(message.delivery, "delivery_tag", None)
    assert isinstance(tag, int)
    return tag


async def take_token(session: Session, name: str, timeout: float = 30.0) -> int:
    """Read and raise the fence counter of `name`; returns the new fencing token.

    The fast path is one `basic.get` round trip (the reject needs no reply). If another
    client holds the fence message at that instant, we consume with prefetch 1 and get it
    pushed the moment it is returned — no polling. Brokers in cluster mode always consume.
    """
    queue = fence_queue(name)
    if session.cluster:
        # In a cluster, never basic.get: while the fence's leader is being re-elected
        # (about 0.5 s after its node dies) RabbitMQ 3.10 answers it with 541
        # INTERNAL_ERROR "nodedown", which closes the whole connection and loses every
        # lease on it. A consumer just waits for the new leader.
        return await _take_pushed(session, queue, timeout) + 1

    async def get_and_return(ch: AbstractChannel) -> int | None:
        message = await ch.basic_get(queue, no_ack=False)
        if not isinstance(message.delivery, Basic.GetOk):
            return None
        count = _count(message)
        await ch.basic_reject(_tag(message), requeue=True)
        return count

    count: int | None = await session.call(queue, get_and_return)
    if count is None:
        count = await _take_pushed(session, queue, timeout)
    return count + 1


async def _take_pushed(session: Session, queue: str, timeout: float) -> int:
    ch = await session.open_channel()
    got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()

    async def on_message(message: DeliveredMessage) -> None:
        if not got.done():
            got.set_result(message)
        # any later delivery stays unacked and is returned when the channel closes

    try:
        await ch.basic_qos(prefetch_count=1)
        await ch.basic_consume(queue, on_message, no_ack=False)
        try:
            message = await asyncio.wait_for(got, timeout)
        except TimeoutError:
            raise FenceMissing(
                f"no fence message arrived from {queue!r} within {timeout:.0f}s; if the queue "
                "was purged, run SemaphoreAdmin.repair_fence(base)"
            ) from None
        count = _count(message)
        await ch.basic_reject(_tag(message), requeue=True)
        return count
    except QueueNotFound:
        raise
    finally:
        with contextlib.suppress(Exception):
            await ch.close()
