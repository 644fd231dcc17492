"""Push wake-ups: release notices on `amq.direct`, one server-named queue per connection.

A holder that releases cleanly publishes to `amq.direct` with the lock's release key; every
waiting process has bound its connection's notice queue to that key and wakes at once.
A crashed holder publishes nothing, so waiters also re-check on a bounded back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiormq.abc import AbstractChannel, DeliveredMessage

from ..errors import AmqpLocksError

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("amqp_locks.transport")

EXCHANGE = "amq.direct"


class Subscription:
    """A waiter's view of one release key: :meth:`wait` returns early on a notice."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def clear(self) -> None:
        self.event.clear()

    async def wait(self, timeout: float | None) -> bool:
        """Wait for a notice; True if one came, False when `timeout` passed first."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except TimeoutError:
            return False
        return True


class NoticeHub:
    """Per-session notice queue and the subscriptions of the waiters using it."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._channel: AbstractChannel | None = None
        self._queue: str | None = None
        self._subs: dict[str, set[Subscription]] = {}
        self._bound: set[str] = set()
        self._lock = asyncio.Lock()

    async def _ensure_queue(self) -> tuple[AbstractChannel, str]:
        if self._channel is not None and not self._channel.is_closed and self._queue:
            return self._channel, self._queue
        self._bound.clear()
        ch = await self._session.open_channel()
        ok = await ch.queue_declare("", exclusive=True, auto_delete=True)
        queue = str(ok.queue)
        await ch.basic_consume(queue, self._on_message, no_ack=True)
        self._channel, self._queue = ch, queue
        return ch, queue

    async def _on_message(self, message: DeliveredMessage) -> None:
        key = message.routing_key or ""
        for sub in self._subs.get(key, ()):
            sub.event.set()

    def wake_all(self) -> None:
        """Wake every waiter (the session died: they must notice and reconnect)."""
        for subs in self._subs.values():
            for sub in subs:
                sub.event.set()

    @contextlib.asynccontextmanager
    async def subscribe(self, key: str) -> AsyncIterator[Subscription]:
        """Bind to `key` for the duration of the block.

        If the notice queue cannot be set up the waiter still works, by polling only.
        """
        sub = Subscription()
        self._subs.setdefault(key, set()).add(sub)
        try:
            try:
                async with self._lock:
                    ch, queue = await self._ensure_queue()
                    if key not in self._bound:
                        await ch.queue_bind(queue, EXCHANGE, routing_key=key)
                        self._bound.add(key)
            except (AmqpLocksError, Exception) as exc:
                log.debug("notice subscription for %r unavailable (%s); polling only", key, exc)
            yield sub
        finally:
            subs = self._subs.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[key]
                    self._session.spawn(self._unbind_later(key))

    async def _unbind_later(self, key: str) -> None:
        async with self._lock:
            if key in self._subs or key not in self._bound:
                return
            ch, queue = self._channel, self._queue
            self._bound.discard(key)
            if ch is None or ch.is_closed or queue is None:
                return
            with contextlib.suppress(Exception):
                await ch.queue_unbind(queue, EXCHANGE, routing_key=key)
