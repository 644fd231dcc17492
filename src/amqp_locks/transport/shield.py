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
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ..errors import BrokerTimeout

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
        _undo_later(task, undo)
        raise


async def _quietly(aw: Awaitable[Any]) -> None:
    try:
        await aw
    except Exception:
        log.debug("undo after cancellation failed", exc_info=True)


#: Channels `close_quietly` has begun to close. aiormq says a channel is closed only once
#: the broker's close-ok arrives; the session's pools never hand out one of these.
_closing: weakref.WeakSet[Any] = weakref.WeakSet()


def closing(ch: Any) -> bool:
    """Whether `ch` is closed or its close has begun (never to be used again)."""
    return bool(ch.is_closed) or ch in _closing


def close_quietly(ch: Any) -> Coroutine[Any, Any, None]:
    """Close a channel whatever state it is in (the usual `undo`): what it holds unacked
    goes back to its queues, and a channel already closed or broken is no error. The
    channel counts as closing from this call on, not from when a spawned close first runs:
    no pool can take it in between."""
    _closing.add(ch)
    return _close(ch)


async def _close(ch: Any) -> None:
    with contextlib.suppress(Exception):
        await ch.close()


#: How long past the caller's timeout a wait may run before it is cut: a healthy broker's
#: wait ends at the deadline on its own (plus the round trip in flight, or the connection
#: being opened), so the cut only meets a broker that stopped answering.
CUT_GRACE = 0.6
#: What a cut wait gets to wind down (its cancellation runs) before the caller is answered
#: anyway; whatever it still holds is undone in the background.
CUT_SETTLE = 0.2


async def within(
    coro: Coroutine[Any, Any, T],
    timeout: float | None,
    undo: Callable[[T], Awaitable[Any]] | None = None,
    cut: Callable[[], BaseException | None] | None = None,
    grace: float = CUT_GRACE,
) -> T | None:
    """Await `coro`, but answer within ``timeout + grace + CUT_SETTLE`` seconds
    whatever the broker does: None, or the error `cut()` makes (if it makes one). A
    broker that keeps heartbeats flowing but answers nothing else leaves a round trip
    (connect, channel open, declare, consume, confirm) waiting for ever inside `coro`:
    it is cancelled at ``timeout + grace`` (default :data:`CUT_GRACE`), and if it still
    has not ended ``CUT_SETTLE`` later it is left to finish in the background. A result it produces
    after its caller was answered goes to `undo` (a grant is released), never to the
    caller: a lock is never reported held to someone who was told it was not. What it
    leaves held on a connection that stays silent is freed by the broker when the loss
    watchdog drops that connection."""
    if timeout is None:
        return await coro
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout + grace)
        if not done:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=CUT_SETTLE)
    except asyncio.CancelledError:  # our caller gave up (or close()): so does the wait
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({task}, timeout=CUT_SETTLE)
        _undo_later(task, undo)
        raise
    if not done or task.cancelled():
        log.info("wait cut after %.1fs: the broker answered nothing in time", timeout)
        _undo_later(task, undo)
        error = None if cut is None else cut()
        if error is not None:
            raise error
        return None
    exc = task.exception()
    if exc is not None:
        if task.cancelling():  # what the cut's cancellation raised on its way out
            error = None if cut is None else cut()
            if error is not None:
                raise error from exc
            return None
        raise exc
    return task.result()


async def settled_within(coro: Coroutine[Any, Any, Any], timeout: float) -> None:
    """Run `coro` to its end, shielded from our cancellation, but wait for it `timeout`
    seconds at most: past that it finishes in the background."""
    task = asyncio.ensure_future(coro)
    _keep(task)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if done:
        task.result()  # its error, as an await would raise it


def admin_deadline(mutex_timeout: float | None, timeout: float | None) -> float | None:
    """When an administration call given `timeout` (after `mutex_timeout` for its admin
    mutex) promised to answer, on the monotonic clock; None: no promise."""
    if mutex_timeout is None or timeout is None:
        return None
    return time.monotonic() + mutex_timeout + timeout


async def answered(
    coro: Coroutine[Any, Any, T], timeout: float | None, deadline: float | None, what: str
) -> T:
    """The part of an administration call that runs under its admin mutex (whose wait
    `held_mutex` bounds itself), given its own `timeout`: answered by `deadline` (see
    `admin_deadline`) + 1 s, or :class:`~amqp_locks.errors.BrokerTimeout`. It gets at
    least `timeout` + `CUT_GRACE` - `CUT_SETTLE` (the admin mutex's release, after it, may
    take `CUT_SETTLE`), so a healthy broker's call, whose wait ends at its own deadline
    followed by a few round trips, is never cut. No `timeout`: unbounded."""
    if timeout is None:
        return await coro
    left = timeout if deadline is None else max(timeout, deadline - time.monotonic())
    bound = max(0.0, left - CUT_SETTLE)

    def late() -> BaseException:
        return BrokerTimeout(f"{what}: the broker answered nothing in time")

    result = await within(_boxed(coro), bound, cut=late)
    assert result is not None  # a cut raises
    return result[0]


async def _boxed(coro: Coroutine[Any, Any, T]) -> tuple[T]:
    """`coro`'s result in a box: a None result is not a cut."""
    return (await coro,)


def _undo_later(task: asyncio.Task[T], undo: Callable[[T], Awaitable[Any]] | None) -> None:
    """Keep `task` running; give whatever it produces to `undo`."""
    _keep(task)

    def finished(t: asyncio.Task[T]) -> None:
        if undo is None or t.cancelled() or t.exception() is not None:
            return
        result = t.result()
        if result is not None:
            _keep(asyncio.ensure_future(_quietly(undo(result))))

    task.add_done_callback(finished)
