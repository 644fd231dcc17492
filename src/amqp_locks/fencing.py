"""Monotonic fencing tokens from a few shared counters: one fence message per quorum queue.

Every lock `N` counts on one of :data:`~amqp_locks.names.FENCE_SHARDS` (16) shared durable
quorum queues, ``amqp-locks-shard-KK-fence`` (KK a stable hash of `N`), each holding exactly
one message. A grant takes the message with `basic.get` (manual ack), reads its return count
and returns it with `basic.reject(requeue=True)`. A quorum queue raises that count on every
return — reject, nack, or the channel closing with it unacked — and keeps it in its
replicated log, so the count is strictly increasing across grants, processes and broker
restarts. While one client holds the message nobody else can read it, so reading and
raising are one atomic step.

Why one counter may serve many names. A fencing token must rise strictly per lock: the
holder granted after another must get a larger token. Every grant reads the counter after
it holds its lock, and the earlier holder read it before it was granted, so the later read
is later in the counter's own (linearisable) order: it is larger, whichever other names
moved the counter in between. Sharing only makes tokens skip values. What a shared counter
buys: a lock's name leaves no fence behind once released, so per-entity names
(``order-{id}``) cost the broker nothing, where the earlier release left a quorum queue
(3 file handles on 3.10) per name for ever.

A shard is created by the first fenced grant that finds it missing, with a test-and-set:
its declaration carries a random ``x-max-length`` stamp, RabbitMQ refuses (406) a second
declaration with another one, so exactly one creator publishes the message. Its base is the
wall clock in microseconds (about 1.8e15 in 2026): above every token of an earlier
release's per-name fence (below 2**42: a count never reaches 2**40, and a re-base adds
2**40 per broker upgrade), and above everything a shard deleted by hand and made again
could have counted (a shard counts far fewer than a million grants a second), unless that
shard was re-based (+2**40, about 12.7 days of the clock) in the 12.7 days before: then
put its message back with ``SemaphoreAdmin.repair_fence(base)`` instead of deleting it.
Each fence message is replaced now and then (:func:`_renew`), so that its quorum queue's
log can be truncated.

The token handed to the holder is ``base + count + 1``; the message's body holds ``base``
and the counting rule it was minted under. A protected resource keeps the highest token it
has accepted per lock and rejects any request carrying a lower one: a holder whose lock was
re-granted to someone else is fenced off as soon as the new holder has written once.

Which header holds the count depends on the broker (`transport.features`): up to 4.2 it is
``x-delivery-count``; from 4.3 ``x-delivery-count`` counts only failed deliveries (not a
consumer timeout, not a consumer on a lost node) and ``x-acquired-count`` counts every
return. Upgrading RabbitMQ across such a change (3.13 -> 4.0, 4.2 -> 4.3) does not carry
the old count over to the new rule, so a client that reads a message minted under another
rule *re-bases* it before using it: holding the message, it replaces it in one AMQP
transaction (ack + publish) by a message whose base is ``base + 2**40``, above every token
the old message can have produced (a count never reaches 2**40), minted under the current
rule. Tokens therefore jump once per such upgrade, and keep rising.

Broker limits: RabbitMQ 4.x gives quorum queues a default delivery limit of 20 and would
drop the fence message after 20 grants, so on 4.x the queue is declared with
``x-delivery-limit: -1``. RabbitMQ 3.x has no default limit, and there ``-1`` means "drop on
the first return" (checked on 3.10.8), so the argument is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiormq.exceptions
from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp.commands import Basic

from .errors import FenceMissing, LockError, PreconditionFailed, QueueNotFound
from .names import FENCE_SHARDS, fence_queue, fence_shard, shard_lock
from .transport.broker import BrokerCore, BrokerLike
from .transport.errors import channel_error
from .transport.features import (
    acquired_count_header,
    broker_version,
    counting_rule,
    lock_queue_arguments,
)
from .transport.session import Session

log = logging.getLogger("amqp_locks.fencing")

#: How far a re-base lifts the base: above any count a message can reach.
REBASE_STEP = 2**40
#: After how many returns a fence message is replaced by a fresh one (:func:`_renew`).
RENEW_AFTER = 1024
#: How long a renewal waits for the message (another client may hold it).
RENEW_WAIT = 5.0
_stamps = random.SystemRandom()


def clock_base() -> int:
    """A new fence message's lowest base: the wall clock in microseconds (module docstring)."""
    return time.time_ns() // 1000


def fence_arguments(session: Session) -> dict[str, Any]:
    return lock_queue_arguments(session)


def fence_body(base: int, rule: str) -> bytes:
    """``b"<base> <rule>"``: the message's base and the counting rule it was minted under."""
    return f"{base} {rule}".encode()


def parse_fence_body(body: bytes) -> tuple[int, str | None]:
    """(base, rule) of a fence message; amqp-locks 0.1 wrote the base alone (no rule)."""
    parts = body.split()
    base = int(parts[0]) if parts and parts[0].isdigit() else 0
    rule = parts[1].decode(errors="replace") if len(parts) > 1 else None
    return base, rule


def rule_matches(rule: str | None, current: str) -> bool:
    """A message of amqp-locks 0.1 (no rule) was counted by ``x-delivery-count`` (all it
    knew): it matches every rule that still counts there, and is re-based on 4.3+."""
    return rule == current or (rule is None and current != counting_rule((4, 3)))


async def ensure_fence(session: Session, name: str) -> bool:
    """Make the fence shard lock `name` counts on, with its one message, unless it exists.
    Safe to race (the module docstring's test-and-set); True if this call made it."""
    return await _ensure_shard(session, fence_shard(name))


async def ensure_shards(session: Session) -> list[str]:
    """Make every fence shard that is missing (:func:`amqp_locks.prepare_fences`); returns
    the ones made now."""
    made = []
    for k in range(FENCE_SHARDS):
        queue = fence_queue(shard_lock(k))
        if await _ensure_shard(session, queue):
            made.append(queue)
    return made


def prepare_fences(broker: BrokerLike) -> list[str]:
    """Make the 16 fence shards now, at a quiet moment, rather than on the first fenced
    grant of each (once per broker or cluster; idempotent). Returns the queues made.

    Why bother: RabbitMQ 3.10.8 can lose a quorum queue made moments before its node is
    killed (measured: killed 50 ms after the declaration and a confirmed publish, the queue
    came back without a leader and every get timed out, also after a further restart).
    A shard lost that way is deleted by hand (``rabbitmqctl delete_queue
    amqp-locks-shard-KK-fence``) and the next fenced grant makes it again, above every
    earlier token (its base is the clock; the module docstring says when not)."""
    return broker._core.run(_prepare(broker._core))


async def _prepare(core: BrokerCore) -> list[str]:
    return await ensure_shards(await core.session())


async def _ensure_shard(session: Session, queue: str) -> bool:
    if queue in session.fences_known:
        return False
    created = False
    if not await session.exists_passive(queue):
        stamp = _stamps.randrange(2**40, 2**62)
        try:
            await session.declare(
                queue, durable=True, arguments={**fence_arguments(session), "x-max-length": stamp}
            )
        except PreconditionFailed:
            pass  # another creator's stamp: its message is on the way
        else:
            rule = counting_rule(broker_version(session))
            await session.publish("", queue, fence_body(clock_base(), rule), persistent=True)
            log.info("created fence shard %r", queue)
            session.fences_known.add(queue)
            created = True
    return created


async def ensure_name_fence(session: Session, name: str) -> bool:
    """Create lock `name`'s own fence `N-fence` with its one message unless it exists: the
    epochs of an administrator's token semaphore (:func:`take_epoch`). Call under the
    admin mutex (two creators could otherwise publish two fence messages). True if
    created now."""
    queue = fence_queue(name)
    if await session.exists_passive(queue):
        return False
    await session.declare(queue, durable=True, arguments=fence_arguments(session))
    rule = counting_rule(broker_version(session))
    await session.publish("", queue, fence_body(0, rule), persistent=True)
    log.info("created fence queue %r", queue)
    return True


async def repair_fence(session: Session, name: str, base: int) -> bool:
    """Put a fence message back into the shard of `name` if it lost its message (someone
    purged it). Its base is the larger of `base` and the clock (:func:`clock_base`): it
    must exceed every token already handed out by every lock of that shard. Call under the
    shard's lock (names.fence_shard_lock). True if a message was missing and was replaced."""
    await ensure_fence(session, name)
    queue = fence_shard(name)
    try:
        await _take_pushed(session, queue, 2.0)
    except FenceMissing:
        rule = counting_rule(broker_version(session))
        base = max(base, clock_base())
        await session.publish("", queue, fence_body(base, rule), persistent=True)
        log.warning("fence shard %r had no message: replaced with base %d", queue, base)
        return True
    return False


class _RuleChanged(Exception):
    """The fence message was minted under another counting rule: re-base it first."""


#: (the message's base plus its return count, the return count) of one take.
Taken = tuple[int, int]


def _count(message: DeliveredMessage, version: tuple[int, int]) -> Taken:
    """The message's base plus its return count under this broker's rule, and that count."""
    base, rule = parse_fence_body(message.body)
    if not rule_matches(rule, counting_rule(version)):
        raise _RuleChanged(rule)
    headers = (message.header.properties.headers or {}) if message.header else {}
    value = headers.get(acquired_count_header(version), 0)
    returns = int(value) if isinstance(value, int) else 0
    return base + returns, returns


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
    return await _take_from(session, name, fence_shard(name), timeout, shard=True)


async def take_epoch(session: Session, name: str, timeout: float = 30.0) -> int:
    """The next value of lock `name`'s own fence `N-fence` (made by its administrator,
    :func:`ensure_name_fence`): a token semaphore's epoch, which it shifts left by 32 bits
    (tokens/fencing.py). Its own counter rises only when tokens are published or given
    back by the broker, so its tokens stay far below 2**63; a shard's (about 2**51, and
    rising with every lock of the shard) would not."""
    return await _take_from(session, name, fence_queue(name), timeout, shard=False)


async def _take_from(session: Session, name: str, queue: str, timeout: float, shard: bool) -> int:
    for attempt in range(3):
        try:
            count, returns = await _take(session, queue, timeout)
            if returns >= RENEW_AFTER:
                renewed = await _renew(session, queue, timeout)
                if renewed is not None:
                    return renewed
            return count + 1
        except _RuleChanged:
            await _rebase(session, queue, timeout)
        except (QueueNotFound, aiormq.exceptions.AMQPError, ConnectionError) as exc:
            # Typed, so a waiter's reconnect logic sees a ConnectionLost: e.g. a consume
            # on a fence queue with no majority on this side, 541 "nodedown" (measured on
            # 4.3.6 in a 5-node split).
            err = exc if isinstance(exc, QueueNotFound) else channel_error(exc, queue)
            if not isinstance(err, QueueNotFound) or attempt or not shard:
                if err is exc:
                    raise
                raise err from exc
            session.fences_known.discard(queue)
            await ensure_fence(session, name)  # the first fenced grant of its shard
    raise LockError(f"the fence of {name!r} keeps changing counting rules (mixed brokers?)")


async def _take(session: Session, queue: str, timeout: float) -> Taken:
    version = broker_version(session)
    if session.cluster:
        # In a cluster, never basic.get: while the fence's leader is being re-elected
        # (about 0.5 s after its node dies) RabbitMQ 3.10 answers it with 541
        # INTERNAL_ERROR "nodedown", which closes the whole connection and loses every
        # lease on it. A consumer just waits for the new leader.
        return await _take_pushed(session, queue, timeout)
    if queue not in session.fences_known:
        # A connection's first take on a fence consumes too: RabbitMQ 3.10.8 can bring a
        # quorum queue made just before its node was killed back without a leader, and a
        # basic.get on it ends in 541 after 60 s, closing the whole connection with every
        # lease on it; a consumer times out alone (FenceMissing says what to do). A fence
        # that answered once was made long before any later crash.
        first = await _take_pushed(session, queue, timeout)
        session.fences_known.add(queue)
        return first

    async def get_and_return(ch: AbstractChannel) -> Taken | None:
        message = await ch.basic_get(queue, no_ack=False)
        if not isinstance(message.delivery, Basic.GetOk):
            return None
        try:
            return _count(message, version)
        finally:
            await ch.basic_reject(_tag(message), requeue=True)

    taken: Taken | None = await session.call(queue, get_and_return)
    if taken is None:
        taken = await _take_pushed(session, queue, timeout)
    return taken


async def _renew(session: Session, queue: str, timeout: float) -> int | None:
    """Take the fence message once more and replace it by one whose base is the token this
    take hands out: the next take gets that plus one, as it would have from the old
    message. Why: a quorum queue keeps its Raft log from the oldest message it holds, and
    a fence message is never acknowledged, so without a new message now and then its log
    (every take appends a checkout and a return) is never truncated, and its memory
    tables grow until the write-ahead log rolls over (docs/scaling.md). None when it did
    not happen (the message was not ours in time, or minted under another rule): the
    caller's own token stands. A failure after the commit was sent leaves a base above
    the caller's token, which is still unique."""
    version = broker_version(session)

    def renewed(message: DeliveredMessage) -> int | None:
        try:
            count, _ = _count(message, version)
        except _RuleChanged:
            return None
        return count + 1

    try:
        token = await _replace(session, queue, min(timeout, RENEW_WAIT), renewed)
    except TimeoutError:
        return None
    except (aiormq.exceptions.AMQPError, ConnectionError) as exc:
        log.debug("fence %r not renewed (%s): the earlier take's token stands", queue, exc)
        return None
    if token is not None:
        log.debug("fence %r renewed at base %d", queue, token)
    return token


async def _rebase(session: Session, queue: str, timeout: float) -> None:
    """Replace a fence message minted under another counting rule by one with a base
    above every token it can have produced (module docstring)."""
    rule = counting_rule(broker_version(session))
    old: list[tuple[int, str | None]] = []

    def rebased(message: DeliveredMessage) -> int | None:
        base, old_rule = parse_fence_body(message.body)
        if rule_matches(old_rule, rule):
            return None  # someone re-based it meanwhile
        old.append((base, old_rule))
        return base + REBASE_STEP

    try:
        new_base = await _replace(session, queue, timeout, rebased)
    except TimeoutError:
        raise FenceMissing(f"no fence message arrived from {queue!r} to re-base") from None
    if new_base is not None:
        [(base, old_rule)] = old
        log.warning(
            "fence %r was minted under counting rule %s, the broker now counts by %s: "
            "re-based from %d to %d (fencing tokens jump once)",
            queue, old_rule or "dc (amqp-locks 0.1)", rule, base, new_base,
        )


async def _replace(
    session: Session,
    queue: str,
    timeout: float,
    new_base: Callable[[DeliveredMessage], int | None],
) -> int | None:
    """Take the fence message of `queue` (pushed, TimeoutError after `timeout`) and, if
    ``new_base(message)`` gives a base, replace it in one AMQP transaction (ack + publish
    of a message with that base, minted under this broker's rule): the message is never
    lost nor doubled, even if we die in between. Returns that base, or None when
    `new_base` declined (closing the channel returns the message as it came)."""
    assert session.conn is not None
    rule = counting_rule(broker_version(session))
    ch = await session.conn.channel(publisher_confirms=False)  # tx and confirms exclude
    try:
        await ch.tx_select()
        message = await _first_pushed(ch, queue, timeout)
        base = new_base(message)
        if base is None:
            return None
        await ch.basic_ack(_tag(message))
        await ch.basic_publish(
            fence_body(base, rule),
            routing_key=queue,
            properties=Basic.Properties(delivery_mode=2),
        )
        await ch.tx_commit()
        return base
    finally:
        with contextlib.suppress(Exception):
            await ch.close()


async def _first_pushed(ch: AbstractChannel, queue: str, timeout: float) -> DeliveredMessage:
    """The first message the broker pushes from `queue` to a prefetch-1 consumer on `ch`
    (TimeoutError after `timeout`); it stays unacked on `ch`, as does any later one,
    until the caller settles it or closes the channel."""
    got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()

    async def on_message(message: DeliveredMessage) -> None:
        if not got.done():
            got.set_result(message)

    await ch.basic_qos(prefetch_count=1)
    await ch.basic_consume(queue, on_message, no_ack=False)
    return await asyncio.wait_for(got, timeout)


async def _take_pushed(session: Session, queue: str, timeout: float) -> Taken:
    ch = await session.open_channel()
    try:
        try:
            message = await _first_pushed(ch, queue, timeout)
        except TimeoutError:
            raise FenceMissing(
                f"no fence message arrived from {queue!r} within {timeout:.0f}s: it was purged, "
                "or dropped by a delivery limit (an operator policy 'delivery-limit' overrides "
                "x-delivery-limit: -1; docs/compatibility.md): run "
                "SemaphoreAdmin.repair_fence(base); or the queue has no leader (RabbitMQ 3.10 "
                "can lose a quorum queue made just before its node was killed): delete a fence "
                "shard (amqp-locks-shard-KK-fence) and the next grant makes it again, above "
                "every earlier token"
            ) from None
        try:
            return _count(message, broker_version(session))
        finally:
            await ch.basic_reject(_tag(message), requeue=True)
    except QueueNotFound:
        raise
    finally:
        with contextlib.suppress(Exception):
            await ch.close()
