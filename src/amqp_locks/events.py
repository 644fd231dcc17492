"""Lock events for observers (metrics, tracing): acquire calls, releases, losses,
connections and service transitions. Listeners run synchronously wherever the event
happens (often the I/O thread), so they must be quick and must not block; their errors are
logged.

Event types (`Event.type`), with what `kind`, `name`, `seconds` and `detail` hold:

========================  =====================  ============================================
type                      kind / name            seconds / detail
========================  =====================  ============================================
``"acquiring"``           lock kind / lock name  - / - : an acquire call started (it waits
                                                 until the matching ``"acquire"``)
``"acquire"``             lock kind / lock name  duration of the call / ``"granted"``,
                                                 ``"timeout"`` or ``"error"``
``"release"``             lock kind / lock name  how long it was held / -
``"lost"``                lock kind / lock name  how long it was held / the reason
``"state"``               locker class / name    - / the service's new state (``"standby"``,
                                                 ``"master"``, ``"stopped"``)
``"demoted"``             locker class / name    - / - : a master's keep-alive failed and it
                                                 went back to standby
``"keep_alive"``          locker class / name    duration / ``"ok"``, ``"failed"`` (the
                                                 locker said False), ``"error"`` (it raised)
                                                 or ``"timeout"`` (no answer in time)
``"connection"``          ``"broker"`` /         - / ``"up"`` (first connection),
                          connection name        ``"reconnected"`` (a new connection after
                                                 a loss), ``"down"`` (lost or closed;
                                                 `detail` is then ``"down: <reason>"``)
========================  =====================  ============================================

Lock kinds are ``"mutex"``, ``"semaphore"`` (persistent semaphore), ``"token"`` (token
semaphore) and ``"rwlock"`` (read and write holds of a read-write lock): the same words as
:data:`amqp_locks.status.Kind`, the CLI's ``--kind`` and ``AMQP_LOCKS_KIND``.
Every ``"acquiring"`` is followed by exactly one ``"acquire"``; a listener that subscribes
in between sees the ``"acquire"`` alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("amqp_locks.events")


@dataclass(frozen=True)
class Event:
    #: see the table above
    type: str
    #: "mutex", "semaphore", "token"; the locker's class name for service events; "broker"
    kind: str
    name: str
    #: acquire: seconds the call took; release/lost: seconds the lock was held;
    #: keep_alive: seconds the keep-alive took
    seconds: float = 0.0
    #: acquire: "granted" | "timeout" | "error"; lost: the reason; state: the new state;
    #: keep_alive: "ok" | "failed" | "error" | "timeout"; connection: "up" | "reconnected"
    #: | "down: <reason>"
    detail: str = ""
    #: release/lost: the held lock's state (``amqp_locks.held.HeldState``), so a tracer
    #: can end the span of that very hold (several holds can share a kind and name)
    source: Any = field(default=None, repr=False, compare=False)


Listener = Callable[[Event], None]
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> Callable[[], None]:
    """Call `listener(event)` for every event; returns a function that unsubscribes."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def emit(event: Event) -> None:
    for listener in list(_listeners):
        try:
            listener(event)
        except Exception:
            log.exception("event listener %r failed", listener)


async def observed(kind: str, name: str, acquire: Awaitable[T | None]) -> T | None:
    """Await an acquire between its "acquiring" and "acquire" events (granted, timeout
    or error)."""
    start = time.monotonic()
    outcome = "error"
    if _listeners:
        emit(Event("acquiring", kind, name))
    try:
        result = await acquire
        outcome = "granted" if result is not None else "timeout"
        return result
    finally:
        if _listeners:
            emit(Event("acquire", kind, name, time.monotonic() - start, outcome))


def connection(session: Any, name: str, reconnected: bool) -> Event:
    """The "connection" event of a new broker connection (`session`, a transport
    Session); its "down" event follows when that connection ends, whoever listens then.
    Emitted by the Broker: ``emit(connection(session, name, reconnected))``."""
    session.add_listener(
        lambda reason: emit(Event("connection", "broker", name, 0.0, f"down: {reason}"))
    )
    return Event("connection", "broker", name, 0.0, "reconnected" if reconnected else "up")


def keep_alive(locker: Any, started: float, result: bool | BaseException | None) -> Event:
    """The "keep_alive" event of a LockableService's check of `locker`, begun at
    `started` (monotonic): `result` is the keep-alive's answer, the exception it raised
    (a `KeepAliveTimeout` when it did not answer in time), or None (no answer before the
    lease ran out)."""
    if result is True:
        outcome = "ok"
    elif result is False:
        outcome = "failed"
    elif result is None or type(result).__name__ == "KeepAliveTimeout":
        outcome = "timeout"
    else:
        outcome = "error"
    seconds = time.monotonic() - started
    return Event("keep_alive", type(locker).__name__, locker.name, seconds, outcome)
