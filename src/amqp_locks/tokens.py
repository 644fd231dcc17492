"""Token semaphore: the RabbitMQ blog's design, with what the blog leaves to the reader.

The durable queue `N.semaphore` holds one message per permit. A holder consumes with
prefetch 1 and manual ack and *never* acks: the broker keeps the delivered token unacked
on the holder's channel and gives it back to the queue when the holder rejects it (the
polite release), closes its channel or connection, or crashes. Waiting is pure push: every
waiter is a consumer, and the broker delivers the next free token to the waiter with the
highest consumer priority (`x-priority`).

What the blog leaves open, and how it is handled here:
- A token must never be acked by a holder: the API never exposes the delivery.
- A timed-out or cancelled waiter closes its channel, which returns any token that
  arrived after it stopped waiting: no token is ever stranded.
- The broker taking a token back (consumer cancelled because the queue was deleted, channel
  closed by `consumer_timeout`, connection lost) marks the permit lost at once.
- Altering the count: `add_permits` publishes new tokens; `remove_permits` drains tokens
  with a consumer of the highest priority and acks them, waiting for held ones to return.
- Integrity: the administration mutex `N` serialises admin actions; a ledger message in
  `N.semaphore-ledger` records the configured count and the token ids, so `setup` is
  idempotent and `audit`/`repair` can find missing or surplus tokens.
- Fencing: quorum token queues count returns per token (`x-delivery-count`, from 4.3
  `x-acquired-count`: `transport.features`). A classic token *carries* its counter
  (`epoch`, `count` headers; fencing token ``epoch << 32 | count``): a polite release acks
  it and publishes it again with ``count + 1`` in one AMQP transaction, so it is never lost
  nor doubled, and the next holder reads its fencing token for free. Only a token the
  broker gave back (``redelivered``: a holder died, was cut off or timed out, and may have
  used a value the message does not record) takes a fresh epoch from the lock's fence
  queue `N-fence`, above every value handed out before. A quorum token minted under
  another counting rule (the broker was upgraded across 3.13 -> 4.0 or 4.2 -> 4.3 since
  `setup`) falls back to the fence queue, shifted above every per-token value, until the
  tokens are published anew. Either way a protected resource keeps the highest token per
  (lock name, permit id) and refuses lower ones.
- Broker limits: RabbitMQ 3.12+ takes `x-consumer-timeout` per queue and the queue is
  declared with it (one year); on 3.10/3.11 only the global `consumer_timeout` exists and
  must be raised in rabbitmq.conf (the private dev node does). On 4.x quorum queues get
  `x-delivery-limit: -1`, or the default limit of 20 would drop a token after 20 hand-offs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp.commands import Basic

from .errors import (
    ConfigurationError,
    ConnectionLost,
    LockError,
    QueueNotFound,
    TokenSemaphoreNotFound,
)
from .fencing import ensure_fence, fence_arguments, rule_matches, take_token
from .holders import HolderQueries
from .lease import HeldState, Lease
from .lockobject import LockObject
from .mutex import held_mutex
from .names import token_queue, validate_name
from .transport.broker import BrokerCore, BrokerLike
from .transport.errors import channel_error
from .transport.features import (
    acquired_count_header,
    broker_version,
    consumer_timeout_arguments,
    counting_rule,
    quorum_arguments,
)
from .transport.session import Session
from .transport.shield import shielded
from .waiting import Backoff, check_timeout

log = logging.getLogger("amqp_locks.tokens")

#: Consumer priority of the drain consumer used by remove_permits/audit: above any waiter.
DRAIN_PRIORITY = 2**31 - 1
MAX_PRIORITY = 2**31 - 2
#: Token header saying where its fencing token comes from: on quorum queues the counting
#: rule it was minted under (`features.counting_rule`; amqp-locks 0.1 wrote
#: "delivery-count"), per-token return counts; "fence": the lock's fence queue.
FENCING_HEADER = "amqp-locks-fencing"
DELIVERY_COUNT = "delivery-count"
FENCE = "fence"
#: Classic tokens that carry their counter in EPOCH_HEADER / COUNT_HEADER.
CARRIED = "carried"
EPOCH_HEADER = "amqp-locks-epoch"
COUNT_HEADER = "amqp-locks-count"
#: Quorum tokens: added to the delivery count (see `_publish_tokens`).
BASE_HEADER = "amqp-locks-fence-base"
#: How long a non-blocking acquire waits for a token the broker reported ready.
NONBLOCKING_GRACE = 1.0




def ledger_queue(name: str) -> str:
    return f"{token_queue(name)}-ledger"


def token_arguments(session: Session, quorum: bool) -> dict[str, Any]:
    """The token queue's arguments for this broker (see the module docstring)."""
    version = broker_version(session)
    args: dict[str, Any] = quorum_arguments(version) if quorum else {}
    # 3.12 added the per-queue timeout; 4.3 stopped timing out classic-queue consumers
    # and refuses the argument there (rabbitmq-server#17144), so it goes to quorum only.
    return {**args, **consumer_timeout_arguments(version, quorum)}


# --- the holder's side -------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class PermitState(HeldState):
    """A token delivered to us and left unacked on our own channel."""

    channel: AbstractChannel
    consumer_tag: str
    delivery_tag: int
    quorum: bool
    #: The token as delivered (re-published by the release when it carries its counter).
    message: DeliveredMessage
    #: (epoch, count) this holder's fencing token was made of: the release publishes the
    #: token again with count + 1. None: the release returns it as it came (reject).
    carry: tuple[int, int] | None = None
    #: Called by the broker's consumer cancel (set by `acquire_permit`; removed on release).
    on_cancel: Any = field(default=None)

    def attach(self) -> None:
        """Watch for everything by which the broker can take the token back."""
        self._listener = self.session.add_listener(self._on_session_lost)
        self.session.leases.add(self)
        self.channel.closing.add_done_callback(self._on_channel_closed)

    def _detach(self) -> None:
        """The pooled channel outlives us: take our callbacks off it."""
        self.channel.closing.remove_done_callback(self._on_channel_closed)
        self.channel.on_consumer_cancel_callbacks.discard(self.on_cancel)

    def on_broker_cancel(self) -> None:
        self.lose(
            f"the broker cancelled our consumer on {token_queue(self.name)!r} "
            "(queue deleted?): the token is no longer ours"
        )

    def _on_channel_closed(self, fut: asyncio.Future[Any]) -> None:
        if self.released or self.lost_reason is not None:
            return
        exc = None if fut.cancelled() else fut.exception()
        self.lose(f"channel holding the token closed: {exc}" if exc else "channel closed")

    async def verify(self) -> bool:
        """Still held: our channel and consumer are alive and the token queue exists."""
        if self.released:
            from .errors import LeaseReleased

            raise LeaseReleased(f"permit {self.number} of {self.name!r} was released")
        if self.lost_reason is not None or self.channel.is_closed or not self.session.alive:
            return False
        if not await self.session.exists_passive(token_queue(self.name)):
            self.lose(f"{token_queue(self.name)!r} no longer exists")
            return False
        return True

    async def release(self) -> None:
        """Cancel our consumer (so the token is not re-delivered to us), then, in one
        transaction, either ack the token and publish it again with its counter raised
        (it carries its counter) or reject it with requeue: at the commit the broker hands
        it to the best waiting consumer. If anything fails before the commit, closing the
        channel gives the token back as it came (the broker then flags it redelivered)."""
        if self.released:
            return
        self.released = True
        self._emit_release()
        self.session.remove_listener(self._listener)
        self.session.leases.discard(self)
        ch = self.channel
        self._detach()
        if ch.is_closed or not self.session.alive:
            return
        # The caller does not wait for the commit: the broker hands the token on at the
        # commit whoever waits for its reply (Session.close lets it finish).
        self.session.spawn(self._give_back(ch))

    async def _give_back(self, ch: AbstractChannel) -> None:
        try:
            # No need to wait for cancel-ok: the broker handles a channel's methods in
            # order, so the consumer is gone before the commit requeues the token.
            await ch.basic_cancel(self.consumer_tag, nowait=True)
            if self.carry is not None:
                await ch.basic_ack(self.delivery_tag)
                await ch.basic_publish(
                    self.message.body,
                    routing_key=token_queue(self.name),
                    properties=_carrying(self.message, self.carry[0], self.carry[1] + 1),
                )
            else:
                await ch.basic_reject(self.delivery_tag, requeue=True)
            await ch.tx_commit()
        except Exception as exc:
            log.debug("polite release failed (%s); closing the channel returns the token", exc)
            self.session.spawn(_close(ch))
        else:
            self.session.return_holder_channel(ch, transactional=True)
        log.debug("released permit %d of %r", self.number, self.name)


async def _close(ch: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        await ch.close()


def _token_id(message: DeliveredMessage) -> int:
    body = message.body.strip()
    return int(body) if body.isdigit() else 0


def _text(value: Any) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _carrying(message: DeliveredMessage, epoch: int, count: int) -> Basic.Properties:
    """The token's properties, carrying (epoch, count)."""
    props = message.header.properties if message.header else Basic.Properties()
    headers = dict(props.headers or {})
    headers.update({FENCING_HEADER: CARRIED, EPOCH_HEADER: epoch, COUNT_HEADER: count})
    return Basic.Properties(
        delivery_mode=2,
        message_id=props.message_id,
        app_id=props.app_id,
        headers=headers,
    )


def _int_header(headers: dict[str, Any], key: str) -> int | None:
    value = headers.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _classic_fencing(
    session: Session, name: str, message: DeliveredMessage, fencing: bool
) -> tuple[int, tuple[int, int] | None]:
    """(fencing token, carry) of a classic token (see the module docstring)."""
    headers = (message.header.properties.headers or {}) if message.header else {}
    epoch, count = _int_header(headers, EPOCH_HEADER), _int_header(headers, COUNT_HEADER)
    redelivered = bool(getattr(message.delivery, "redelivered", False))
    carried = _text(headers.get(FENCING_HEADER)) == CARRIED
    if carried and epoch is not None and count is not None and not redelivered and (
        0 <= count < 2**32
    ):
        return (epoch << 32 | count if fencing else 0), (epoch, count)
    if not fencing:
        return 0, None  # returned as it came: the next fenced holder mints an epoch
    epoch = await take_token(session, name)
    return epoch << 32, (epoch, 0)


async def _fencing_token(session: Session, name: str, message: DeliveredMessage) -> int | None:
    """A quorum token's fencing token from its own return count, or None for a classic
    token (see :func:`_classic_fencing`)."""
    headers = (message.header.properties.headers or {}) if message.header else {}
    source = _text(headers.get(FENCING_HEADER))
    if source in (None, FENCE, CARRIED):
        return None
    version = broker_version(session)
    base = headers.get(BASE_HEADER, 0)
    base = base if isinstance(base, int) else 0
    rule = None if source == DELIVERY_COUNT else source
    if not rule_matches(rule, counting_rule(version)):
        # Minted under another counting rule: its count may have restarted. A fresh fence
        # value shifted like a base is above every token this permit produced so far.
        return (await take_token(session, name) << 32) + 1
    value = headers.get(acquired_count_header(version), 0)
    return base + (int(value) if isinstance(value, int) else 0) + 1


async def acquire_permit(
    core: BrokerCore,
    name: str,
    *,
    priority: int,
    blocking: bool,
    timeout: float | None,
    fencing: bool = True,
) -> PermitState | None:
    """Consume one token (push). None when not blocking and none is free, or timed out."""
    session = await core.session()
    queue = token_queue(name)
    if not blocking or timeout == 0:
        try:
            ready = await session.declare_passive_count(queue)
        except QueueNotFound:
            raise TokenSemaphoreNotFound(
                f"token semaphore {name!r} does not exist ({queue!r} missing): "
                "run TokenSemaphore.setup(permits)"
            ) from None
        if ready == 0:
            return None
        timeout = NONBLOCKING_GRACE
    ch = await shielded(session.holder_channel(transactional=True), _close)
    got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()
    state_box: list[PermitState] = []

    async def on_token(message: DeliveredMessage) -> None:
        if not got.done():
            got.set_result(message)
        # prefetch 1: nothing else can arrive until this one is returned

    def on_cancel(_: Basic.Cancel) -> None:
        if state_box:
            state_box[0].on_broker_cancel()
        elif not got.done():
            got.set_exception(
                TokenSemaphoreNotFound(f"{queue!r} was deleted while we waited for a token")
            )

    ch.on_consumer_cancel_callbacks.add(on_cancel)

    def on_closed(_: Any) -> None:
        # Our connection (or channel) died while we waited: no token can arrive here.
        if not got.done():
            got.set_exception(
                ConnectionLost(f"channel waiting on {queue!r} closed: {session.lost_reason}")
            )

    ch.closing.add_done_callback(on_closed)

    async def start_consuming() -> Any:
        return await ch.basic_consume(
            queue, on_token, no_ack=False, arguments={"x-priority": priority}
        )

    try:
        try:
            ok = await shielded(start_consuming(), lambda _: _close(ch))
        except Exception as exc:
            err = channel_error(exc, queue)
            if isinstance(err, QueueNotFound):
                raise TokenSemaphoreNotFound(
                    f"token semaphore {name!r} does not exist ({queue!r} missing): "
                    "run TokenSemaphore.setup(permits)"
                ) from None
            raise err from exc
        try:
            message = await asyncio.wait_for(asyncio.shield(got), timeout)
        except TimeoutError:
            got.cancel()  # nobody awaits it any more (on_closed must not set it)
            # Closing the channel returns a token that may be arriving right now.
            await _close(ch)
            return None
        tag = getattr(message.delivery, "delivery_tag", None)
        assert isinstance(tag, int)
        token_id = _token_id(message)
        own = await shielded(_fencing_token(session, name, message), lambda _: _close(ch))
        quorum = own is not None
        carry: tuple[int, int] | None = None
        if own is not None:
            fencing_token = own
        else:
            fencing_token, carry = await shielded(
                _classic_fencing(session, name, message, fencing), lambda _: _close(ch)
            )
        state = PermitState(
            core=core,
            session=session,
            kind="token",
            name=name,
            number=token_id,
            fencing_token=fencing_token,
            channel=ch,
            consumer_tag=str(ok.consumer_tag),
            delivery_tag=tag,
            quorum=quorum,
            message=message,
            carry=carry,
            on_cancel=on_cancel,
        )
        state_box.append(state)
        state.attach()
        if ch.is_closed:
            state.lose("channel closed while the token was being granted")
        return state
    except BaseException:
        if not state_box:
            if not got.done():
                got.cancel()
            session.spawn(_close(ch))  # returns a token that may be arriving right now
        raise


class TokenSemaphore(LockObject, HolderQueries):
    """A counting (or binary) semaphore of `permits` token messages in `name.semaphore`.

    ``priority`` is this client's consumer priority: the broker gives a freed token to the
    waiting consumer with the highest priority. ``fencing=False`` skips the fence round
    trip on classic token queues (``fencing_token`` is then 0); quorum token queues carry
    their fencing counter for free. Admin methods (`setup`, `add_permits`,
    `remove_permits`, `status`, `audit`, `repair`) run under the administration mutex.
    ``timeout`` / ``blocking`` are what ``with sem as permit:`` waits (default: for ever);
    it raises :class:`~amqp_locks.errors.LockTimeout` when no permit was obtained.
    """

    kind = "token"

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        priority: int = 0,
        quorum: bool = False,
        fencing: bool = True,
        mutex_timeout: float | None = 30.0,
    ) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigurationError(f"priority must be an int, got {type(priority).__name__}")
        if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise ConfigurationError(f"priority must be within ±{MAX_PRIORITY}, got {priority}")
        self.broker = broker
        self.name = validate_name(name)
        self.priority = priority
        self.quorum = quorum
        self.fencing = fencing
        self.mutex_timeout = check_timeout(mutex_timeout)
        self._init_wait(blocking, timeout)

    @property
    def _core(self) -> BrokerCore:
        return self.broker._core

    # --- holders --------------------------------------------------------------------------

    async def _wait(self, blocking: bool, timeout: float | None) -> PermitState | None:
        """Wait for a token; when the connection dies meanwhile (its node died), wait on a
        new one (the next node of a cluster) for the time that is left."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        retried = False
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await acquire_permit(
                    self._core,
                    self.name,
                    priority=self.priority,
                    blocking=blocking,
                    timeout=left,
                    fencing=self.fencing,
                )
            except ConnectionLost:
                if (not blocking and retried) or (left is not None and left <= 0):
                    raise
                retried = True

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Lease | None:
        """Take a permit: a :class:`Lease` (``number`` is the permit id), or None."""
        return super().acquire(blocking, timeout)

    # --- administration ---------------------------------------------------------------

    def _admin(self, action: Any) -> Any:
        async def locked() -> Any:
            async with held_mutex(self._core, self.name, self.mutex_timeout, Backoff()) as m:
                return await action(m.session)

        return self._core.run(locked())

    def setup(self, permits: int) -> int:
        """Declare the token queue and publish exactly `permits` tokens. Idempotent: a
        semaphore already set up with the same count is left alone; another count is
        refused (use add_permits/remove_permits). Returns the count."""
        permits = _positive(permits, "permits")

        async def setup(session: Session) -> int:
            await self._declare(session)
            ledger = await _read_ledger(session, self.name)
            if ledger is not None:
                if ledger.permits != permits:
                    raise LockError(
                        f"token semaphore {self.name!r} already has {ledger.permits} permits; "
                        "use add_permits()/remove_permits() to change it"
                    )
                return permits
            ids = list(range(1, permits + 1))
            await ensure_fence(session, self.name)
            await _publish_tokens(session, self.name, ids, self.quorum)
            await _write_ledger(session, self.name, Ledger(0, [], self.quorum).with_ids(ids))
            log.info("set up token semaphore %r with %d permits", self.name, permits)
            return permits

        return int(self._admin(setup))

    async def _declare(self, session: Session) -> None:
        await session.declare(
            token_queue(self.name), durable=True, arguments=token_arguments(session, self.quorum)
        )
        # A quorum semaphore's ledger is replicated too, or losing its node would stop
        # status/audit/admin. An existing ledger is kept whatever its type.
        ledger = ledger_queue(self.name)
        if not await session.exists_passive(ledger):
            args = fence_arguments(session) if self.quorum else None
            await session.declare(ledger, durable=True, arguments=args)

    def add_permits(self, count: int) -> list[int]:
        """Publish `count` new tokens; returns their ids."""
        count = _positive(count, "count")

        async def add(session: Session) -> list[int]:
            ledger = await _require_ledger(session, self.name)
            start = max(ledger.next_id, 1)
            new = list(range(start, start + count))
            await _publish_tokens(session, self.name, new, ledger.quorum)
            await _write_ledger(session, self.name, ledger.with_ids(ledger.ids + new))
            log.info("added permits %s to %r", new, self.name)
            return new

        result: list[int] = self._admin(add)
        return result

    def remove_permits(self, count: int, timeout: float | None = None) -> list[int]:
        """Take `count` tokens out of circulation (a top-priority consumer acks them),
        waiting up to `timeout` for held ones to come back. Returns the removed ids
        (fewer than `count` if the timeout passed first)."""
        count = _positive(count, "count")
        timeout = check_timeout(timeout)

        async def remove(session: Session) -> list[int]:
            ledger = await _require_ledger(session, self.name)
            want = min(count, ledger.permits)
            removed = await _drain(session, self.name, want, timeout, ack=True)
            await _write_ledger(
                session, self.name, ledger.with_ids([i for i in ledger.ids if i not in removed])
            )
            log.info("removed permits %s from %r", removed, self.name)
            return removed

        result: list[int] = self._admin(remove)
        return result

    def status(self) -> TokenStatus:
        """Permits configured, tokens ready in the queue, held (configured - ready) and
        consumers (holders + waiters + drains) — from the ledger and one passive declare."""

        async def status(session: Session) -> TokenStatus:
            return await read_status(session, self.name)

        # Read-only: no admin mutex, so status works while an admin drains or audits.
        result: TokenStatus = self._core.run(self._with_session(status))
        return result

    async def _with_session(self, action: Any) -> Any:
        return await action(await self._core.session())

    def audit(self, timeout: float = 5.0) -> Audit:
        """Take every token with a top-priority consumer for up to `timeout` seconds (held
        ones are seen when they come back), then return them all. Ids never seen are
        reported missing (lost, or held all along); ids seen twice are surplus. Waiters get
        no token while the audit runs."""
        timeout = float(check_timeout(timeout) or 0.0)

        async def audit(session: Session) -> Audit:
            ledger = await _require_ledger(session, self.name)
            seen = await _collect(session, self.name, ledger, timeout)
            return _audit(ledger, seen)

        result: Audit = self._admin(audit)
        return result

    def repair(self, timeout: float = 5.0) -> Audit:
        """Audit, then ack surplus duplicates and re-publish ids not seen. Only safe when
        every holder returns its token within `timeout` (a token held all along would be
        duplicated; a later audit+repair removes that duplicate again)."""
        timeout = float(check_timeout(timeout) or 0.0)

        async def repair(session: Session) -> Audit:
            ledger = await _require_ledger(session, self.name)
            seen = await _collect(session, self.name, ledger, timeout, drop_surplus=True)
            result = _audit(ledger, seen)
            if result.missing:
                await _publish_tokens(session, self.name, list(result.missing), ledger.quorum)
                log.warning("re-published missing permits %s of %r", result.missing, self.name)
            return result

        result: Audit = self._admin(repair)
        return result

    def destroy(self) -> None:
        """Delete the token queue and its ledger (holders are told: consumer cancelled)."""

        async def destroy(session: Session) -> None:
            await session.delete(token_queue(self.name))
            await session.delete(ledger_queue(self.name))

        self._admin(destroy)

    def __repr__(self) -> str:
        return f"TokenSemaphore({self.name!r}, priority={self.priority})"


# --- ledger, tokens, draining --------------------------------------------------------------


@dataclass(frozen=True)
class Ledger:
    """The configured count, the ids in circulation, the queue type, and the next id:
    ids are never reused, so a quorum token's per-id delivery count stays monotonic."""

    permits: int
    ids: list[int]
    quorum: bool = False
    next_id: int = 0

    def with_ids(self, ids: list[int]) -> Ledger:
        return Ledger(len(ids), ids, self.quorum, max([self.next_id, *(i + 1 for i in ids)]))


@dataclass(frozen=True)
class TokenStatus:
    permits: int
    ready: int
    held: int
    consumers: int
    waiting: int


@dataclass(frozen=True)
class Audit:
    permits: int
    seen: tuple[int, ...]
    missing: tuple[int, ...]
    surplus: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return not self.missing and not self.surplus


async def read_status(session: Session, name: str) -> TokenStatus:
    """Permits (the ledger), ready tokens and consumers (one passive declare)."""
    ledger = await _require_ledger(session, name)
    ready, consumers = await session.declare_passive_counts(token_queue(name))
    held = max(0, ledger.permits - ready)
    return TokenStatus(ledger.permits, ready, held, consumers, max(0, consumers - held))


def _positive(x: int, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ConfigurationError(f"{what} must be an int >= 1, got {x!r}")
    return x


async def _publish_tokens(session: Session, name: str, ids: list[int], quorum: bool) -> None:
    """Publish tokens `ids`. A quorum token's fencing counter is its return count, which
    restarts at 0 for a new message; its base (one fresh `N-fence` token, shifted by 32
    bits, rising for ever) keeps a re-published id's tokens above its earlier ones. A
    classic token carries (that fresh epoch, count 0)."""
    queue = token_queue(name)
    await ensure_fence(session, name)
    epoch = await take_token(session, name)
    headers: dict[str, Any]
    if quorum:
        rule = counting_rule(broker_version(session))
        headers = {FENCING_HEADER: rule, BASE_HEADER: epoch << 32}
    else:
        headers = {FENCING_HEADER: CARRIED, EPOCH_HEADER: epoch, COUNT_HEADER: 0}

    async def publish(ch: AbstractChannel) -> None:
        await asyncio.gather(
            *(
                ch.basic_publish(
                    str(i).encode(),
                    routing_key=queue,
                    mandatory=True,
                    properties=Basic.Properties(
                        delivery_mode=2,
                        message_id=f"{name}#{i}",
                        app_id="amqp-locks",
                        headers=headers,
                    ),
                )
                for i in ids
            )
        )

    await session.call(queue, publish)


async def _read_ledger(session: Session, name: str) -> Ledger | None:
    """The newest ledger record (several exist only after a crash mid-write)."""
    queue = ledger_queue(name)
    ch = await session.open_channel()
    try:
        best: Ledger | None = None
        best_version = -1
        try:
            while True:
                message = await ch.basic_get(queue, no_ack=False)
                if not isinstance(message.delivery, Basic.GetOk):
                    break
                record = json.loads(message.body)
                if record["version"] > best_version:
                    best_version = record["version"]
                    ids = [int(i) for i in record["ids"]]
                    best = Ledger(
                        int(record["permits"]),
                        ids,
                        bool(record.get("quorum", False)),
                        int(record.get("next_id", max(ids, default=0) + 1)),
                    )
        except Exception as exc:
            raise channel_error(exc, queue) from exc
        session.ledger_versions[name] = best_version
        return best
    finally:
        await _close(ch)  # every record goes back (unacked)


async def _require_ledger(session: Session, name: str) -> Ledger:
    try:
        ledger = await _read_ledger(session, name)
    except QueueNotFound:
        ledger = None
    if ledger is None:
        raise TokenSemaphoreNotFound(
            f"token semaphore {name!r} is not set up: run TokenSemaphore.setup(permits)"
        )
    return ledger


async def _write_ledger(session: Session, name: str, ledger: Ledger) -> None:
    """Publish the new record (confirmed), then drop the older ones."""
    queue = ledger_queue(name)
    version = session.ledger_versions.get(name, -1) + 1
    body = json.dumps(
        {
            "version": version,
            "permits": ledger.permits,
            "ids": ledger.ids,
            "quorum": ledger.quorum,
            "next_id": ledger.next_id,
        }
    )
    await session.publish("", queue, body.encode(), persistent=True)
    ch = await session.open_channel()
    try:
        while True:
            message = await ch.basic_get(queue, no_ack=False)
            if not isinstance(message.delivery, Basic.GetOk):
                break
            tag = getattr(message.delivery, "delivery_tag", 0)
            if json.loads(message.body)["version"] < version:
                await ch.basic_ack(tag)
    finally:
        await _close(ch)  # the newest record goes back
    session.ledger_versions[name] = version


async def _drain(
    session: Session, name: str, count: int, timeout: float | None, *, ack: bool
) -> list[int]:
    """Take up to `count` tokens with the top-priority consumer; ack them if `ack`."""
    if count <= 0:
        return []
    ch = await session.open_channel()
    taken: list[int] = []
    done = asyncio.Event()

    async def on_token(message: DeliveredMessage) -> None:
        tag = getattr(message.delivery, "delivery_tag", 0)
        if len(taken) >= count:
            return  # returned when the channel closes
        taken.append(_token_id(message))
        if ack:
            await ch.basic_ack(tag)
        if len(taken) >= count:
            done.set()

    try:
        await ch.basic_qos(prefetch_count=count)
        await ch.basic_consume(
            token_queue(name), on_token, no_ack=False, arguments={"x-priority": DRAIN_PRIORITY}
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout)
        return list(taken)
    finally:
        await _close(ch)


async def _collect(
    session: Session, name: str, ledger: Ledger, timeout: float, *, drop_surplus: bool = False
) -> list[int]:
    """Hold every token that shows up within `timeout` (or until every ledger id was
    seen); ack duplicates and unknown ids if `drop_surplus`; return the rest by closing
    the channel."""
    known = set(ledger.ids)
    ch = await session.open_channel()
    seen: list[int] = []
    enough = asyncio.Event()

    async def on_token(message: DeliveredMessage) -> None:
        token_id = _token_id(message)
        tag = getattr(message.delivery, "delivery_tag", 0)
        if drop_surplus and (token_id in seen or token_id not in known):
            await ch.basic_ack(tag)
        seen.append(token_id)
        if known <= set(seen):
            enough.set()

    try:
        await ch.basic_qos(prefetch_count=0)
        await ch.basic_consume(
            token_queue(name), on_token, no_ack=False, arguments={"x-priority": DRAIN_PRIORITY}
        )
        deadline = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), timeout)
        # surplus tokens ready beside a complete set arrive right behind it
        await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return seen
    finally:
        await _close(ch)


def _audit(ledger: Ledger, seen: list[int]) -> Audit:
    counts: dict[int, int] = {}
    for i in seen:
        counts[i] = counts.get(i, 0) + 1
    missing = tuple(i for i in ledger.ids if i not in counts)
    surplus = tuple(sorted(i for i, n in counts.items() if n > 1 or i not in ledger.ids))
    return Audit(ledger.permits, tuple(sorted(counts)), missing, surplus)


__all__ = ["Audit", "TokenSemaphore", "TokenSemaphoreNotFound", "TokenStatus"]
