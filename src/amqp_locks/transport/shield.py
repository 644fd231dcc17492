"""Never cancel an AMQP exchange half-way.

Cancelling a coroutine in the middle of an RPC leaves the connection in a state the broker
punishes: a channel number whose `channel.open` never went out (CHANNEL_ERROR closes the
whole connection, and every lease on it), confirms for publishes nobody awaits. Protocol
steps therefore run shielded: the caller's cancellation is raised at once, the step
finishes in the background, and `undo` is applied to whatever it produced (close the
channel, release the grant).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("amqp_locks.transport")

T = TypeVar("T")

_background: set[asyncio.Task[Any]] = set()


def _keep(task: asyncio.Task[Any]) -> None:
    _background.add(task)
    task.add_done_callback(_background.discard)


async def shielded(
    coro: Coroutine[Any, Any, T], undo: Callable[[T], Awaitable[Any]] | None = None
) -> T:
    """Await `coro` to completion even if we are cancelled; then undo its result."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _keep(task)

        def finished(t: asyncio.Task[T]) -> None:
            if undo is None or t.cancelled() or t.exception() is not None:
                return
            result = t.result()
            if result is not None:
                _keep(asyncio.ensure_future(_quietly(undo(result))))

        task.add_done_callback(finished)
        raise


async def _quietly(aw: Awaitable[Any]) -> None:
    try:
        await aw
    except Exception:
        log.debug("undo after cancellation failed", exc_info=True)


async def close_quietly(ch: Any) -> None:
    """Close a channel whatever state it is in (the usual `undo`): what it holds unacked
    goes back to its queues, and a channel already closed or broken is no error."""
    with contextlib.suppress(Exception):
        await ch.close()
