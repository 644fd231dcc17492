"""What the transport's parts need of their neighbours, as protocols: they never import up.

The session builds its collaborators (the holder responder and reader, the quorum guard)
and hands itself to them as a :class:`Link`; the Broker releases what the lock kinds hold
through :class:`Releasable`. Either side can then be read and tested alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import aiormq
from aiormq.abc import AbstractChannel
from yarl import URL

#: Called once with the reason when a connection is lost.
LostCallback = Callable[[str], None]


class Link(Protocol):
    """One live connection, as the parts the session builds see it."""

    url: URL
    connection_name: str
    holder_id: str
    conn: aiormq.Connection | None

    @property
    def alive(self) -> bool: ...

    @property
    def leases(self) -> Iterable[Any]:
        """The locks held through this connection (HeldState objects: holders.py)."""

    @property
    def version(self) -> tuple[int, int]:
        """The broker's (major, minor) version."""

    def check(self) -> None:
        """Raise :class:`~amqp_locks.errors.ConnectionLost` once the connection is gone."""

    async def open_channel(self) -> AbstractChannel: ...

    async def raw_channel(self, *, publisher_confirms: bool) -> AbstractChannel:
        """A new channel, aiormq's errors unchanged (channel_pools.py)."""

    def add_listener(self, cb: LostCallback) -> int:
        """Call `cb(reason)` when the connection is lost; returns a handle."""

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run a background task tied to this connection."""

    async def close(self) -> None:
        """Close the connection (what it holds is released)."""


class Releasable(Protocol):
    """A held lock, as the Broker releases it (held.HeldState is one)."""

    kind: str
    name: str
    number: int
    release_job: asyncio.Future[Any] | None
    release_failure: str | None

    async def release(self) -> None: ...

    async def release_confirmed(self) -> None: ...
