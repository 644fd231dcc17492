"""The waiting loop shared by every lock that is acquired by trying: wake on a release
notice (push, one waiter per freed slot), re-check on a bounded back-off (crashed holders
publish no notice)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import AmqpLocksError, ClusterUnreachable, ConfigurationError, ConnectionLost
from .transport.broker import BrokerCore
from .transport.errors import channel_error
from .transport.session import Session
from .transport.shield import shielded
from .transport.wakeups import subscribe
from .transport.wire import AMQPError

T = TypeVar("T")

#: Re-check delays after a sentinel whose attempt still found the lock held. The broker
#: hands a dead holder's sentinel on when it closes the holder's channels, which may be a
#: few milliseconds before it deletes the holder's exclusive queue (seen on RabbitMQ
#: 4.0.5): the woken waiter looks again shortly instead of sleeping a whole back-off. A
#: clean release's notice follows its delete, so a failed attempt after one needs none.
SETTLE_DELAYS = (0.005, 0.02, 0.05, 0.15, 0.4)
#: A process that asks again this soon after releasing the same lock lets the waiters go
#: first when there are any (it would win nearly every race: its attempt starts before
#: the woken waiter has even read its notice).
POLITE_WINDOW = 1.0
#: While a notice waits in the wake-up queue for a busy waiter, a polite releaser looks
#: again this often before it subscribes (a passive declare each time; rare: only under
#: contention, within POLITE_WINDOW of its own release).
BACKLOG_POLL = 0.005
#: How long a cluster-mode waiter that reached no node pauses before trying them again.
RECONNECT_PAUSE = 1.0


async def _defer_to_waiters(session: Session, wakeups: str, deadline: float | None) -> bool:
    """We released this lock a moment ago and others wait for it: queue up behind them.

    Our release's wake-up notice tells whether anyone waits: the broker returns it when
    the wake-up queue does not exist (no waiter), so the common case, nobody waiting,
    costs no round trip and never a failing passive declare (each 404 costs the broker a
    channel and two error lines in its log). If the notice found the queue, a passive
    declare confirms a waiter still consumes it, and that no notice still waits for one."""
    released = session.released_at.get(wakeups)
    if released is None or time.monotonic() - released[0] > POLITE_WINDOW:
        return False
    routed = released[1]
    try:
        # The notice's confirm: normally in by now, at most one round trip away.
        waiting = await asyncio.wait_for(asyncio.shield(routed), POLITE_WINDOW)
    except TimeoutError:
        return False
    except asyncio.CancelledError:
        if routed.cancelled():  # the session died and took the notice with it
            return False
        raise
    if not waiting:
        return False
    # A notice still ready waits for a waiter that is busy with an earlier one (prefetch
    # 1; it acks after its attempt): subscribing now would hand it to us, and we would
    # overtake that waiter. So wait until a waiter has taken it, within the window.
    until = released[0] + POLITE_WINDOW
    if deadline is not None:
        until = min(until, deadline)
    try:
        ready, consumers = await session.declare_passive_counts(wakeups)
        while ready and consumers and time.monotonic() + BACKLOG_POLL < until:
            await asyncio.sleep(BACKLOG_POLL)
            ready, consumers = await session.declare_passive_counts(wakeups)
    except AmqpLocksError:
        return False
    return consumers > 0


@dataclass(frozen=True)
class Backoff:
    """Fallback re-checks while waiting, for pushes that never come. A waiter subscribed
    to the lock's wake-ups (the usual case) re-checks every `maximum` seconds; one that
    could not subscribe polls from `initial`, doubling up to `maximum`."""

    initial: float = 0.05
    maximum: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ConfigurationError(
                f"poll back-off needs 0 < initial <= maximum, got {self.initial}, {self.maximum}"
            )


async def pause_for_a_node(exc: ClusterUnreachable, deadline: float | None) -> None:
    """A blocking wait that reached no node of its cluster (each down, or unable to prove
    it is on the majority side yet: a node that cannot create its quorum probe queue while
    a cut node is not yet noticed) tries them again after a pause, until its deadline:
    waiters never fail because a node died. Past the deadline it raises `exc`."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise exc
    await asyncio.sleep(RECONNECT_PAUSE if left is None else min(RECONNECT_PAUSE, left))


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ConfigurationError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return float(timeout)


async def acquire_loop(
    core: BrokerCore,
    wakeups: str,
    sentinels: str | None,
    attempt: Callable[[Session, int | None], Coroutine[Any, Any, T | None]],
    *,
    blocking: bool,
    timeout: float | None,
    backoff: Backoff,
) -> T | None:
    """Call `attempt(session, hint)` until it returns a grant, the timeout passes, or
    (non-blocking) once; `hint` is the slot a wake-up notice announced, if any.

    Waiters subscribe to the lock's wake-up queue *before* re-trying, so a release between
    the failed try and the wait still wakes one of them. A lost connection is re-opened and waiting
    goes on; a broker that stays unreachable raises.
    """
    timeout = check_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    session = await core.session()
    polite = blocking and timeout != 0 and await _defer_to_waiters(session, wakeups, deadline)
    if not polite:
        try:
            granted = await _attempt(attempt(session, None))
        except ConnectionLost:
            # The node died under the attempt; whatever the lost connection held died with
            # it. A blocking wait goes on below, on a new connection (in a cluster, to the
            # next node), through any number of losses; a non-blocking one asks once more.
            if blocking and timeout != 0:
                granted = None
            else:
                granted = await _attempt(attempt(await core.session(), None))
        if granted is not None or not blocking or timeout == 0:
            return granted
    delay = backoff.initial
    settle: list[float] = []
    while True:
        session = await core.session()  # a new one if the last was lost
        async with subscribe(session, wakeups, sentinels) as sub:
            if polite:  # the waiters first: our notice woke one of them
                polite = False
                first = _silent_wait(sub.ready, delay, backoff)
                if deadline is not None:
                    first = min(first, deadline - time.monotonic())
                await sub.wait(max(0.0, first))
            while session.alive:
                wake = sub.take()
                try:
                    granted = await _attempt(attempt(session, wake.hint))
                except ConnectionLost:
                    break  # reconnect and go on waiting
                await sub.answered(wake.tags)
                if granted is not None:
                    return granted
                if wake.sentinel:
                    settle = list(SETTLE_DELAYS)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                step = _silent_wait(sub.ready, delay, backoff)
                step = min(settle.pop(0), step) if settle else step
                wait = step if remaining is None else min(step, remaining)
                woken = await sub.wait(wait)
                if sub.broken:
                    break  # the wake-up queue's node died: subscribe again, then retry
                delay = backoff.initial if woken else min(delay * 2, backoff.maximum)


def _silent_wait(subscribed: bool, delay: float, backoff: Backoff) -> float:
    """How long to wait for a push before trying anyway. A subscribed waiter is woken by
    every clean release (notice) and every crash (sentinel), so its own re-check is the
    last resort, every `backoff.maximum`: a re-check that lands between a release and the
    woken waiter's attempt would take the lock out of turn. Without wake-ups (none could
    be set up) the back-off runs from `backoff.initial`."""
    return backoff.maximum if subscribed else delay


async def _attempt(coro: Coroutine[Any, Any, T | None]) -> T | None:
    """One attempt, run to completion even if the caller is cancelled meanwhile (see
    :mod:`~amqp_locks.transport.shield`); a grant it makes after all is released again.
    A raw AMQP failure that slipped through a step (the connection reset by a dying node)
    becomes its typed error, so the caller's reconnect logic sees a ConnectionLost."""
    try:
        return await shielded(coro, _release)
    except AmqpLocksError:
        raise
    except (AMQPError, ConnectionError) as exc:
        raise channel_error(exc) from exc


async def _release(granted: Any) -> None:
    await granted.release()
