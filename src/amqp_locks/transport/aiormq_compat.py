"""What amqp-locks needs from aiormq beyond its documented API, in one place.

aiormq (>= 6.9) is used through its public surface everywhere else. Three needs go further,
and each is written here with what it relies on, so that an aiormq upgrade that breaks one
breaks one small module, and `tests/test_compat.py` says which:

* **When bytes last arrived** (the loss watchdog in `session.py`): aiormq measures heartbeats
  internally and only closes after its own, longer grace. We pass a ``transport_factory``
  (aiormq's documented hook since 6.9) whose reader records the arrival time, wrapping
  aiormq's own TCP or TLS factory as the URL's scheme asks, so ``amqps://`` (and the
  ``cafile``/``certfile``/``keyfile``/``no_verify_ssl`` query options, or a ``context``)
  keep aiormq's TLS handling.
* **Whether the broker blocked the connection** (``connection.blocked``, a resource alarm):
  aiormq keeps it in a name-mangled private event; without it we assume "not blocked".
* **aiormq's logger names**, which `session.py` filters for records about our own
  connections.
* **Several methods in one write** (`send_together`): aiormq writes each method with a
  socket send of its own, and the broker reads each separately. Methods that expect no
  reply (a token release's cancel, ack and re-publish) go as one buffer on the channel's
  write queue, as aiormq itself marshals a publish; `session.py`'s bulk probe does the
  same with confirms.
* **Channel numbers the broker has let go of** (:class:`ChannelNumbers`, `open_numbered`):
  aiormq frees a number when the broker's ``channel.close`` *arrives*, before its reader
  has queued the ``close-ok`` (and drops that close-ok when its write queue is full, the
  cause measured in tests/test_channel_numbers.py), and numbers a new channel ``max(open)
  + 1``; a ``channel.open`` on a number the broker is still closing makes RabbitMQ close
  the whole connection (504 "second 'channel.open' seen"; issue 37: 640 of 800 first-use
  acquires, 20 at a time, lost that way). We number channels ourselves from what crossed
  the wire (both directions are read through the transport above): a number is free again
  only after the broker's ``close-ok`` to our ``close``, or after our ``close-ok`` to its
  ``close`` was written. aiormq's ``channel(channel_number=...)`` is public API. aiormq
  also queues its close-ok with ``put_nowait`` on its bounded write queue and *drops* it
  when the queue is full (the broker then holds the channel, closing, for the connection's
  life): `keep_every_close_ok` makes that queue unbounded.
* **No frame on a channel after its close** (:class:`WriteGuard`): once our
  ``channel.close`` (or our ``close-ok`` to the broker's) is written, RabbitMQ forgets the
  number, and any later frame on it but ``channel.open`` closes the whole connection (504
  "expected 'channel.open'"), every lease on it lost. aiormq writes such frames: an RPC
  that times out writes ``channel.close`` without waiting, and ``basic_publish`` (its
  ``lock`` checks only ``is_closed``, false until the close-ok arrives) still goes out
  after it, as do `send_together`'s frames (stop 45's CI: a lease on a live node lost so,
  on 3.10.8, while the node leading the lock's queues died). The writer drops them: what
  they carried is what the closing channel gives back anyway.
* **Many ``basic.get`` in flight on one channel** (`route_gets`, the quorum guard's lock
  checks): aiormq runs one ``basic.get`` per channel at a time. The replies are taken
  from its channel reader (``_on_get_frame``, ``_get_frame``, ``rpc_frames``) and
  matched in order by the caller (tests/test_quorum_guard.py).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable, Container, Sequence
from typing import Any

import aiormq
from aiormq.abc import AbstractChannel, ChannelFrame
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
from aiormq.exceptions import ChannelInvalidStateError
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from yarl import URL

#: The loggers aiormq writes connection and channel records to.
LOGGER_NAMES = ("aiormq.connection", "aiormq.connection.marshall", "aiormq.channel")

log = logging.getLogger("amqp_locks.transport")

#: (class id, method id) of the channel methods :class:`ChannelNumbers` follows.
CHANNEL_OPEN = (20, 10)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)
_FRAME_HEADER = struct.Struct(">BHI")  # type, channel, payload size
_METHOD_FRAME = 1
_FRAME_END = 0xCE


class FrameWatch:
    """Reads an AMQP 0-9-1 byte stream (in any chunks) just far enough to call
    ``on_method(channel, class_id, method_id)`` for every method frame; the rest of each
    frame is skipped unread (what the broker sends; our writes pass :class:`WriteGuard`)."""

    def __init__(self, on_method: Callable[[int, int, int], None]) -> None:
        self._on_method = on_method
        self._head = bytearray()  # the frame header read so far (7 bytes, then 4 of method)
        self._skip = 0  # bytes to pass over unread

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                step = min(self._skip, n - i)
                i += step
                self._skip -= step
                continue
            want = (7 if len(self._head) < 7 else 11) - len(self._head)
            chunk = data[i : i + want]
            self._head += chunk
            i += len(chunk)
            if len(self._head) == 7:
                kind, _, size = _FRAME_HEADER.unpack(self._head)
                if kind != _METHOD_FRAME or size < 4:
                    self._skip = size + 1  # payload and frame-end octet
                    self._head.clear()
            elif len(self._head) == 11:
                _, channel, size = _FRAME_HEADER.unpack_from(self._head)
                class_id, method_id = struct.unpack_from(">HH", self._head, 7)
                self._skip = size - 4 + 1
                self._head.clear()
                self._on_method(channel, class_id, method_id)


class ChannelNumbers:
    """The channel numbers of one connection, each free again only once the broker let go
    of it (the module docstring says why aiormq's own numbering is not enough):

    * after the broker's ``channel.close-ok`` (it answered our ``channel.close``), unless
      the broker had sent a ``channel.close`` of its own first (the two crossed);
    * after our ``channel.close-ok`` to the broker's ``channel.close`` was written.

    A number whose channel failed before either (an open cancelled, a close-ok never
    written) stays taken for the connection's life: safe, and counted in `withheld`.
    Numbers go round from 1 to the connection's ``channel_max``, so a freed one comes back
    last."""

    def __init__(self) -> None:
        self.taken: set[int] = set()
        #: Numbers whose ``channel.close`` came from the broker, our close-ok not yet written.
        self.closed_by_broker: set[int] = set()
        #: Frames :class:`WriteGuard` kept off the wire (written after their channel's close).
        self.dropped = 0
        self._next = 1

    def take(self, limit: int, in_use: Container[int] = ()) -> int:
        """A free number in 1..`limit` (also not in `in_use`: aiormq's own table)."""
        limit = limit or 65535
        start = self._next if 1 <= self._next <= limit else 1
        n = start
        while n in self.taken or n in in_use:
            n = n + 1 if n < limit else 1
            if n == start:
                raise ChannelInvalidStateError(
                    f"no channel number free: all {limit} are open or still closing"
                )
        self.taken.add(n)
        self._next = n + 1
        return n

    @property
    def withheld(self) -> int:
        """Numbers taken (open channels, and those never confirmed closed)."""
        return len(self.taken)

    def heard(self, channel: int, class_id: int, method_id: int) -> None:
        """A method frame arrived from the broker."""
        if (class_id, method_id) == CHANNEL_CLOSE:
            self.closed_by_broker.add(channel)
        elif (class_id, method_id) == CHANNEL_CLOSE_OK and channel not in self.closed_by_broker:
            self.taken.discard(channel)

    def wrote(self, channel: int, class_id: int, method_id: int) -> None:
        """A method frame was written to the socket."""
        if (class_id, method_id) == CHANNEL_CLOSE_OK and channel in self.closed_by_broker:
            self.closed_by_broker.discard(channel)
            self.taken.discard(channel)


def keep_every_close_ok(conn: aiormq.Connection) -> None:
    """Before `conn` connects: an unbounded write queue (``Connection.write_queue``), so
    aiormq's ``put_nowait`` of a close-ok never fails. (The bound, 10 frames, held back
    no bytes anyway: aiormq's writer hands each frame to the transport without waiting
    for it to drain.)"""
    if conn.started:  # pragma: no cover - a programming error
        raise RuntimeError("keep_every_close_ok must be called before connect()")
    conn.write_queue = asyncio.Queue()


async def open_numbered(
    conn: aiormq.Connection, numbers: ChannelNumbers, *, publisher_confirms: bool
) -> AbstractChannel:
    """``conn.channel(...)`` on a number from `numbers` (never one the broker still
    holds)."""
    await conn.connected.wait()
    limit = int(getattr(getattr(conn, "connection_tune", None), "channel_max", 0) or 0)
    number = numbers.take(limit, conn.channels)
    return await conn.channel(channel_number=number, publisher_confirms=publisher_confirms)


class _TimedReader:
    """A StreamReader proxy calling `on_bytes` whenever bytes arrive (and showing them to
    `watch`)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        on_bytes: Callable[[float], None],
        watch: FrameWatch | None = None,
    ) -> None:
        self._reader = reader
        self._on_bytes = on_bytes
        self._watch = watch

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self._on_bytes(time.monotonic())
        if self._watch is not None:
            self._watch.feed(data)
        return data

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._on_bytes(time.monotonic())
        if self._watch is not None:
            self._watch.feed(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class WriteGuard:
    """Every frame a connection writes passes here, in socket order (aiormq writes whole
    frames; a partial one is held until the rest comes). Each method frame that passes is
    told to `numbers` (:meth:`ChannelNumbers.wrote`). A frame on a channel whose
    ``channel.close`` or ``close-ok`` we already wrote is dropped, until a
    ``channel.open`` on that number (the module docstring says why), except the
    ``close-ok`` that answers a close of the broker's crossing ours. Bytes that turn out
    not to be AMQP framing (no frame-end octet) pass unfiltered from then on."""

    def __init__(self, numbers: ChannelNumbers) -> None:
        self._numbers = numbers
        self._held = b""  # a frame begun but not yet whole (or the protocol header)
        self._started = False
        self._blind = False  # the stream is not AMQP framing: pass it as it comes
        #: Numbers we closed (or confirmed the broker's close of), not reopened since.
        self.shut: set[int] = set()

    def filter(self, data: bytes) -> bytes:
        """The bytes of `data` that may go to the socket."""
        if self._blind:
            return data
        if self._held:
            data, self._held = self._held + data, b""
        i, n = 0, len(data)
        if not self._started:
            if n < 8 and b"AMQP".startswith(data[:4]):
                self._held = data
                return b""
            self._started = True
            if not data.startswith(b"AMQP"):  # not a client's AMQP 0-9-1 stream
                self._blind = True
                return data
            i = 8
        kept: list[memoryview] | None = None  # None: everything so far is kept
        mv = memoryview(data)
        while i < n:
            if n - i < 7:
                break
            kind, channel, size = _FRAME_HEADER.unpack_from(data, i)
            end = i + 7 + size + 1
            if end > n:
                break
            if data[end - 1] != _FRAME_END:
                self._blind = True
                return data if kept is None else b"".join([*kept, mv[i:]])
            method = (
                struct.unpack_from(">HH", data, i + 7)
                if kind == _METHOD_FRAME and size >= 4
                else None
            )
            if self._passes(channel, method):
                if kept is not None:
                    kept.append(mv[i:end])
                if method is not None:
                    self._numbers.wrote(channel, *method)
            else:
                if kept is None:
                    kept = [mv[:i]]
                self._numbers.dropped += 1
                log.debug(
                    "frame (type %d, method %s) on channel %d dropped: written after the"
                    " channel's close, which RabbitMQ answers by closing the connection",
                    kind,
                    method,
                    channel,
                )
            i = end
        if i < n:
            self._held = bytes(data[i:])
            if kept is None:
                kept = [mv[:i]]
        return data if kept is None else b"".join(kept)

    def _passes(self, channel: int, method: tuple[int, int] | None) -> bool:
        if channel == 0:
            return True
        if method == CHANNEL_OPEN:
            self.shut.discard(channel)
            return True
        if channel in self.shut:
            return method == CHANNEL_CLOSE_OK
        if method in (CHANNEL_CLOSE, CHANNEL_CLOSE_OK):
            self.shut.add(channel)
        return True


class _WatchedWriter:
    """A StreamWriter proxy passing every write through `guard` (in socket order)."""

    def __init__(self, writer: asyncio.StreamWriter, guard: WriteGuard) -> None:
        self._writer = writer
        self._guard = guard

    def write(self, data: bytes) -> None:
        kept = self._guard.filter(data)
        if kept:
            self._writer.write(kept)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


class TimedTransport(TransportFactory):
    """aiormq's transport for `url`'s scheme (TLS for ``amqps``), reporting each arrival of
    bytes to `on_bytes` and handing the stream writer to `on_writer` (the watchdog aborts
    the transport through it). With `numbers`, the channel methods crossing the wire both
    ways keep it up to date (:class:`ChannelNumbers`)."""

    def __init__(
        self,
        url: URL,
        on_bytes: Callable[[float], None],
        on_writer: Callable[[asyncio.StreamWriter], None],
        numbers: ChannelNumbers | None = None,
    ) -> None:
        self._inner: TransportFactory = (
            TLSTransportFactory() if url.scheme == "amqps" else TCPTransportFactory()
        )
        self._on_bytes = on_bytes
        self._on_writer = on_writer
        self._numbers = numbers

    async def create(self, url: URL, **kwargs: Any) -> tuple[Any, Any]:
        reader, writer = await self._inner.create(url, **kwargs)
        self._on_writer(writer)
        if self._numbers is None:
            return _TimedReader(reader, self._on_bytes), writer
        heard = FrameWatch(self._numbers.heard)
        guard = WriteGuard(self._numbers)
        return _TimedReader(reader, self._on_bytes, heard), _WatchedWriter(writer, guard)


def connection_blocked(conn: aiormq.Connection | None) -> bool:
    """RabbitMQ sent ``connection.blocked`` (a resource alarm) and not yet ``unblocked``."""
    unblocked = getattr(conn, "_Connection__connection_unblocked", None)
    return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()


def is_tls(writer: asyncio.StreamWriter | None) -> bool:
    """The connection runs over TLS (for logs and tests)."""
    return writer is not None and writer.get_extra_info("ssl_object") is not None


def publish_frames(body: bytes, routing_key: str, properties: Basic.Properties) -> list[Any]:
    """A publish to the default exchange as frames for `send_together` (no mandatory, no
    confirm: nothing comes back for it). `body` must fit one frame (ours are tiny)."""
    return [
        Basic.Publish(exchange="", routing_key=routing_key),
        ContentHeader(body_size=len(body), properties=properties),
        ContentBody(body),
    ]


async def send_together(ch: AbstractChannel, frames: list[Any]) -> None:
    """Queue `frames` (methods that expect no reply) as one write, in order with every
    other method of the channel."""
    chan: Any = ch
    if ch.is_closed:
        raise ChannelInvalidStateError(f"{ch!r} closed")
    async with chan.lock:
        await chan.write_queue.put(ChannelFrame.marshall(channel_number=chan.number, frames=frames))


async def write_confirmed(
    ch: AbstractChannel, frames: list[Any], message_ids: Sequence[str | None]
) -> list[asyncio.Future[Any]]:
    """Queue `frames` as one write, with a publisher confirm registered for each publish
    among them (`message_ids`, in publish order; an id matches a ``basic.return`` to its
    publish, as aiormq's ``basic_publish`` does it: the id must be in that publish's
    properties). Returns the confirms' futures in order, settled by aiormq's own reader;
    :func:`forget_returns` once they are. aiormq's ``basic_publish`` costs ~0.2 ms of
    client CPU per message (a write-queue round and a future per frame set); a slot search
    writes thousands of probes, a fence creation a declare and two publishes at once."""
    chan: Any = ch
    if ch.is_closed:
        raise ChannelInvalidStateError(f"{ch!r} closed")
    confirms: list[asyncio.Future[Any]] = []
    async with chan.lock:
        for message_id in message_ids:
            chan.delivery_tag += 1
            confirm: asyncio.Future[Any] = chan.create_future()
            chan.confirmations[chan.delivery_tag] = confirm
            if message_id is not None:
                chan.message_id_delivery_tag[message_id] = chan.delivery_tag
            confirms.append(confirm)
        await chan.write_queue.put(ChannelFrame.marshall(channel_number=chan.number, frames=frames))
    return confirms


def forget_returns(ch: AbstractChannel, message_ids: Sequence[str | None]) -> None:
    """After :func:`write_confirmed`'s confirms settled: drop their ids from aiormq's
    table of returnable publishes."""
    table = getattr(ch, "message_id_delivery_tag", None)
    if isinstance(table, dict):
        for message_id in message_ids:
            table.pop(message_id, None)


def forget_consumer(ch: AbstractChannel, consumer_tag: str) -> None:
    """A consumer cancelled with nowait through `send_together`: no cancel-ok will come,
    so take it out of aiormq's table, as its own ``basic_cancel(nowait=True)`` does."""
    consumers = getattr(ch, "consumers", None)
    if isinstance(consumers, dict):
        consumers.pop(consumer_tag, None)


class _NoGetReplies(asyncio.Queue):  # type: ignore[type-arg]
    """aiormq's queue of RPC replies, minus ``basic.get``'s (see :func:`route_gets`)."""

    async def put(self, item: Any) -> None:
        if not isinstance(item, (Basic.GetOk, Basic.GetEmpty)):
            await super().put(item)


def route_gets(ch: AbstractChannel, on_reply: Callable[[int | None], None]) -> None:
    """Hand every ``basic.get`` reply on `ch` to ``on_reply(delivery_tag)`` (None: empty)
    instead of aiormq's single waiting getter, so a caller may write many ``basic.get``
    frames at once (`send_together`) and match the replies in order (AMQP answers a
    channel's synchronous methods in the order they were sent). aiormq's channel reader
    calls ``_on_get_frame`` for each reply, reads a GetOk's content with ``_get_frame``,
    then queues the reply for its ``rpc``: here it is not queued (no ``rpc`` waits for it;
    a channel routed so must run no other synchronous method)."""
    chan: Any = ch

    async def on_get(frame: Basic.GetOk | Basic.GetEmpty) -> None:
        tag = None
        if isinstance(frame, Basic.GetOk):
            header = await chan._get_frame()
            size = getattr(header, "body_size", 0) or 0
            while size > 0:
                size -= len((await chan._get_frame()).value)
            tag = frame.delivery_tag
        on_reply(tag)

    chan._on_get_frame = on_get
    chan.rpc_frames = _NoGetReplies()


def close_reason(ch: AbstractChannel) -> str:
    """Why `ch` closed, as the broker or aiormq said it ("open" while it is not closed):
    for logs that have to explain a lost proof after the fact."""
    closing = ch.closing
    if not closing.done():
        closing.cancel()  # an observer of an open channel: stop it, nothing is waiting
        return "open"
    if closing.cancelled():
        return "closed"
    exc = closing.exception()
    return "closed" if exc is None else f"{type(exc).__name__}: {exc}"
