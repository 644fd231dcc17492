"""Leases: what an acquire returns, and how a holder learns it lost its lock.

:class:`Lease` is the sync facade over a held lock's state (held.py, on the I/O loop);
`amqp_locks.aio.Lease` is the asyncio one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .held import HeldState

LostCallback = Callable[["Lease"], Any]


class Lease:
    """A held slot or mutex. Use as a context manager, or call :meth:`release`.

    ``number`` is the slot (1-based; 1 for a mutex), ``fencing_token`` rises strictly with
    every grant of the lock and must be passed to protected resources, ``lost`` is set the
    moment the lease is known to be lost.
    """

    def __init__(self, state: HeldState) -> None:
        self._state = state

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def number(self) -> int:
        return self._state.number

    @property
    def fencing_token(self) -> int:
        return self._state.fencing_token

    @property
    def lost(self) -> threading.Event:
        return self._state.lost_event

    @property
    def lost_reason(self) -> str | None:
        return self._state.lost_reason

    @property
    def released(self) -> bool:
        return self._state.released

    @property
    def held(self) -> bool:
        """Neither released nor known lost (no round trip; see :meth:`verify`)."""
        return not self._state.released and self._state.lost_reason is None

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease)`` once if the lease is lost (at once if it already is).

        Callbacks run on a helper thread; they are not called after a clean release.
        """
        self._state.add_callback(lambda: callback(self))

    def verify(self) -> bool:
        """Ask the broker whether the lease still holds (one round trip)."""
        self._state.check_process()
        return self._state.core.run(self._state.verify())

    def release(self, wait: bool = False) -> None:
        """Give the lock back. Idempotent; safe after the lease was lost, and after its
        Broker was closed (the close released it).

        By default it returns once the release is handed to the connection (for the token
        semaphore, the read-write lock and cluster mode, before the broker answers): the
        broker completes it, and ``Broker.close()`` waits for releases in flight. With
        ``wait=True`` it returns only once the broker has confirmed the release, and
        raises :class:`~amqp_locks.errors.ReleaseUnconfirmed` when the connection failed
        first; use it before telling another process the lock is free.

        Raises :class:`~amqp_locks.errors.WrongProcess` in a fork child of the holder."""
        self._state.check_process()
        self._state.core.release(self._state, wait)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving the block waits for the broker to confirm the release (bounded: see
        :meth:`BrokerCore.release_leaving`), so whatever the process does next, such as
        telling another that the lock is free, happens after it."""
        self._state.check_process()
        self._state.core.release_leaving(self._state)

    def __repr__(self) -> str:
        s = self._state
        state = "released" if s.released else ("lost" if s.lost_reason else "held")
        return f"<Lease {s.kind} {s.number} of {s.name!r} token={s.fencing_token} {state}>"
