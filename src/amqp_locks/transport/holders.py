"""Holder records on the wire: holders answer "who holds N?" for the locks they hold.

AMQP lets nobody read another connection's exclusive queues or connection properties, so
the records live with their holders. Each connection that holds a lock owns one
exclusive, auto-delete *holder queue*, bound to the direct exchange :data:`EXCHANGE` with
the :func:`~amqp_locks.names.holder_key` of every lock it holds (the lock's name, or its
escaped form: a routing key is at most 255 bytes). A reader publishes a query to that
exchange with that key as routing key and RabbitMQ's direct reply-to as ``reply_to``; every holder's
I/O loop answers with the records of the leases it holds on that name *at that moment*
(released or lost ones are never reported). A record therefore vanishes with its holder:
the broker deletes the queue, and its bindings, with the connection.

Nothing here is on the acquire path's critical line: the holder queue is set up in the
background on first hold, binds are sent ``nowait``, and an unbind waits until a name has
gone unheld for :data:`UNBIND_AFTER` seconds (a stale binding only earns an empty
non-answer). docs/protocol.md section 10 counts the frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import aiormq.exceptions as ex
from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp.commands import Basic

from ..errors import (
    AccessRefused,
    AmqpLocksError,
    ConfigurationError,
    PreconditionFailed,
    QueueNotFound,
)
from ..names import holder_key
from .errors import channel_error
from .ports import Link

log = logging.getLogger("amqp_locks.transport")

#: The direct exchange holders bind their holder queues to, one binding per held name.
EXCHANGE = "amqp-locks.holders"
#: RabbitMQ's direct reply-to pseudo-queue (3.4+): answers come back without a queue.
REPLY_TO = "amq.rabbitmq.reply-to"
#: Version of the answer format (a reader ignores answers of another major version).
PROTOCOL = 1
#: Seconds a name stays bound after its last lease there ended (a lock taken again and
#: again costs no bind/unbind per grant).
UNBIND_AFTER = 10.0
#: Queries a frozen holder's queue keeps (the oldest are dropped beyond).
QUEUE_ARGUMENTS: dict[str, Any] = {"x-max-length": 64, "x-overflow": "drop-head"}
#: A reader asks again after these many seconds while expected holders are silent (a
#: holder whose bind is still in flight, a query dropped by a full queue).
REASK_AFTER = (0.05, 0.15, 0.35, 0.7)
MAX_HOLDER_ID = 128


def default_holder_id() -> str:
    """``host:pid``: what a record says when the Broker was given no ``holder_id``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def check_holder_id(value: object) -> str:
    """A holder id anyone on the vhost may read: short, printable, not a URL (a URL could
    carry a password)."""
    if not isinstance(value, str):
        raise ConfigurationError(f"holder_id must be a str, got {type(value).__name__}")
    if not value or len(value) > MAX_HOLDER_ID:
        raise ConfigurationError(f"holder_id must be 1..{MAX_HOLDER_ID} characters long")
    if not value.isprintable() or value != value.strip():
        raise ConfigurationError(
            "holder_id must be printable, without control characters or leading/trailing spaces"
        )
    if "://" in value:
        raise ConfigurationError(
            "holder_id must not be a URL: every client on the vhost can read it"
        )
    return value


class HeldLeases:
    """The locks held through one session (every kind registers here when granted and
    leaves when released or abandoned); holding a name keeps it bound for queries."""

    def __init__(self, responder: HolderResponder) -> None:
        #: Each held state, with the UTC time it was granted (read once: stable answers).
        self._items: dict[Any, datetime] = {}
        self.responder = responder
        responder.leases = self

    def add(self, state: Any) -> None:
        if state not in self._items:
            self._items[state] = _wall(state.acquired_at)
            self.responder.held(holder_key(state.name))

    def discard(self, state: Any) -> None:
        if self._items.pop(state, None) is not None:
            self.responder.ended(holder_key(state.name))

    def since(self, state: Any) -> datetime:
        return self._items.get(state) or _wall(state.acquired_at)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, state: object) -> bool:
        return state in self._items


def _wall(monotonic_at: float) -> datetime:
    """The UTC wall-clock time of a `time.monotonic()` reading."""
    return datetime.fromtimestamp(time.time() - (time.monotonic() - monotonic_at), UTC)


class HolderResponder:
    """One session's holder queue: binds held names, answers queries on the I/O loop."""

    def __init__(self, session: Link) -> None:
        self.session = session
        self.queue = f"amqp-locks.holder.{uuid.uuid4().hex}"
        #: Leases held per name, and the names that should be bound (held, or lingering).
        self.counts: dict[str, int] = {}
        self.bound: set[str] = set()
        #: Why records are off for this connection (no permission, a foreign exchange).
        self.disabled: str | None = None
        self._applied: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._channel: AbstractChannel | None = None
        self._kick = asyncio.Event()
        #: The leases it answers for (set by the :class:`HeldLeases` that owns it).
        self.leases: HeldLeases | None = None
        self._worker: asyncio.Task[None] | None = None

    # --- called by HeldLeases on the I/O loop (never awaits: no cost to the grant) -------

    def held(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()
        if name not in self.bound:
            self.bound.add(name)
            self._wake()

    def ended(self, name: str) -> None:
        left = self.counts.get(name, 0) - 1
        if left > 0:
            self.counts[name] = left
            return
        self.counts.pop(name, None)
        if name in self.bound and name not in self._timers and self.session.alive:
            loop = asyncio.get_running_loop()
            self._timers[name] = loop.call_later(UNBIND_AFTER, self._expire, name)

    def _expire(self, name: str) -> None:
        self._timers.pop(name, None)
        if name not in self.counts:
            self.bound.discard(name)
            self._wake()

    def _wake(self) -> None:
        if self.disabled is not None or not self.session.alive:
            return
        self._kick.set()
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())
            self.session.add_listener(self._stop)

    def _stop(self, _reason: str) -> None:
        """The session ended: its queue and bindings are gone with the connection."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._worker is not None:
            self._worker.cancel()

    # --- the background worker: set up once, then keep bindings in step --------------

    async def _run(self) -> None:
        while self.session.alive and self.disabled is None:
            try:
                if self._channel is None or self._channel.is_closed:
                    self._applied.clear()
                    self._channel = await self._setup()
                await self._sync(self._channel)
            except asyncio.CancelledError:
                raise
            except (AccessRefused, PreconditionFailed, QueueNotFound) as exc:
                self.disabled = str(exc)
                log.warning(
                    "holder records are off for connection %r (readers will see this "
                    "process's locks as held by an unknown holder): %s",
                    self.session.connection_name,
                    exc,
                )
                return
            except Exception as exc:
                if not self.session.alive:
                    return
                log.debug("holder queue setup or binding failed, retrying: %s", exc)
                self._channel = None
                await asyncio.sleep(1.0)
                continue
            if self.bound == self._applied:
                self._kick.clear()
                await self._kick.wait()

    async def _setup(self) -> AbstractChannel:
        """Open the holder channel, declare the exchange and our queue, consume queries."""
        session = self.session
        ch = await session.raw_channel(publisher_confirms=False)
        try:
            await ch.exchange_declare(EXCHANGE, exchange_type="direct", durable=True)
        except Exception as exc:
            raise channel_error(exc) from exc
        # A fresh name each time: after a channel error the old queue went with its consumer
        # (auto-delete), and the bindings with it.
        self.queue = f"amqp-locks.holder.{uuid.uuid4().hex}"
        try:
            await ch.queue_declare(
                self.queue, exclusive=True, auto_delete=True, arguments=QUEUE_ARGUMENTS
            )
            await ch.basic_consume(self.queue, lambda m: self._answer(ch, m), no_ack=True)
        except Exception as exc:
            raise channel_error(exc, self.queue) from exc
        return ch

    async def _sync(self, ch: AbstractChannel) -> None:
        """Bind what should be bound (nowait), unbind what should not (in order)."""
        while self.bound != self._applied:
            for name in sorted(self.bound - self._applied):
                await ch.queue_bind(self.queue, EXCHANGE, routing_key=name, nowait=True)
                self._applied.add(name)
            for name in sorted(self._applied - self.bound):
                await ch.queue_unbind(self.queue, EXCHANGE, routing_key=name)
                self._applied.discard(name)

    # --- answering -------------------------------------------------------------------

    def records(self, key: str) -> list[dict[str, Any]]:
        """The leases held through this session on the lock whose :func:`holder_key` is
        `key` right now (never a released or lost one)."""
        out: list[dict[str, Any]] = []
        leases = self.leases
        if leases is None:
            return out
        for state in leases:
            if holder_key(state.name) != key or state.released or state.lost_reason is not None:
                continue
            out.append(
                {
                    "kind": state.kind,
                    "number": state.number,
                    "pid": state.pid,
                    "since": leases.since(state).isoformat(),
                    "token": state.fencing_token,
                }
            )
        return out

    async def _answer(self, ch: AbstractChannel, message: DeliveredMessage) -> None:
        props = message.header.properties if message.header else None
        reply_to = props.reply_to if props is not None else None
        name = getattr(message.delivery, "routing_key", None)
        if not reply_to or not isinstance(name, str) or not self.session.alive:
            return
        records = self.records(name)
        if not records:
            return  # a lingering binding: nothing to say
        body = json.dumps(
            {
                "v": PROTOCOL,
                "responder": self.queue,
                "holder_id": self.session.holder_id,
                "host": socket.gethostname(),
                "records": records,
            }
        ).encode()
        with contextlib.suppress(Exception):
            await ch.basic_publish(
                body,
                routing_key=reply_to,
                properties=Basic.Properties(
                    correlation_id=props.correlation_id if props is not None else None,
                    content_type="application/json",
                    expiration="10000",
                ),
            )


# --- the reader's side ------------------------------------------------------------------

Answer = dict[str, Any]


class QueryResult:
    """What one query gathered: the latest answer of each responder, and why there may be
    none (``note``: no holder bound, no exchange, no permission)."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self.note: str | None = None
        self.routed = False


class HolderReader:
    """One channel per session consuming the direct reply-to; queries share it."""

    def __init__(self, session: Link) -> None:
        self.session = session
        self._channel: AbstractChannel | None = None
        self._opening: asyncio.Lock = asyncio.Lock()
        self._pending: dict[str, tuple[QueryResult, asyncio.Event]] = {}

    async def _ready(self) -> AbstractChannel:
        async with self._opening:
            ch = self._channel
            if ch is not None and not ch.is_closed:
                return ch
            ch = await self.session.open_channel()
            try:
                await ch.basic_consume(REPLY_TO, self._on_reply, no_ack=True)
            except Exception as exc:
                raise channel_error(exc, REPLY_TO) from exc
            self._channel = ch
            return ch

    async def _on_reply(self, message: DeliveredMessage) -> None:
        props = message.header.properties if message.header else None
        pending = self._pending.get(str(props.correlation_id)) if props is not None else None
        if pending is None:
            return
        try:
            answer = json.loads(message.body)
        except ValueError:
            return
        if not isinstance(answer, dict) or answer.get("v") != PROTOCOL:
            return
        result, event = pending
        result.answers[str(answer.get("responder"))] = answer
        event.set()

    async def ask(
        self, name: str, timeout: float, satisfied: Callable[[QueryResult], bool]
    ) -> QueryResult:
        """Ask the holders of `name`; gather answers until `satisfied` or `timeout`."""
        result = QueryResult()
        deadline = time.monotonic() + timeout
        correlation = uuid.uuid4().hex
        event = asyncio.Event()
        self._pending[correlation] = (result, event)
        reasks = [time.monotonic() + t for t in REASK_AFTER]
        try:
            if not await self._publish(name, correlation, timeout, result):
                return result
            while not satisfied(result):
                now = time.monotonic()
                if now >= deadline or (not result.routed and not reasks):
                    return result  # silent, or nobody bound even after asking again
                wake = min(deadline, reasks[0]) if reasks else deadline
                event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), max(0.0, wake - now))
                if reasks and time.monotonic() >= reasks[0] and not satisfied(result):
                    reasks.pop(0)
                    if not await self._publish(name, correlation, timeout, result):
                        return result
            return result
        finally:
            self._pending.pop(correlation, None)

    async def _publish(
        self, name: str, correlation: str, timeout: float, result: QueryResult
    ) -> bool:
        """Publish one query (mandatory, confirmed): False when asking is pointless now
        (note set): the exchange is missing or refused to us."""
        try:
            ch = await self._ready()
            await ch.basic_publish(
                name.encode(),
                exchange=EXCHANGE,
                routing_key=holder_key(name),
                mandatory=True,
                properties=Basic.Properties(
                    reply_to=REPLY_TO,
                    correlation_id=correlation,
                    expiration=str(max(1, int(timeout * 1000))),
                ),
            )
            result.routed = True
        except ex.PublishError:
            # NO_ROUTE: no connection holds `name` bound right now (maybe not yet).
            if not result.routed:
                result.note = "no holder answered: none is registered for this name"
        except (ex.AMQPError, AmqpLocksError, ConnectionError, RuntimeError) as exc:
            err = channel_error(exc, None)
            if isinstance(err, QueueNotFound):
                result.note = (
                    f"no holder records: exchange {EXCHANGE!r} does not exist (no holder "
                    "of this vhost has declared it)"
                )
            elif isinstance(err, AccessRefused):
                result.note = f"cannot ask the holders: {err}"
            else:
                raise err from exc
            return False
        return True
