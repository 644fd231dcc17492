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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
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


class _TimedReader:
    """A StreamReader proxy calling `on_bytes` whenever bytes arrive."""

    def __init__(self, reader: asyncio.StreamReader, on_bytes: Callable[[float], None]) -> None:
        self._reader = reader
        self._on_bytes = on_bytes

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self._on_bytes(time.monotonic())
        return data

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._on_bytes(time.monotonic())
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class TimedTransport(TransportFactory):
    """aiormq's transport for `url`'s scheme (TLS for ``amqps``), reporting each arrival of
    bytes to `on_bytes` and handing the stream writer to `on_writer` (the watchdog aborts
    the transport through it)."""

    def __init__(
        self,
        url: URL,
        on_bytes: Callable[[float], None],
        on_writer: Callable[[asyncio.StreamWriter], None],
    ) -> None:
        self._inner: TransportFactory = (
            TLSTransportFactory() if url.scheme == "amqps" else TCPTransportFactory()
        )
        self._on_bytes = on_bytes
        self._on_writer = on_writer

    async def create(self, url: URL, **kwargs: Any) -> tuple[Any, Any]:
        reader, writer = await self._inner.create(url, **kwargs)
        self._on_writer(writer)
        return _TimedReader(reader, self._on_bytes), writer


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


def forget_consumer(ch: AbstractChannel, consumer_tag: str) -> None:
    """A consumer cancelled with nowait through `send_together`: no cancel-ok will come,
    so take it out of aiormq's table, as its own ``basic_cancel(nowait=True)`` does."""
    consumers = getattr(ch, "consumers", None)
    if isinstance(consumers, dict):
        consumers.pop(consumer_tag, None)
