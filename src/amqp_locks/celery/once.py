"""Enqueue-time deduplication (``once=True``): at most one call of a key queued or
running, its state kept by the broker in one exchange per busy key.

A key is busy while its *claim*, the durable auto-delete exchange ``<lock>.once``, exists:

========  =====================================================================
free      no claim exchange
queued    the exchange exists; nothing is bound to it (or the keeper, below)
running   the running call's binding holds it (below)
========  =====================================================================

**Claim** (the producer): one ``exchange.declare`` with an ``alternate-exchange``
argument unique to this claim. RabbitMQ compares that argument with an existing
exchange's and refuses a different one (406, the channel closes): so the declare either
creates the exchange (claimed) or fails (the key is busy): one round trip, atomic, and a
new key needs no set-up. No administration mutex, no ledger. When the locks use Celery's
own broker, the declare goes on the producer's connection (a channel of its own, written
before Celery builds the message, its answer read before the message is published): no
thread hop, and the broker's work overlaps Celery's (:func:`claim_on`); otherwise on the
lock connection (:func:`claim_soon`).

**Run** (the worker): besides the key's run mutex (what keeps two copies from running at
once), the call binds something to the exchange, chosen by what happens to its message if
the process dies mid-run:

- the message is gone (acknowledged before the run, Celery's default): the call binds
  its connection's exclusive *alive* queue (keyed by the task id, one binding per call).
  A killed process's connection takes that
  queue with it, the binding goes, and an auto-delete exchange whose last binding goes
  is deleted by the broker: the key is free at once.
- the message comes back (``acks_late`` with ``reject_on_worker_lost``, or ``acks_late``
  on a pool whose worker process runs the task): the call binds the *keeper*, an
  exchange-to-exchange binding to ``amq.direct`` keyed by the task id, which no
  connection's death removes. The key stays busy until the delivered-again copy (same
  task id, same binding) ends.

**End**: the call removes its own binding; the last one removed deletes the exchange.
Removing only one's own binding never frees a key someone claimed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import amqp
from aiormq.abc import AbstractChannel
from amqp import spec
from vine import promise

from ..errors import AccessRefused, BrokerError, BrokerTimeout, PreconditionFailed, QueueNotFound
from ..transport import Broker
from ..transport.session import Session

#: Loop steps a claim waits for aiormq to write its declare before the caller goes on.
SEND_STEPS = 3

#: The exchange a keeper binding goes to: built in, durable, never deleted.
KEEPER = "amq.direct"

#: Set in a prefork pool child (``worker_process_init``): there a killed child's message
#: comes back only with ``reject_on_worker_lost`` (its parent acknowledges it otherwise).
IN_POOL_CHILD = False

#: Set in a solo-pool worker (``worker_init``): its calls' messages come back after a
#: death even when acknowledged early (the acknowledgement is not sent until the call ends).
SOLO_WORKER = False

#: Each connection's exclusive alive queue (declared once per connection).
_alive: weakref.WeakKeyDictionary[Session, str] = weakref.WeakKeyDictionary()


def claim_exchange(name: str) -> str:
    """The claim exchange of the lock `name` (exists while the key is busy)."""
    return f"{name}.once"


def keeper_key(task_id: str) -> str:
    return f"amqp-locks.once-keep.{task_id}"


async def _call(broker: Broker, what: str, op: Callable[[AbstractChannel], Awaitable[Any]]) -> Any:
    session = await broker._core.session()
    return await session.call(what, op)


async def _declare_claim(
    broker: Broker, exchange: str, durable: bool, sent: Callable[[], None] | None = None
) -> bool:
    """Create the claim exchange: True, or False when it exists (the key is busy).
    ``durable``: it survives a broker restart (a disk write per claim, about 0.7 ms more
    here); transient claims are lost with a restart, freeing the keys of queued calls."""
    unique: dict[str, Any] = {"alternate-exchange": f"amqp-locks.claim.{uuid.uuid4().hex}"}

    async def declare(ch: AbstractChannel) -> Any:
        reply = asyncio.ensure_future(
            ch.exchange_declare(
                exchange,
                exchange_type="fanout",
                durable=durable,
                auto_delete=True,
                arguments=unique,
            )
        )
        if sent is not None:
            # A few loop steps take the method through aiormq's writer onto the socket.
            for _ in range(SEND_STEPS):
                if reply.done():
                    break
                await asyncio.sleep(0)
            sent()
        return await reply

    try:
        await _call(broker, exchange, declare)
    except PreconditionFailed:
        return False
    return True


def claim(broker: Broker, name: str, durable: bool = True) -> bool:
    """Free -> queued: True if this call created the key's claim (one round trip)."""
    return broker._core.run(_declare_claim(broker, claim_exchange(name), durable))


def claim_soon(broker: Broker, name: str, durable: bool = True) -> Callable[[], bool]:
    """Start :func:`claim` on the lock connection; the returned callable waits for its
    answer (raising what it raised), as often as asked."""
    core = broker._core
    sent = threading.Event()
    future = core.submit(_declare_claim(broker, claim_exchange(name), durable, sent.set))
    future.add_done_callback(lambda _: sent.set())
    # Until the declare is on the socket: the I/O thread needs the GIL to write it, which
    # the caller's building of the message would otherwise hold for a switch interval.
    sent.wait()
    return lambda: core._wait(future)


#: Seconds a claim sent on the producer's connection waits for its answer.
CLAIM_TIMEOUT = 10.0

#: Each producer connection's claim channel (py-amqp reopens it after a refusal closes it).
_claim_channels: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _py_amqp(producer: Any) -> Any:
    """The producer's py-amqp connection, connected, or None (another transport)."""
    connection = getattr(producer, "connection", None)
    if connection is None or getattr(connection, "transport_cls", None) not in (
        "amqp",
        "pyamqp",
        "amqps",
    ):
        return None
    raw = connection.connection  # connects if it is not yet
    return raw if isinstance(raw, amqp.Connection) and raw.connected else None


class _ClaimChannel(amqp.Channel):
    """A channel of a producer's py-amqp connection for claims. Its close (a refused
    claim) is recorded, not raised: Celery may read the connection (a queue declare of its
    own) before the claim's answer is asked for, and py-amqp raises a channel's close in
    whichever call reads it."""

    closed_with: tuple[int, str] | None = None

    def _on_close(self, reply_code: int, reply_text: str, *_: Any) -> None:
        self.closed_with = (reply_code, reply_text)
        self.send_method(spec.Channel.CloseOk)
        self.collect()


def _claim_channel(raw: Any) -> Any:
    channel = _ClaimChannel(raw)
    channel.open()
    return channel


def claim_on(producer: Any, name: str, durable: bool = True) -> Callable[[], bool] | None:
    """Send :func:`claim`'s declare on the kombu `producer`'s own connection (when it is
    py-amqp: the locks' broker must be Celery's); the returned callable reads its answer
    (cached: ask as often as needed). None: not possible here, claim on the lock
    connection instead. Only the thread using the producer may call either."""
    raw = _py_amqp(producer)
    if raw is None:
        return None
    channel = _claim_channels.get(raw)
    if channel is None or not channel.is_open:
        channel = _claim_channels[raw] = _claim_channel(raw)
    unique: dict[str, Any] = {"alternate-exchange": f"amqp-locks.claim.{uuid.uuid4().hex}"}
    exchange = claim_exchange(name)
    # Registered before the declare is sent: whoever reads the connection first (Celery
    # declaring its queue, or the answer's reader below) hands the answer to it.
    ok = promise()
    channel._pending[spec.Exchange.DeclareOk] = ok
    channel.send_method(
        spec.Exchange.Declare,
        "BssbbbbbF",
        (0, exchange, "fanout", False, durable, True, False, False, unique),
    )
    answer: list[bool | BaseException] = []

    def read() -> bool:
        deadline = time.monotonic() + CLAIM_TIMEOUT
        while not ok.ready and channel.closed_with is None:
            left = deadline - time.monotonic()
            if left <= 0:
                _claim_channels.pop(raw, None)  # its answer may still come: not reused
                raise BrokerTimeout(f"no answer to the claim of {exchange} in {CLAIM_TIMEOUT:g} s")
            raw.drain_events(timeout=left)
        if ok.ready:
            return True
        code, text = channel.closed_with
        if _claim_channels.get(raw) is channel:
            # The next claim's channel, opened now: an accepted claim stays one round trip.
            # If it cannot be, the next claim opens one (the answer here stands).
            _claim_channels.pop(raw, None)
            with contextlib.suppress(Exception):
                _claim_channels[raw] = _claim_channel(raw)
        if code == 406:  # PRECONDITION_FAILED: another claim's argument: the key is busy
            return False
        if code == 403:
            raise AccessRefused(f"claiming {exchange} was refused: {text}")
        raise BrokerError(f"claiming {exchange} failed: {code} {text}")

    def claimed() -> bool:
        if not answer:
            try:
                answer.append(read())
            except BaseException as exc:
                answer.append(exc)
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    return claimed


def busy(broker: Broker, name: str) -> bool:
    """Whether the key is queued or running (its claim exchange exists)."""
    exchange = claim_exchange(name)

    async def go() -> bool:
        try:
            await _call(broker, exchange, lambda ch: ch.exchange_declare(exchange, passive=True))
        except QueueNotFound:
            return False
        return True

    return broker._core.run(go())


def forget(broker: Broker, name: str, task_id: str | None = None, force: bool = False) -> bool:
    """Free a busy key (a queued call that will not run): remove `task_id`'s keeper, then
    delete the claim unless a call is bound to it (``force``: whatever is bound). True if
    the key was freed here."""
    exchange = claim_exchange(name)

    async def go() -> bool:
        if task_id is not None:
            key = keeper_key(task_id)
            try:
                await _call(broker, exchange, lambda ch: ch.exchange_unbind(KEEPER, exchange, key))
            except QueueNotFound:
                return False  # already free
        if not force and not await _exists(broker, exchange):
            return False
        unused = not force
        try:
            await _call(broker, exchange, lambda ch: ch.exchange_delete(exchange, if_unused=unused))
        except PreconditionFailed:  # bound: a call runs (or a retry is handed the key)
            return False
        return True

    return broker._core.run(go())


async def _exists(broker: Broker, exchange: str) -> bool:
    try:
        await _call(broker, exchange, lambda ch: ch.exchange_declare(exchange, passive=True))
    except QueueNotFound:
        return False
    return True


async def _alive_queue(broker: Broker) -> str:
    """This connection's exclusive alive queue (declared on first use per connection)."""
    session = await broker._core.session()
    queue = _alive.get(session)
    if queue is None:
        queue = f"amqp-locks.once-alive.{uuid.uuid4().hex}"
        # Nothing is published to a claim exchange; x-max-length 0 drops it if it were.
        await session.call(
            queue,
            lambda ch: ch.queue_declare(queue, exclusive=True, arguments={"x-max-length": 0}),
        )
        _alive[session] = queue
    return queue


@dataclass
class Mark:
    """What one running call bound to its key's claim exchange."""

    broker: Broker
    name: str
    task_id: str
    #: The message comes back if the process dies: bound by the keeper, not the alive queue.
    comes_back: bool
    #: Claims are durable (see _declare_claim): a missing claim is made the same way.
    durable: bool = True
    #: The alive queue bound (None with the keeper).
    alive: str | None = None

    @property
    def exchange(self) -> str:
        return claim_exchange(self.name)

    async def _bind(self) -> None:
        exchange, key = self.exchange, keeper_key(self.task_id)
        if self.comes_back:
            await _call(self.broker, exchange, lambda ch: ch.exchange_bind(KEEPER, exchange, key))
        else:
            queue = self.alive = await _alive_queue(self.broker)
            # Keyed by the task id too: two calls on one connection hold two bindings.
            await _call(self.broker, exchange, lambda ch: ch.queue_bind(queue, exchange, key))

    async def _start(self, retried: bool) -> None:
        try:
            await self._bind()
        except QueueNotFound:
            # No claim: the message was sent around the dedup (send_task) or its key was
            # forgotten. Claim it now (or find it claimed meanwhile), then bind.
            await _declare_claim(self.broker, self.exchange, self.durable)
            await self._bind()
        if retried and not self.comes_back:
            # A retry was handed the key by the keeper (hand_over): our alive queue now
            # holds it, so a killed process frees it.
            exchange, key = self.exchange, keeper_key(self.task_id)
            await _call(self.broker, exchange, lambda ch: ch.exchange_unbind(KEEPER, exchange, key))

    def start(self, retried: bool) -> None:
        """Queued -> running."""
        self.broker._core.run(self._start(retried))

    def end(self, hand_over: bool) -> None:
        """Running -> free: remove our binding (the last one deletes the exchange); with
        ``hand_over`` (a retry was sent) running -> queued: the keeper holds it for the
        retry (same task id) before our alive queue lets go."""
        exchange, key = self.exchange, keeper_key(self.task_id)

        async def go() -> None:
            # QueueNotFound: the claim was deleted meanwhile (forget_once(force=True)).
            with contextlib.suppress(QueueNotFound):
                await ends()

        async def ends() -> None:
            if hand_over and not self.comes_back:
                await _call(
                    self.broker, exchange, lambda ch: ch.exchange_bind(KEEPER, exchange, key)
                )
            if self.alive is not None:
                queue = self.alive
                await _call(self.broker, exchange, lambda ch: ch.queue_unbind(queue, exchange, key))
            elif not hand_over:
                await _call(
                    self.broker, exchange, lambda ch: ch.exchange_unbind(KEEPER, exchange, key)
                )

        self.broker._core.run(go())


__all__ = [
    "IN_POOL_CHILD",
    "KEEPER",
    "SOLO_WORKER",
    "Mark",
    "busy",
    "claim",
    "claim_exchange",
    "claim_on",
    "claim_soon",
    "forget",
]
