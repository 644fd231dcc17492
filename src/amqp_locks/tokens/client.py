"""The token semaphore's client: wait for a token (push), read its fencing token, hold it.

`acquire_permit` is the hot path: one consume on a holder channel kept open and ready
(prefetch 1, transactions selected) by the session, then nothing but what the token itself
needs (a fence round trip only for a token that cannot tell its own value). Each step is a
method of :class:`_Waiter`, which owns the channel until a :class:`PermitState` takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ..errors import (
    AmqpLocksError,
    ClusterUnreachable,
    ConfigurationError,
    ConnectionLost,
    QueueNotFound,
    TokenSemaphoreNotFound,
)
from ..holders import HolderQueries, Reading
from ..lease import Lease
from ..lockobject import LockObject
from ..names import token_queue, validate_name
from ..replication import choose_quorum
from ..shape import MUTEX, TOKEN_KINDS, Expected, permits_refusal, token_kind
from ..shape import check as check_shape
from ..stamps import MAX_PERMITS
from ..transport.broker import BrokerCore, BrokerLike
from ..transport.channel_ops import consume_at
from ..transport.errors import channel_error
from ..transport.session import Session
from ..transport.shield import close_quietly, shielded
from ..transport.wire import AbstractChannel, Basic, DeliveredMessage
from ..waiting import check_timeout, pause_for_a_node
from . import fresh
from .admin import MUTEX_TIMEOUT, TokenAdmin
from .drain import MAX_PRIORITY
from .fencing import carried_fencing, fencing_for
from .heal import stop as stop_healing
from .heal import token_plan
from .heal import watch as heal_watch
from .ledger import Audit, TokenStatus, read_ledger, read_token
from .message import delivery_tag, token_id
from .permit import PermitState
from .shapes import read_token_shape

#: How long a non-blocking acquire waits for a token the broker reported ready.
NONBLOCKING_GRACE = 1.0
#: How many times one acquire of a first-use semaphore makes (or finds made) its queue.
FIRST_USE_ROUNDS = 8


def _not_set_up(name: str) -> TokenSemaphoreNotFound:
    return TokenSemaphoreNotFound(
        f"token semaphore {name!r} does not exist ({token_queue(name)!r} missing): "
        "run TokenSemaphore.setup(permits)"
    )


async def acquire_permit(
    core: BrokerCore,
    name: str,
    *,
    priority: int,
    blocking: bool,
    timeout: float | None,
    fencing: bool = True,
    heal: bool = False,
    expect: Expected | None = None,
    check_running: bool = False,
) -> PermitState | None:
    """Consume one token (push). None when not blocking and none is free, or timed out.
    `heal`: the queue was made on first use; a waiter that waits watches it for tokens
    lost at its creation, and replaces it (tokens/heal.py). The token is checked against
    `expect` (default: any token semaphore's) before it is granted (shape.py).
    `check_running`: a first-use quorum queue, which may be starting right now: it is
    seen running before we consume (fresh.until_running)."""
    session = await core.session()
    if not blocking or timeout == 0:
        # A passive declare is safe during a quorum queue's election on every line (the
        # queue's stat answers 0 when no leader does); a consume is not on 3.10.8 (a
        # checkout that meets no leader crashes the channel, 541: docs/cluster.md).
        if await _ready_tokens(session, name) == 0:
            return None
        timeout = NONBLOCKING_GRACE  # another client may take the ready token first
    elif check_running:
        try:
            await fresh.until_running(session, token_queue(name))
        except QueueNotFound:
            raise _not_set_up(name) from None
    # Without fencing the release returns the token as it came (`basic.reject`), which
    # needs no transaction: a plain channel, and no commit to wait for.
    waiter = await _Waiter.open(session, name, transactional=fencing)
    waiter.expect = expect or Expected(TOKEN_KINDS, None, f"token semaphore {name!r}")
    try:
        consumer_tag = await waiter.consume(priority)
        healer = (
            session.spawn(
                heal_watch(session, token_plan(session, name, waiter.replaced), waiter.delivered)
            )
            if heal and blocking and timeout != NONBLOCKING_GRACE
            else None
        )
        message = await waiter.next_token(timeout, healer)
        if message is None:
            return None
        state = await waiter.grant(core, consumer_tag, message, fencing)
    except BaseException:
        waiter.abandon()
        raise
    if check_running:
        fresh.saw_running(session, token_queue(name))
    return state


async def _ready_tokens(session: Session, name: str) -> int:
    """Tokens ready in the queue (one passive declare): a non-blocking acquire's check."""
    try:
        return await session.declare_passive_count(token_queue(name))
    except QueueNotFound:
        raise _not_set_up(name) from None


async def _spare_holder(session: Session, transactional: bool) -> None:
    """Make sure the session's pool has a ready holder channel (opened if none is idle)."""
    ch = session.idle_holder_channel(transactional)
    if ch is None:
        ch = await shielded(session.holder_channel(transactional), close_quietly)
    session.return_holder_channel(ch, transactional)


class DeletedWhileWaiting(TokenSemaphoreNotFound):
    """The broker cancelled our waiting consumer: the queue was deleted (a heal, an
    expiry, an operator), and may still be being deleted
    (:func:`fresh.until_deleted`)."""


class _Waiter:
    """One waiting consumer on its own holder channel. The broker pushes it a token,
    cancels it (the queue was deleted) or closes its channel: whichever comes first
    settles `delivered`. Once granted, the :class:`PermitState` watches the channel."""

    def __init__(
        self, session: Session, name: str, channel: AbstractChannel, transactional: bool
    ) -> None:
        self.session = session
        self.name = name
        self.queue = token_queue(name)
        self.channel = channel
        self.transactional = transactional
        self.delivered: asyncio.Future[DeliveredMessage] = (
            asyncio.get_running_loop().create_future()
        )
        self.state: PermitState | None = None
        #: What the token must say before it is granted (shape.py).
        self.expect = Expected(TOKEN_KINDS, None, f"token semaphore {name!r}")
        channel.on_consumer_cancel_callbacks.add(self.on_cancel)
        channel.closing.add_done_callback(self.on_closed)

    @classmethod
    async def open(cls, session: Session, name: str, transactional: bool) -> _Waiter:
        """Take a ready holder channel (a cancelled caller's channel is closed again)."""
        channel = session.idle_holder_channel(transactional)
        if channel is None:  # none idle: open one, never cancelled half-way
            channel = await shielded(session.holder_channel(transactional), close_quietly)
        return cls(session, name, channel, transactional)

    # --- what the broker tells us -----------------------------------------------------

    async def on_token(self, message: DeliveredMessage) -> None:
        # prefetch 1: nothing else can arrive until this one is returned
        if not self.delivered.done():
            self.delivered.set_result(message)

    def on_cancel(self, _: Basic.Cancel) -> None:
        if self.state is not None:
            self.state.on_broker_cancel()
        else:
            self._gone("was deleted")

    def replaced(self) -> None:
        """The queue was replaced and the broker told us nothing (transport/features.py,
        ``cancels_reach_holders``): wait again as after a cancel, on a new channel; closing
        this one returns a token the hollow consumer took."""
        if self.state is None:
            self._gone("was replaced")

    def _gone(self, what: str) -> None:
        if not self.delivered.done():
            self.delivered.set_exception(
                DeletedWhileWaiting(f"{self.queue!r} {what} while we waited for a token")
            )

    def on_closed(self, _: Any) -> None:
        # Our connection (or channel) died while we waited: no token can arrive here.
        if not self.delivered.done():
            self.delivered.set_exception(
                ConnectionLost(
                    f"channel waiting on {self.queue!r} closed: {self.session.lost_reason}"
                )
            )

    # --- the steps ----------------------------------------------------------------------

    async def consume(self, priority: int) -> str:
        """Start consuming with our priority; returns the consumer tag."""
        try:
            tag = await shielded(
                consume_at(self.channel, self.queue, self.on_token, priority=priority),
                lambda _: close_quietly(self.channel),
            )
        except Exception as exc:
            err = channel_error(exc, self.queue)
            if isinstance(err, QueueNotFound):
                raise _not_set_up(self.name) from None
            raise err from exc
        return tag

    async def next_token(
        self, timeout: float | None, healer: asyncio.Task[None] | None = None
    ) -> DeliveredMessage | None:
        """The token the broker pushes us, or None after `timeout`. A `healer`
        (tokens/heal.py) is stopped, its registration withdrawn, before we return: a
        holder never counts as a waiter, and a leaving waiter stops counting as one
        before it stops consuming."""
        try:
            if not self.delivered.done():  # else pushed right behind consume-ok
                await asyncio.wait_for(asyncio.shield(self.delivered), timeout)
        except TimeoutError:
            self.delivered.cancel()  # nobody awaits it any more (on_closed must not set it)
            await stop_healing(healer, strict=False)
            # Closing the channel returns a token that may be arriving right now.
            await close_quietly(self.channel)
            return None
        except BaseException:
            await stop_healing(healer, strict=False)
            raise
        await stop_healing(healer)  # raises if not withdrawn: the caller returns the token
        return self.delivered.result()

    async def grant(
        self, core: BrokerCore, consumer_tag: str, message: DeliveredMessage, fencing: bool
    ) -> PermitState:
        """Check the token's shape (LockShapeMismatch: the caller's `abandon` closes the
        channel, which returns the token), read its fencing token and hand the channel to
        the held state."""
        await check_shape(
            self.session,
            self.queue,
            message,
            self.expect,
            lambda need_delay: read_token_shape(self.session, self.name, need_delay),
        )
        known = carried_fencing(message, fencing)
        if known is not None:  # the token tells its own value: no round trip
            (fencing_token, carry), quorum = known, False
        else:
            fencing_token, carry, quorum = await shielded(
                fencing_for(self.session, self.name, message, fencing),
                lambda _: close_quietly(self.channel),
            )
        if not self.transactional:  # returned as it came, by a reject (see above)
            carry = None
        state = PermitState(
            core=core,
            transactional=self.transactional,
            session=self.session,
            kind="token",
            name=self.name,
            number=token_id(message),
            fencing_token=fencing_token,
            channel=self.channel,
            consumer_tag=consumer_tag,
            delivery_tag=delivery_tag(message),
            quorum=quorum,
            message=message,
            carry=carry,
            on_cancel=self.on_cancel,
        )
        self.state = state
        # The state watches the channel from now on; the pooled channel must not collect
        # one stale callback per acquire.
        self.channel.closing.remove_done_callback(self.on_closed)
        state.attach()
        if self.channel.is_closed:
            state.lose("channel closed while the token was being granted")
        return state

    def abandon(self) -> None:
        """Failed or cancelled before the grant: close the channel, which returns a token
        that may be arriving right now."""
        if self.state is None:
            if not self.delivered.done():
                self.delivered.cancel()
            elif not self.delivered.cancelled():
                self.delivered.exception()  # seen: the channel closed before we gave up
            self.session.spawn(close_quietly(self.channel))


class TokenSemaphore(LockObject, HolderQueries):
    """A counting (or binary) semaphore of `permits` token messages in `name.semaphore`.

    ``priority`` is this client's consumer priority: the broker gives a freed token to the
    waiting consumer with the highest priority. ``fencing=False`` skips the fence round
    trip on classic token queues (``fencing_token`` is then 0); quorum token queues carry
    their fencing counter for free. ``first_use=True`` makes a semaphore nobody sets up:
    the acquire that finds its queue missing makes it with ``permits`` tokens (default 1),
    without the administration mutex, and the broker deletes it a minute after its last
    user left (tokens/fresh.py; cluster mode's :class:`~amqp_locks.Mutex` is one, a Celery
    key with ``lock_limit > 1`` another). Given ``permits``, the object's first acquire
    also checks that the queue, if it exists, was made with that count (LockError naming
    both otherwise).
    The admin methods (`setup`, `add_permits`, `remove_permits`, `status`, `audit`,
    `repair`, `destroy`) are those of
    :attr:`admin`, a :class:`TokenAdmin` with this object's ``quorum`` and
    ``mutex_timeout``. ``timeout`` / ``blocking`` are what ``with sem as permit:`` waits
    (default: for ever); it raises :class:`~amqp_locks.errors.LockTimeout` when no permit
    was obtained.
    """

    kind = "token"

    @staticmethod
    async def own_status(core: BrokerCore, name: str) -> Reading:
        reading = await read_token(core, name)
        if reading is None:
            raise TokenSemaphoreNotFound(f"token semaphore {name!r} is not set up")
        return reading

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        priority: int = 0,
        quorum: bool | None = None,
        fencing: bool = True,
        mutex_timeout: float | None = MUTEX_TIMEOUT,
        first_use: bool = False,
        permits: int | None = None,
    ) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigurationError(f"priority must be an int, got {type(priority).__name__}")
        if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise ConfigurationError(f"priority must be within ±{MAX_PRIORITY}, got {priority}")
        self.broker = broker
        self.name = validate_name(name)
        self.priority = priority
        self.quorum = choose_quorum(broker, quorum, f"token semaphore {name!r}")
        self.fencing = fencing
        self.mutex_timeout = check_timeout(mutex_timeout)
        if permits is not None:
            if not first_use:
                raise ConfigurationError(
                    "permits is the count of a first_use semaphore; any other is set up "
                    "by setup(permits)"
                )
            if isinstance(permits, bool) or not isinstance(permits, int):
                raise ConfigurationError(f"permits must be an int, got {type(permits).__name__}")
            if not 1 <= permits <= MAX_PERMITS:
                raise ConfigurationError(
                    f"a first-use semaphore has 1 to {MAX_PERMITS} permits, got {permits}"
                )
        #: A missing queue is made by the acquire that finds it (tokens/fresh.py).
        self.first_use = first_use
        #: How many tokens a first use makes.
        self.permits = permits or 1
        #: Whether the queue's count still needs checking (``permits`` was given).
        self._check_count = permits is not None
        #: The kind its first use mints, and what every grant checks (shape.py).
        self._kind = token_kind(self.name, self.permits)
        self._expect = Expected(TOKEN_KINDS, permits, f"token semaphore {self.name!r}")
        self._init_wait(blocking, timeout)
        #: The administration of this semaphore (what `setup` & co. delegate to).
        self.admin = TokenAdmin(
            broker,
            self.name,
            quorum=self.quorum,
            mutex_timeout=mutex_timeout,
            # A mutex's one permit is known; a count given here is read from the stamp.
            first_use=True if first_use and permits is None else None,
        )

    @property
    def _core(self) -> BrokerCore:
        return self.broker.core

    def as_mutex(self, what: str) -> None:
        """This one-permit semaphore carries cluster mode's mutex: it mints, and accepts
        only, a mutex's tokens (shape.py). Internal API, for `Mutex`."""
        self._kind = MUTEX
        self._expect = Expected(frozenset({MUTEX}), 1, what)

    # --- holders --------------------------------------------------------------------------

    async def _wait(self, blocking: bool, timeout: float | None) -> PermitState | None:
        return await self.wait_permit(blocking, timeout)

    async def wait_permit(self, blocking: bool, timeout: float | None) -> PermitState | None:
        """Wait for a token; when the connection dies meanwhile (its node died), wait on a
        new one (the next node of a cluster) for the time that is left. A first-use
        semaphore whose queue is missing makes it first (tokens/fresh.py).

        Internal API for the locks a token semaphore carries (cluster mode's `Mutex` and
        persistent semaphore): the acquire on the I/O loop, not observed (the carrying
        lock's own acquire is)."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        retried = False
        creations = 0
        create = self.first_use and self._check_count  # make, or check the count of, it
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if create:  # cleared once made: a loss meanwhile makes (or checks) again
                    await self._create()
                    create = False
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return await acquire_permit(
                    self._core,
                    self.name,
                    priority=self.priority,
                    blocking=blocking,
                    timeout=left,
                    fencing=self.fencing,
                    heal=self.first_use,
                    expect=self._expect,
                    check_running=self.first_use and self.quorum,
                )
            except TokenSemaphoreNotFound as exc:
                # Missing (404), or gone again after we found it made: expired or deleted
                # in between. Each round makes progress; a name that keeps vanishing is
                # being deleted by someone, which is worth an error.
                if not self.first_use or creations >= FIRST_USE_ROUNDS:
                    raise
                creations += 1
                create = True
                if isinstance(exc, DeletedWhileWaiting):
                    # A failure here (a lost connection) is met again by the creation.
                    with contextlib.suppress(AmqpLocksError):
                        session = await self._core.session()
                        await fresh.until_deleted(session, token_queue(self.name))
            except ConnectionLost:
                if (not blocking and retried) or (left is not None and left <= 0):
                    raise
                retried = True
            except ClusterUnreachable as exc:
                if not blocking:
                    raise
                await pause_for_a_node(exc, deadline)

    async def _create(self) -> None:
        """First use: make the queue (tokens/fresh.py). The 404 cost us our holder
        channel, so the next one is opened meanwhile (if that fails, the acquire opens its
        own and meets the error there)."""
        session = await self._core.session()
        made, _ = await asyncio.gather(
            fresh.create(
                session, self.name, self.permits, self.quorum, self._kind, self._expect.what
            ),
            _spare_holder(session, self.fencing),
            return_exceptions=True,
        )
        if isinstance(made, BaseException):
            raise made
        if made == "other" and self._check_count:
            # An administrator's semaphore (TokenAdmin.setup): its ledger has the count.
            ledger = await read_ledger(session, self.name)
            if ledger is not None and ledger.permits != self.permits:
                raise permits_refusal(
                    token_queue(self.name),
                    ledger.permits,
                    self.permits,
                    self._expect.what,
                    "set up",
                )
        self._check_count = False

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Lease | None:
        """Take a permit: a :class:`Lease` (``number`` is the permit id), or None."""
        return super().acquire(blocking, timeout)

    # --- administration: the contract is TokenAdmin's ----------------------------------

    def setup(self, permits: int) -> int:
        """Publish exactly `permits` tokens; idempotent (:meth:`TokenAdmin.setup`)."""
        return self.admin.setup(permits)

    def add_permits(self, count: int) -> list[int]:
        """Publish `count` new tokens; returns their ids (:meth:`TokenAdmin.add_permits`)."""
        return self.admin.add_permits(count)

    def remove_permits(self, count: int, timeout: float | None = None) -> list[int]:
        """Take `count` tokens out of circulation (:meth:`TokenAdmin.remove_permits`)."""
        return self.admin.remove_permits(count, timeout)

    def status(self) -> TokenStatus:
        """Permits, ready, held, consumers, waiting (:meth:`TokenAdmin.status`)."""
        return self.admin.status()

    def audit(self, timeout: float = 5.0) -> Audit:
        """Find missing and surplus tokens (:meth:`TokenAdmin.audit`)."""
        return self.admin.audit(timeout)

    def repair(self, timeout: float = 5.0) -> Audit:
        """Drop surplus tokens, re-publish missing ones (:meth:`TokenAdmin.repair`)."""
        return self.admin.repair(timeout)

    def destroy(self, *, purge_fence: bool = False) -> None:
        """Delete the token queue and its ledger, with ``purge_fence`` its fence too
        (:meth:`TokenAdmin.destroy`)."""
        self.admin.destroy(purge_fence=purge_fence)

    def __repr__(self) -> str:
        return f"TokenSemaphore({self.name!r}, priority={self.priority})"
