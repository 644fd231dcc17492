"""The session's channels: pooled for single calls, ready (prefetch 1) for a lease's
watch and sentinel consumers, and holder channels (prefetch 1, maybe transactional) for a
held token. Opening a channel costs a round trip; the pools keep acquires from paying it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiormq
import aiormq.exceptions as ex
from aiormq.abc import AbstractChannel
from yarl import URL

from ..errors import AmqpLocksError, ConnectionLost
from .aiormq_compat import ChannelNumbers, open_numbered
from .errors import censor, channel_error
from .shield import close_quietly, closing

log = logging.getLogger("amqp_locks.transport")

#: What a failing channel operation raises (besides our own typed errors).
#: ValueError: pamqp refusing a frame's field (a name outside its domain) as it builds it.
CHANNEL_ERRORS = (
    ex.AMQPError,
    ConnectionError,
    ex.ChannelInvalidStateError,
    RuntimeError,
    ValueError,
)
#: Idle holder channels kept per kind (more are closed): one per concurrent holder.
HOLDER_POOL = 16
#: Spare ready channels kept open for the next leases' watch and sentinel consumers.
READY_SPARES = 2
#: Ready channels kept when leases give theirs back (more are closed).
READY_POOL = 16
#: Spare pooled channels for single RPCs kept open after an error closed one: a waiter's
#: refused attempt (405) costs its channel, and the attempt its wake-up notice starts
#: should not wait for a `channel.open` + `confirm.select`.
CALL_SPARES = 1


class ChannelPools:
    """The channel half of :class:`~amqp_locks.transport.session.Session` (a mixin: the
    session owns the connection these channels live on)."""

    url: URL
    conn: aiormq.Connection | None
    lost_reason: str | None
    #: This connection's channel numbers (aiormq_compat.ChannelNumbers: never one the
    #: broker is still closing).
    numbers: ChannelNumbers

    def _init_pools(self) -> None:
        self.numbers = ChannelNumbers()  # replaced by each connect's own
        self._idle: list[AbstractChannel] = []
        #: Channels ready to hold a token (prefetch 1 set; transactional ones for the
        #: token semaphore's counter-carrying release), so an acquire opens none.
        self._holder_idle: dict[bool, list[AbstractChannel]] = {False: [], True: []}
        #: Spare channels with prefetch 1 set (`ready_channel`).
        self._ready: list[AbstractChannel] = []
        #: Spares being opened per pool (`_refill`), by the pool's id.
        self._opening: dict[int, int] = {}

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        raise NotImplementedError

    # --- channels -----------------------------------------------------------------------

    async def raw_channel(self, *, publisher_confirms: bool) -> AbstractChannel:
        """A new channel (aiormq's errors unchanged). Every channel of the session is
        opened here: its number comes from :attr:`numbers`, never aiormq's own choice."""
        self.check()
        assert self.conn is not None
        return await open_numbered(self.conn, self.numbers, publisher_confirms=publisher_confirms)

    async def open_channel(self) -> AbstractChannel:
        try:
            return await self.raw_channel(publisher_confirms=True)
        except CHANNEL_ERRORS as exc:
            raise channel_error(exc) from exc

    def idle_holder_channel(self, transactional: bool) -> AbstractChannel | None:
        """A pooled holder channel, if one is idle (no round trip, no await)."""
        return _take_open(self._holder_idle[transactional])

    async def holder_channel(self, transactional: bool) -> AbstractChannel:
        """A channel with prefetch 1 (and, if `transactional`, tx selected) for holding a
        token; hand it back with :meth:`return_holder_channel` once it holds nothing."""
        ch = self.idle_holder_channel(transactional)
        if ch is not None:
            return ch
        try:
            # Transactions and publisher confirms exclude each other on a channel.
            ch = await self.raw_channel(publisher_confirms=not transactional)
            await ch.basic_qos(prefetch_count=1)
            if transactional:
                await ch.tx_select()
        except CHANNEL_ERRORS as exc:
            raise channel_error(exc) from exc
        return ch

    async def ready_channel(self) -> AbstractChannel:
        """A fresh channel with prefetch 1 already set, for one lease's watch or sentinel
        consumers (handed back clean by `recycle_ready` when the lease ends, else closed).
        Spares are opened in the background so an acquire waits for none."""
        ch = _take_open(self._ready) or await self._open_ready()
        self._refill_ready()
        return ch

    async def _open_ready(self) -> AbstractChannel:
        try:
            ch = await self.raw_channel(publisher_confirms=True)
            await ch.basic_qos(prefetch_count=1)
        except CHANNEL_ERRORS as exc:
            raise channel_error(exc) from exc
        return ch

    def _refill_ready(self) -> None:
        self._refill(self._ready, READY_SPARES, self._open_ready)

    def _refill(
        self,
        pool: list[AbstractChannel],
        spares: int,
        opener: Callable[[], Awaitable[AbstractChannel]],
    ) -> None:
        """Open channels for `pool` in the background until it holds `spares` (counting
        those still being opened), so the next taker waits for none."""
        opening = self._opening.get(id(pool), 0)
        for _ in range(max(0, spares - len(pool) - opening) if self.alive else 0):
            self._opening[id(pool)] = self._opening.get(id(pool), 0) + 1
            self.spawn(self._add_spare(pool, opener))

    async def _add_spare(
        self, pool: list[AbstractChannel], opener: Callable[[], Awaitable[AbstractChannel]]
    ) -> None:
        try:
            ch = await opener()
        except AmqpLocksError as exc:
            log.debug("could not open a spare channel: %s", exc)
        else:
            self._keep(pool, ch, READY_POOL)
        finally:
            self._opening[id(pool)] -= 1

    def return_ready(self, ch: AbstractChannel) -> None:
        """Keep a ready channel that was taken but never used (clean as it came)."""
        self._keep(self._ready, ch, READY_POOL)

    def recycle_ready(self, ch: AbstractChannel, clean: Callable[[], Awaitable[Any]]) -> None:
        """In the background, run `clean` (what makes `ch` a clean ready channel again:
        prefetch 1, no consumer, nothing unacked) and keep the channel for the next lease;
        a channel that fails to clean is closed (what it holds goes back)."""

        async def go() -> None:
            try:
                await clean()
            except Exception:
                await close_quietly(ch)
            else:
                self._keep(self._ready, ch, READY_POOL)

        self.spawn(go())

    def return_holder_channel(self, ch: AbstractChannel, transactional: bool) -> None:
        """Keep a channel that holds no delivery and no consumer for the next acquire."""
        self._keep(self._holder_idle[transactional], ch, HOLDER_POOL)

    def _keep(self, pool: list[AbstractChannel], ch: AbstractChannel, size: int) -> None:
        """Put a clean channel in `pool` (at most `size`); close it if the pool is full."""
        if closing(ch):  # a close begun elsewhere: never handed out again
            return
        if self.alive and len(pool) < size:
            pool.append(ch)
        elif self.alive:
            self.spawn(close_quietly(ch))

    @contextlib.asynccontextmanager
    async def channel(self) -> AsyncIterator[AbstractChannel]:
        """A pooled channel; one broken by an error is dropped, never reused."""
        ch = self._idle.pop() if self._idle else await self.open_channel()
        while closing(ch):
            ch = self._idle.pop() if self._idle else await self.open_channel()
        try:
            yield ch
        except BaseException:
            # Errors and cancellations may leave replies in flight on this channel
            # (confirms of cancelled probes): never hand it to someone else.
            if not ch.is_closed and self.alive:
                self.spawn(close_quietly(ch))
            self._refill(self._idle, CALL_SPARES, self.open_channel)
            raise
        if not closing(ch) and self.alive:
            self._idle.append(ch)

    async def call(self, queue: str | None, op: Callable[[AbstractChannel], Any]) -> Any:
        """Run one RPC on a pooled channel, translating errors to typed ones."""
        async with self.channel() as ch:
            try:
                return await op(ch)
            except AmqpLocksError:
                raise
            except CHANNEL_ERRORS as exc:
                if not self.alive:
                    raise ConnectionLost(
                        f"connection to {censor(self.url)} lost: {self.lost_reason}"
                    ) from exc
                raise channel_error(exc, queue) from exc


def _take_open(pool: list[AbstractChannel]) -> AbstractChannel | None:
    """The newest channel of `pool` still open (closed ones are dropped), or None."""
    while pool:
        ch = pool.pop()
        if not closing(ch):
            return ch
    return None
