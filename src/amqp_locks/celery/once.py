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
  its connection's *alive* queue (keyed by the task id, one binding per call). When the
  queue goes, its bindings go, and an auto-delete exchange whose last binding goes is
  deleted by the broker: the key is free. On one node the alive queue is exclusive: a
  killed process's connection takes it with it, so the key is free at once. In cluster
  mode it is a quorum queue consumed by its connection and expiring
  (:data:`ALIVE_EXPIRES_MS`) once that consumer is gone: an exclusive queue of a node
  that dies stays on a Khepri cluster until the node returns (RabbitMQ 4.2+), keeping
  the key busy all that time, while a consumer on a lost node stops counting as use at
  once. The key is then free when the broker next checks the queue's expiry (every 5 s,
  RabbitMQ's quorum tick): about 5 s after the worker's node or process dies on 4.3.6,
  about 10 s on 3.10.8 (docs/celery.md). The consumer runs on a channel of its own, so
  no other call's error can cancel it.
- the message comes back (``acks_late`` with ``reject_on_worker_lost``, or ``acks_late``
  on a pool whose worker process runs the task): the call binds the *keeper*, an
  exchange-to-exchange binding to ``amq.direct`` keyed by the task id, which no
  connection's death removes. The key stays busy until the delivered-again copy (same
  task id, same binding) ends.

**End**: the call removes its own binding; the last one removed deletes the exchange.
Removing only one's own binding never frees a key someone claimed meanwhile.

**Order** (RabbitMQ 4.3 on Khepri): a bind overlapping its claim's deletion is accepted
and leaves the name unusable (:meth:`Mark._bind`), so a worker removes a call's binding
before it releases the key's run mutex, and each bind is checked by a passive declare.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import names
from ..errors import AccessRefused, BrokerError, BrokerTimeout, PreconditionFailed, QueueNotFound
from ..names import validate_name
from ..transport import Broker
from ..transport.exchanges import (
    bind_exchange,
    bind_queue,
    consume_on_own_channel,
    declare_exchange,
    declare_exclusive,
    delete_exchange,
    exchange_exists,
    unbind_exchange,
    unbind_queue,
)
from ..transport.session import Session
from ..transport.shield import close_quietly
from ..transport.wire import AbstractChannel
from .amqp_compat import ClaimChannel, open_claim_channel, producer_connection, send_declare

#: The exchange a keeper binding goes to: built in, durable, never deleted.
KEEPER = "amq.direct"

#: Set in a prefork pool child (``worker_process_init``): there a killed child's message
#: comes back only with ``reject_on_worker_lost`` (its parent acknowledges it otherwise).
IN_POOL_CHILD = False

#: Set in a solo-pool worker (``worker_init``): its calls' messages come back after a
#: death even when acknowledged early (the acknowledgement is not sent until the call ends).
SOLO_WORKER = False

log = logging.getLogger("amqp_locks.celery")

#: Each connection's alive queue (declared once per connection; see _alive_queue).
_alive: weakref.WeakKeyDictionary[Session, asyncio.Future[str]] = weakref.WeakKeyDictionary()

#: Cluster mode: how long (ms) an alive queue outlives the last use of it (its consumer's
#: end, or its creation before the consumer is there). The broker checks it on its quorum
#: tick (5 s), so a shorter value frees a key little sooner; a longer one only later.
ALIVE_EXPIRES_MS = 1000

#: Cluster mode: alive queues made and lost before their consumer was there, at most,
#: before a call's start fails (each retry is a new name; one loss needs a stall > 1 s).
ALIVE_TRIES = 3


def claim_exchange(name: str) -> str:
    """The claim exchange of the lock `name` (exists while the key is busy): ``N.once``,
    escaped where AMQP clients would refuse it (names.py)."""
    return names.claim_exchange(validate_name(name))


def keeper_key(task_id: str) -> str:
    return f"amqp-locks.once-keep.{task_id}"


async def _session(broker: Broker) -> Session:
    return await broker.core.session()


async def _declare_claim(
    broker: Broker, exchange: str, durable: bool, sent: Callable[[], None] | None = None
) -> bool:
    """Create the claim exchange: True, or False when it exists (the key is busy).
    ``durable``: it survives a broker restart (a disk write per claim, about 0.7 ms more
    here); transient claims are lost with a restart, freeing the keys of queued calls."""
    unique: dict[str, Any] = {"alternate-exchange": f"amqp-locks.claim.{uuid.uuid4().hex}"}
    try:
        await declare_exchange(
            await _session(broker),
            exchange,
            "fanout",
            durable=durable,
            auto_delete=True,
            arguments=unique,
            on_sent=sent,
        )
    except PreconditionFailed:
        return False
    return True


def claim(broker: Broker, name: str, durable: bool = True) -> bool:
    """Free -> queued: True if this call created the key's claim (one round trip)."""
    return broker.core.run(_declare_claim(broker, claim_exchange(name), durable))


def claim_soon(broker: Broker, name: str, durable: bool = True) -> Callable[[], bool]:
    """Start :func:`claim` on the lock connection; the returned callable waits for its
    answer (raising what it raised), as often as asked."""
    core = broker.core
    sent = threading.Event()
    future = core.submit(_declare_claim(broker, claim_exchange(name), durable, sent.set))
    future.add_done_callback(lambda _: sent.set())
    # Until the declare is on the socket: the I/O thread needs the GIL to write it, which
    # the caller's building of the message would otherwise hold for a switch interval.
    sent.wait()
    return lambda: core.wait(future)


#: Seconds a claim sent on the producer's connection waits for its answer.
CLAIM_TIMEOUT = 10.0

#: Each producer connection's claim channel (py-amqp reopens it after a refusal closes it).
_claim_channels: weakref.WeakKeyDictionary[Any, ClaimChannel] = weakref.WeakKeyDictionary()


def claim_on(producer: Any, name: str, durable: bool = True) -> Callable[[], bool] | None:
    """Send :func:`claim`'s declare on the kombu `producer`'s own connection (when it is
    py-amqp: the locks' broker must be Celery's); the returned callable reads its answer
    (cached: ask as often as needed). None: not possible here, claim on the lock
    connection instead. Only the thread using the producer may call either."""
    raw = producer_connection(producer)
    if raw is None:
        return None
    channel = _claim_channels.get(raw)
    if channel is None or not channel.is_open:
        channel = _claim_channels[raw] = open_claim_channel(raw)
    unique: dict[str, Any] = {"alternate-exchange": f"amqp-locks.claim.{uuid.uuid4().hex}"}
    exchange = claim_exchange(name)
    # Whoever reads the connection first (Celery declaring its queue, or the answer's
    # reader below) hands the answer to `ok` (amqp_compat.py).
    ok = send_declare(
        channel, exchange, "fanout", durable=durable, auto_delete=True, arguments=unique
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
        assert channel.closed_with is not None  # what ended the loop
        code, text = channel.closed_with
        if _claim_channels.get(raw) is channel:
            # The next claim's channel, opened now: an accepted claim stays one round trip.
            # If it cannot be, the next claim opens one (the answer here stands).
            _claim_channels.pop(raw, None)
            with contextlib.suppress(Exception):
                _claim_channels[raw] = open_claim_channel(raw)
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
        return await exchange_exists(await _session(broker), exchange)

    return broker.core.run(broker.core.read(go))


def forget(broker: Broker, name: str, task_id: str | None = None, force: bool = False) -> bool:
    """Free a busy key (a queued call that will not run): remove `task_id`'s keeper, then
    delete the claim unless a call is bound to it (``force``: whatever is bound). True if
    the key was freed here."""
    exchange = claim_exchange(name)

    async def go() -> bool:
        if task_id is not None:
            key = keeper_key(task_id)
            try:
                await unbind_exchange(await _session(broker), KEEPER, exchange, key)
            except QueueNotFound:
                return False  # already free
        if not force and not await exchange_exists(await _session(broker), exchange):
            return False
        try:
            await delete_exchange(await _session(broker), exchange, if_unused=not force)
        except PreconditionFailed:  # bound: a call runs (or a retry is handed the key)
            return False
        return True

    return broker.core.run(go())


async def _alive_queue(broker: Broker) -> str:
    """This connection's alive queue, made on its first use per connection (concurrent
    first uses share one declaration: a quorum queue costs 8-40 ms to make)."""
    session = await _session(broker)
    made = _alive.get(session)
    if made is None or (made.done() and (made.cancelled() or made.exception() is not None)):
        made = _alive[session] = asyncio.ensure_future(_make_alive(session))
    return await asyncio.shield(made)


def _forget_alive(session: Session, queue: str) -> None:
    """Make the session's next call declare a new alive queue (this one is gone)."""
    made = _alive.get(session)
    if (
        made is not None
        and made.done()
        and not made.cancelled()
        and made.exception() is None
        and made.result() == queue
    ):
        del _alive[session]


async def _make_alive(session: Session) -> str:
    queue = f"amqp-locks.once-alive.{uuid.uuid4().hex}"
    if not session.cluster:
        # Nothing is published to a claim exchange; x-max-length 0 drops it if it were.
        await declare_exclusive(session, queue, {"x-max-length": 0})
        return queue
    for attempt in range(1, ALIVE_TRIES + 1):
        try:
            return await _consumed_queue(session, queue)
        except QueueNotFound:
            # Expired between its declare and the consume (the caller stalled over
            # ALIVE_EXPIRES_MS): a new name, never a queue someone else may have made.
            if attempt == ALIVE_TRIES:
                raise
            queue = f"amqp-locks.once-alive.{uuid.uuid4().hex}"
    raise AssertionError("unreachable")


async def _consumed_queue(session: Session, queue: str) -> str:
    """Cluster mode: declare `queue` (quorum, expiring once unused) and consume it on a
    channel of its own for the connection's life. If that channel closes while the
    connection lives, the queue expires and frees the keys of the calls bound to it: a
    WARNING says so, and the next call declares another."""
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-expires": ALIVE_EXPIRES_MS,
        "x-max-length": 0,  # nothing is ever delivered: nobody publishes to it
    }
    ch = await consume_on_own_channel(session, queue, arguments)

    owner = weakref.ref(session)  # the channel must not keep its session alive

    def closed(_: object) -> None:
        session = owner()
        if session is None or _consumers.get(session) is not ch:
            return  # the session ended, or this queue was replaced (deleted under us)
        _forget_alive(session, queue)
        if session.alive:
            log.warning(
                "the once alive queue %s lost its consumer (channel closed): the once keys "
                "of calls running through it are freed within seconds",
                queue,
            )

    ch.closing.add_done_callback(closed)
    replaced = _consumers.get(session)
    _consumers[session] = ch  # kept open (and referenced) while the session lives
    if replaced is not None:  # its queue was deleted (the bind found no queue)
        session.spawn(close_quietly(replaced))
    return queue


#: Each cluster-mode session's alive-queue consumer channel.
_consumers: weakref.WeakKeyDictionary[Session, AbstractChannel] = weakref.WeakKeyDictionary()


class ClaimLost(BrokerError):
    """A call's claim was deleted as the call bound to it (RabbitMQ 4.3 on Khepri)."""


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
        """Bind, then see the claim still exists. RabbitMQ 4.3 on Khepri checks a bind's
        source before, not inside, the write that adds it: a bind overlapping the
        deletion of the claim (another call's end removing the last binding, a bound
        queue's death, a forced forget) is accepted with no claim left, and the binding
        stays under the name, after which every declare of that claim closes its
        connection (541 INTERNAL_ERROR) until an operator deletes the name (measured on
        4.3.6: 469 of 500 overlapped binds; 0 on 4.0.5 and 3.10.8, Mnesia). The worker
        ends a call's binding before it releases the run mutex, so calls of one key never
        overlap so; the check names the key if it happened anyway."""
        await self._bind_once()
        if not await exchange_exists(await _session(self.broker), self.exchange):
            log.error(
                "%s: the key's claim was deleted as this call bound to it (RabbitMQ on "
                "Khepri); the name is unusable until an operator runs: rabbitmqctl eval "
                '\'rabbit_khepri:delete([rabbitmq,vhosts,<<"VHOST">>,exchanges,<<"%s">>]).\'',
                self.exchange,
                self.exchange,
            )
            raise ClaimLost(
                f"{self.exchange}: the claim was deleted as this call bound to it; see the log "
                "for the operator's repair (docs/celery.md)"
            )

    async def _bind_once(self) -> None:
        exchange, key = self.exchange, keeper_key(self.task_id)
        if self.comes_back:
            await bind_exchange(await _session(self.broker), KEEPER, exchange, key)
        else:
            for last in (False, True):
                queue = self.alive = await _alive_queue(self.broker)
                try:
                    # Keyed by the task id too: two calls on one connection hold two
                    # bindings.
                    await bind_queue(await _session(self.broker), queue, exchange, key)
                    return
                except QueueNotFound as exc:
                    # The claim is missing (the caller claims it), or our alive queue
                    # expired (its consumer's channel closed): then once with a new one.
                    if last or f"no queue '{queue}'" not in str(exc):
                        raise
                    _forget_alive(await _session(self.broker), queue)

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
            await unbind_exchange(await _session(self.broker), KEEPER, exchange, key)

    def start(self, retried: bool) -> None:
        """Queued -> running."""
        self.broker.core.run(self._start(retried))

    def end(self, hand_over: bool) -> None:
        """Running -> free: remove our binding (the last one deletes the exchange); with
        ``hand_over`` (a retry was sent) running -> queued: the keeper holds it for the
        retry (same task id) before our alive queue lets go."""
        self.broker.core.run(self._end(hand_over))

    async def _end(self, hand_over: bool) -> None:
        exchange, key = self.exchange, keeper_key(self.task_id)
        # QueueNotFound: the claim was deleted meanwhile (forget_once(force=True)).
        with contextlib.suppress(QueueNotFound):
            if hand_over and not self.comes_back:
                await bind_exchange(await _session(self.broker), KEEPER, exchange, key)
            if self.alive is not None:
                await unbind_queue(await _session(self.broker), self.alive, exchange, key)
            elif not hand_over:
                await unbind_exchange(await _session(self.broker), KEEPER, exchange, key)


__all__ = [
    "IN_POOL_CHILD",
    "KEEPER",
    "SOLO_WORKER",
    "ClaimLost",
    "Mark",
    "busy",
    "claim",
    "claim_exchange",
    "claim_on",
    "claim_soon",
    "forget",
]
