"""Lock events for observers (metrics, tracing): acquire attempts, releases, losses and
service transitions. Listeners run synchronously wherever the event happens (often the
I/O thread), so they must be quick and must not block; their errors are logged."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("amqp_locks.events")


@dataclass(frozen=True)
class Event:
    #: "acquire" (an acquire call ended), "release", "lost", "state" (a service changed)
    type: str
    #: "slot", "mutex", "permit", or the locker's class name for "state"
    kind: str
    name: str
    #: acquire: seconds the call took; release/lost: seconds the lock was held
    seconds: float = 0.0
    #: acquire: "granted" | "timeout" | "error"; lost: the reason; state: the new state
    detail: str = ""


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
    """Await an acquire and emit its "acquire" event (granted, timeout or error)."""
    start = time.monotonic()
    outcome = "error"
    try:
        result = await acquire
        outcome = "granted" if result is not None else "timeout"
        return result
    finally:
        if _listeners:
            emit(Event("acquire", kind, name, time.monotonic() - start, outcome))
