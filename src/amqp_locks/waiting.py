"""The waiting loop shared by every lock that is acquired by trying: wake on a release
notice (push), re-check on a bounded back-off (crashed holders publish no notice)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import ConfigurationError
from .transport.broker import BrokerCore
from .transport.session import Session

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Fallback polling while waiting: starts at `initial`, doubles up to `maximum` seconds."""

    initial: float = 0.05
    maximum: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ConfigurationError(
                f"poll back-off needs 0 < initial <= maximum, got {self.initial}, {self.maximum}"
            )


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ConfigurationError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return float(timeout)


async def acquire_loop(
    core: BrokerCore,
    key: str,
    attempt: Callable[[Session], Awaitable[T | None]],
    *,
    blocking: bool,
    timeout: float | None,
    backoff: Backoff,
) -> T | None:
    """Call `attempt` until it returns a grant, the timeout passes, or (non-blocking) once.

    Waiters bind to the lock's release key *before* re-trying, so a release between the
    failed try and the wait still wakes them. A lost connection is re-opened and waiting
    goes on; a broker that stays unreachable raises.
    """
    timeout = check_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    session = await core.session()
    granted = await attempt(session)
    if granted is not None or not blocking or timeout == 0:
        return granted
    delay = backoff.initial
    while True:
        session = await core.session()
        async with session.notices.subscribe(key) as sub:
            while session.alive:
                sub.clear()
                granted = await attempt(session)
                if granted is not None:
                    return granted
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                wait = delay if remaining is None else min(delay, remaining)
                delay = backoff.initial if await sub.wait(wait) else min(delay * 2, backoff.maximum)
