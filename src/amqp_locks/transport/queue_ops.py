"""The queue operations every lock is built from, on the session's pooled channels:
declare, delete, passive declares, pipelined existence probes, confirmed publishes and
fire-and-forget wake-up notices."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence
from typing import Any

import aiormq.exceptions as ex
from aiormq.abc import AbstractChannel
from pamqp.body import ContentBody
from pamqp.commands import Basic, Queue
from pamqp.header import ContentHeader

from ..errors import (
    AmqpLocksError,
    LockShapeMismatch,
    PreconditionFailed,
    QueueNotFound,
    ResourceLocked,
)
from .absent import while_absent
from .aiormq_compat import forget_returns, write_confirmed
from .channel_pools import ChannelPools
from .line_args import (
    LINE_VALUES,
    held_value,
    names_argument,
    note_other_line,
    other_line,
    parse_version,
    short_delay,
    short_delay_message,
)
from .refusals import invalid_arg

#: How often :meth:`QueueOps.wait_running` asks (s).
RUNNING_POLL = 0.02


class QueueOps(ChannelPools):
    """The queue half of :class:`~amqp_locks.transport.session.Session` (a mixin)."""

    #: Test-and-set creations (:meth:`declare_and_publish`) in flight: a connection the
    #: client gives up waits for them before its socket is aborted (Session.drop).
    creating: set[asyncio.Future[Any]]

    @property
    def version(self) -> tuple[int, int]:
        """The connected broker's (major, minor) version, from its server properties."""
        assert self.conn is not None
        return parse_version(self.conn.server_properties.get("version", b"3.0"))

    async def declare(
        self,
        queue: str,
        *,
        durable: bool = False,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        min_delay_ms: int = 0,
    ) -> int:
        """Declare `queue`; returns its message count. A queue another RabbitMQ line
        declared with other line-dependent arguments is declared as it is (line_args.py).
        `min_delay_ms`: the shortest lock delay a queue whose tokens are locks may already
        have (``ClusterTiming.min_delay_ms``); a shorter one is refused, naming the fix."""
        ready, _ = await self.declare_counts(
            queue,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=arguments,
            min_delay_ms=min_delay_ms,
        )
        return ready

    async def declare_counts(
        self,
        queue: str,
        *,
        durable: bool = False,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        min_delay_ms: int = 0,
    ) -> tuple[int, int]:
        """:meth:`declare`, returning (ready messages, consumers) as the declaration found
        them: one snapshot, taken when the queue was made or found."""
        args = arguments
        for attempt in range(len(LINE_VALUES) + 2):

            async def declare(ch: AbstractChannel, a: dict[str, Any] | None = args) -> Any:
                return await ch.queue_declare(
                    queue,
                    durable=durable,
                    exclusive=exclusive,
                    auto_delete=auto_delete,
                    arguments=a,
                )

            try:
                ok = await while_absent(queue, functools.partial(self.call, queue, declare))
            except PreconditionFailed as exc:
                held = short_delay(exc, min_delay_ms)
                if held is not None:  # a client's shape check (shape.py) says the same
                    raise LockShapeMismatch(
                        short_delay_message(queue, held, min_delay_ms),
                        queue,
                        held=held,
                        wanted=min_delay_ms,
                    ) from exc
                args = other_line(exc, args, self.version, min_delay_ms)
                if args is None or attempt == len(LINE_VALUES) + 1:
                    raise
                continue
            if args != arguments:
                note_other_line(queue, arguments or {}, args or {})
            return int(ok.message_count or 0), int(ok.consumer_count or 0)
        raise AssertionError("unreachable")  # pragma: no cover

    async def declare_and_publish(
        self,
        queue: str,
        arguments: dict[str, Any],
        messages: Sequence[tuple[bytes, Basic.Properties]],
    ) -> None:
        """Declare the durable `queue` and publish `messages` to it (mandatory, confirmed)
        in one write, as a test-and-set: returns once the declaration was accepted and
        every message confirmed; raises :class:`PreconditionFailed` when the broker
        refused the declaration with 406 "inequivalent arg" (the queue exists with other
        arguments; its text names the one that differs and the queue's value of it).

        The broker handles a channel's methods in order, and after a channel error it
        discards every method until the close handshake (AMQP 0-9-1, ``channel.close``):
        the publishes are routed right behind an accepted declaration, and dropped behind
        a refused one. Checked on 3.10.8 and 4.3.6: 30 connections racing this on one
        fresh quorum queue, each with its own ``x-max-length``, got one confirm and 29
        refusals, and the queue held exactly the creator's messages. Not atomic: a
        connection that ends while the broker handles the declaration loses the publishes
        (tokens/fresh.py, "Residual window")."""

        async def op(ch: AbstractChannel) -> None:
            await _declare_and_publish(ch, queue, arguments, messages)

        # A 404 closed the channel before the publishes behind it: trying again is a new
        # test-and-set, and no token of the refused one landed.
        call = asyncio.ensure_future(while_absent(queue, lambda: self.call(queue, op)))
        self.creating.add(call)
        call.add_done_callback(self.creating.discard)
        await call

    async def held_max_length(self, queue: str, arguments: dict[str, Any]) -> int | None:
        """The ``x-max-length`` the existing `queue` was declared with, read without
        changing anything (:meth:`held_argument`)."""
        return await self.held_argument(queue, arguments, "x-max-length")

    async def held_argument(self, queue: str, arguments: dict[str, Any], arg: str) -> int | None:
        """The integer argument `arg` the existing `queue` was declared with, read without
        changing anything: a declaration with `arguments` and ``arg: -1``, which the broker
        refuses either way. A queue that exists answers 406 "inequivalent arg" naming its
        value (once every argument compared before it matches ours: one of another line's
        arguments is adapted to as :meth:`declare` does); a missing one answers 406
        "invalid arg" and is not made (``x-max-length`` checked on 3.10.8, 4.0.5, 4.3.6;
        ``x-consumer-disconnected-timeout`` on 4.3.6, and only there: a line that does not
        know an argument does not check it, and would make the queue). Raises
        QueueNotFound when missing; None when the queue has no `arg`, or differs from
        `arguments` otherwise (another type)."""
        args = arguments
        for _ in range(len(LINE_VALUES) + 2):
            probe = {**args, arg: -1}

            async def declare(ch: AbstractChannel, a: dict[str, Any] = probe) -> Any:
                return await ch.queue_declare(queue, durable=True, arguments=a)

            try:
                await self.call(queue, declare)
            except PreconditionFailed as exc:
                if invalid_arg(exc) == arg:
                    raise QueueNotFound(f"queue {queue!r} does not exist") from exc
                if names_argument(exc, arg):
                    return held_value(exc, arg)
                adapted = other_line(exc, args, self.version)
                if adapted is None:
                    return None
                args = adapted
                continue
            raise AssertionError(f"the broker accepted {arg} -1 for {queue!r}")
        return None

    async def delete(self, queue: str) -> None:
        """Delete `queue` and wait for delete-ok (deleting a missing queue is not an error)."""
        await self.call(queue, lambda ch: ch.queue_delete(queue))

    async def declare_passive_counts(self, queue: str) -> tuple[int, int]:
        """Passive declare: (ready messages, consumers); raises QueueNotFound."""
        ok = await self.call(queue, lambda ch: ch.queue_declare(queue, passive=True))
        return int(ok.message_count or 0), int(ok.consumer_count or 0)

    async def declare_passive_count(self, queue: str) -> int:
        return (await self.declare_passive_counts(queue))[0]

    async def wait_running(self, queue: str, timeout: float) -> bool:
        """Whether the quorum queue `queue` shows within `timeout` seconds that it runs: a
        message ready or a consumer, by passive declares every :data:`RUNNING_POLL` s.
        RabbitMQ writes a quorum queue's record before it starts the queue's Raft member,
        and a ``basic.consume`` in between closes the consumer's whole connection (541
        noproc, 3.10 to 4.3: docs/cluster.md, "A queue that is still starting"); a
        passive declare then answers 0 and 0 without a crash. So this suits a queue that
        holds a message or a consumer whenever it runs (a lock's tokens, a fence
        generation): False means it showed neither in time (not started yet, or empty).
        Raises QueueNotFound when it is missing."""
        deadline = time.monotonic() + timeout
        while True:
            ready, consumers = await self.declare_passive_counts(queue)
            if ready or consumers:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(RUNNING_POLL)

    async def exists_passive(self, queue: str) -> bool:
        """Passive declare: True if the queue exists and this connection may use it."""
        try:
            await self.call(queue, lambda ch: ch.queue_declare(queue, passive=True))
        except (QueueNotFound, ResourceLocked):
            return False
        return True

    async def probe(self, queues: Sequence[str]) -> list[bool]:
        """Existence of each queue by mandatory publish with confirms, all in one round trip.

        A NO_ROUTE return (always sent before the ack) means the queue is absent. Probe
        messages expire at once (and our queues have ``x-max-length: 0``): nothing is left.
        """
        if not queues:
            return []
        found: list[bool] = await self.call(None, lambda ch: bulk_probe(ch, queues))
        return found

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes = b"",
        *,
        persistent: bool = False,
        mandatory: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> bool:
        """Publish with confirm; `persistent` for records that must survive a restart.
        With `mandatory`, False when no queue took it (the broker returned it)."""
        props = Basic.Properties(delivery_mode=2 if persistent else 1, headers=headers)

        async def send(ch: AbstractChannel) -> bool:
            try:
                await ch.basic_publish(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=props,
                    mandatory=mandatory,
                )
            except ex.PublishError:  # returned: the channel stays usable
                return False
            return True

        routed: bool = await self.call(None, send)
        return routed

    async def delete_and_notify(
        self,
        queue: str,
        wakeup_queue: str,
        slot: int = 0,
        headers: dict[str, Any] | None = None,
    ) -> bool:
        """Delete `queue` (a released lock) and publish its wake-up notice naming `slot`
        (0: no hint), back to back on one channel; True when the notice found the wake-up
        queue (someone waits). The broker handles a channel's methods in order, so the
        notice is routed only once the delete is done, and its confirm, which we await,
        says that too: one round trip where a delete-ok and then a notice took two. A
        waiter is woken without our round trip in between, and our own next acquire knows
        at once whether anyone waits (waiting.py). A failed delete closes the channel,
        which fails the publish with the delete's error (raised, typed, naming `queue`)."""
        props = Basic.Properties(delivery_mode=1, headers=headers)

        async def op(ch: AbstractChannel) -> bool:
            await ch.queue_delete(queue, nowait=True)
            try:
                await ch.basic_publish(
                    str(slot).encode(), routing_key=wakeup_queue, properties=props, mandatory=True
                )
            except ex.DeliveryError:
                # Returned (nobody waits), or nacked (4.x: the wake-up queue went away
                # under the notice as its last waiter left): the delete was handled before
                # either, and the channel stays usable.
                return False
            return True

        routed: bool = await self.call(queue, op)
        return routed

    def notify_soon(
        self,
        wakeup_queue: str,
        slots: Sequence[int] = (0,),
        headers: dict[str, Any] | None = None,
    ) -> asyncio.Future[bool]:
        """Fire-and-forget wake-up notices, one per freed slot, each naming its slot (a
        hint for the woken waiter; 0: no hint). Nobody waiting means no queue, and the
        notice is simply dropped; a lost notice costs a waiter one back-off interval.
        `headers` go on every notice (otel/handoff.py's trace header).

        The returned future says whether a notice found the queue (someone waits); it is
        False when the notices were returned, lost, or could not be sent."""

        async def go() -> bool:
            try:
                if len(slots) == 1:  # the usual case: written in this task's first step
                    return await self.publish(
                        "", wakeup_queue, str(slots[0]).encode(), mandatory=True, headers=headers
                    )
                routed = await asyncio.gather(
                    *(
                        self.publish(
                            "", wakeup_queue, str(k).encode(), mandatory=True, headers=headers
                        )
                        for k in slots
                    )
                )
            except AmqpLocksError:
                return False
            return any(routed)

        if self.alive:
            return self.spawn(go())
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        done.set_result(False)
        return done


#: Probe message ids, unique in the process (a return is matched to its probe by its id).
_probe_ids = itertools.count()


async def bulk_probe(ch: AbstractChannel, queues: Sequence[str]) -> list[bool]:
    """Write every probe publish in one buffer, then await all the confirms (a search over
    1000 slots sends 2000 probes: one write, not 2000; aiormq_compat.write_confirmed)."""
    if not hasattr(ch, "confirmations") or not hasattr(ch, "message_id_delivery_tag"):
        return await _probe_one_by_one(ch, queues)  # pragma: no cover - other aiormq
    ids = [f"amqp-locks-probe-{next(_probe_ids)}" for _ in queues]
    frames: list[Any] = []
    for q, message_id in zip(queues, ids, strict=True):
        props = Basic.Properties(delivery_mode=1, expiration="0", message_id=message_id)
        frames.append(Basic.Publish(routing_key=q, mandatory=True))
        frames.append(ContentHeader(properties=props, body_size=0))
    confirms = await write_confirmed(ch, frames, ids)
    try:
        results = await asyncio.gather(*confirms, return_exceptions=True)
    finally:
        forget_returns(ch, ids)
    found: list[bool] = []
    for r in results:
        if isinstance(r, ex.PublishError):
            found.append(False)
        elif isinstance(r, ex.DeliveryError):
            found.append(True)  # nacked: the queue exists but refused the message
        elif isinstance(r, BaseException):
            raise r
        else:
            found.append(True)
    return found


async def _probe_one_by_one(ch: AbstractChannel, queues: Sequence[str]) -> list[bool]:
    async def one(q: str) -> bool:
        # A fresh properties object each time: aiormq writes the message id into it,
        # and returns are matched to publishes by that id.
        props = Basic.Properties(delivery_mode=1, expiration="0")
        try:
            await ch.basic_publish(b"", routing_key=q, mandatory=True, properties=props)
        except ex.PublishError:
            return False
        except ex.DeliveryError:
            return True
        return True

    return list(await asyncio.gather(*(one(q) for q in queues)))


async def _declare_and_publish(
    ch: AbstractChannel,
    queue: str,
    arguments: dict[str, Any],
    messages: Sequence[tuple[bytes, Basic.Properties]],
) -> None:
    """`queue.declare` (no-wait) and mandatory publishes as one write on a confirm
    channel; returns once every publish is confirmed, raises the channel's error (the
    declaration's 406) or `PublishError` (returned). The publishes are registered in
    aiormq's confirm bookkeeping as `basic_publish` does it (see `bulk_probe`)."""
    frames: list[Any] = [Queue.Declare(queue=queue, durable=True, nowait=True, arguments=arguments)]
    for body, props in messages:
        if not props.message_id:  # returns are matched to publishes by it
            raise ValueError("declare_and_publish needs a message_id on every message")
        frames += [
            Basic.Publish(exchange="", routing_key=queue, mandatory=True),
            ContentHeader(properties=props, body_size=len(body)),
            ContentBody(body),
        ]
    ids = [props.message_id for _, props in messages]
    confirms = await write_confirmed(ch, frames, ids)
    try:
        # Every future is awaited (a closed channel fails them all), the first error raised.
        for outcome in await asyncio.gather(*confirms, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
    finally:
        forget_returns(ch, ids)
