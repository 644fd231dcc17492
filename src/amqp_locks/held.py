"""What every held lock shares: identity, the fencing token, loss reporting, release.

Each lock kind holds its lock its own way (queue_lease.py: an exclusive queue;
tokens/permit.py: an unacked token; rwlock/protocol.py: reader tokens and the turn) in a
subclass of :class:`HeldState`, on the I/O loop. Whatever ends a hold (connection loss,
missed heartbeats, the broker cancelling a consumer, a failed verify) calls
:meth:`HeldState.lose`: ``lease.lost`` is set and ``on_lost`` callbacks run (on a separate
thread, so a slow callback never stalls heartbeats). lease.py is the sync facade over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import events
from .errors import ReleaseUnconfirmed, WrongProcess
from .transport.channel_ops import release_barrier as release_barrier

if TYPE_CHECKING:
    from .transport.broker import BrokerCore
    from .transport.session import Session

log = logging.getLogger("amqp_locks.lease")


@dataclass(eq=False, kw_only=True)
class HeldState:
    """What every held lock shares: identity, the fencing token, and loss reporting.

    Subclasses say how the lock is held (:class:`LeaseState`: an exclusive queue;
    `tokens.PermitState`: an unacked token message) and implement ``verify``/``release``.
    """

    core: BrokerCore
    session: Session
    kind: str  # "mutex" | "semaphore" | "token" (status.Kind)
    name: str
    number: int
    fencing_token: int = 0
    acquired_at: float = field(default_factory=time.monotonic)
    #: The process the lock was granted to (a fork child does not hold it).
    pid: int = field(default_factory=os.getpid)
    lost_event: threading.Event = field(default_factory=threading.Event)
    lost_reason: str | None = None
    released: bool = False
    _callbacks: list[Callable[[], Any]] = field(default_factory=list)
    _cb_lock: threading.Lock = field(default_factory=threading.Lock)
    _listener: int = -1
    async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(
        default_factory=list
    )
    #: ``release(wait=True)`` asked for the broker's word: a kind whose release only writes
    #: (a token's reject) then ends it with one round trip on the same channel
    #: (:func:`release_barrier`); the default release stays a write.
    confirm_wanted: bool = False
    #: What the release left running after ``release()`` returned (a token's give-back,
    #: spawned so the caller does not wait for it): ``release(wait=True)`` and
    #: ``Broker.close()`` wait for it.
    release_job: asyncio.Future[Any] | None = None
    #: Why the release could not be confirmed (the connection, or the channel holding the
    #: lock, failed first); None while it could be, or was.
    release_failure: str | None = None

    def _on_session_lost(self, reason: str) -> None:
        self.lose(reason)

    def quorum_queues(self) -> tuple[str, ...]:
        """The queues whose unacked messages are this hold (cluster mode's quorum guard
        checks each one's leader: transport/quorum_guard.py); none for an exclusive-queue
        lease."""
        return ()

    def lose(self, reason: str) -> None:
        """Mark the lock lost (idempotent; ignored once released). Runs on the I/O loop."""
        if self.released or self.lost_reason is not None:
            return
        self.lost_reason = reason
        self.lost_event.set()
        held = time.monotonic() - self.acquired_at
        events.emit(events.Event("lost", self.kind, self.name, held, reason, source=self))
        log.warning(
            "lost %s %d of %r (token %d) after %.3fs: %s",
            self.kind,
            self.number,
            self.name,
            self.fencing_token,
            held,
            reason,
        )
        for loop, event in self.async_waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)
        with self._cb_lock:
            callbacks = list(self._callbacks)
        if callbacks:
            threading.Thread(
                target=_run_callbacks, args=(callbacks,), name="amqp-locks-on-lost", daemon=True
            ).start()

    def check_process(self) -> None:
        """Refuse to act for a process that does not hold the lock (a fork child)."""
        if os.getpid() != self.pid:
            raise WrongProcess(
                f"{self.kind} {self.number} of {self.name!r} was granted to process {self.pid},"
                f" not to this one ({os.getpid()}): a forked child never holds its parent's"
                " locks; acquire them again in the child"
            )

    def add_callback(self, cb: Callable[[], Any]) -> None:
        with self._cb_lock:
            if self.lost_reason is None:
                self._callbacks.append(cb)
                return
        _run_callbacks([cb])

    def begin_release(self) -> bool:
        """The first steps of every release (False: it was released already): mark it
        released, say so, and stop hearing of loss (the session forgets the lock)."""
        if self.released:
            return False
        self.released = True
        self._emit_release()
        self.session.remove_listener(self._listener)
        self.session.leases.discard(self)
        return True

    def _emit_release(self) -> None:
        """A release of a lock not already counted as lost (observers count each once)."""
        if self.lost_reason is None:
            held = time.monotonic() - self.acquired_at
            events.emit(events.Event("release", self.kind, self.name, held, source=self))

    async def verify(self) -> bool:
        raise NotImplementedError

    async def release(self) -> None:
        """Give the lock back: returns once the release is written to the connection (or,
        for kinds that need one round trip anyway, answered); the broker completes it.
        Whatever is left running goes in :attr:`release_job`."""
        raise NotImplementedError

    async def settled(self) -> None:
        """Wait for what the release left running (:attr:`release_job`), if anything."""
        job = self.release_job
        if job is not None and not job.done():
            await asyncio.shield(job)

    async def release_confirmed(self) -> None:
        """``release(wait=True)``: release, then return once the broker has confirmed it;
        raise :class:`ReleaseUnconfirmed` when it could not. What counts as the broker's
        word: the held queue's delete-ok (mutex, persistent semaphore), the commit-ok of a
        token's transaction (fencing on), else the answer to a method sent after the
        release on the channel that held the lock (:func:`release_barrier`). On a quorum
        queue none of these waits for the queue to apply the token's return (a Raft
        command, applied a commit later): another client's read can lag by that commit
        (docs/operations.md, "Releasing and closing").

        Called again after a plain ``release()``, it waits for that release's work and
        reports its failure, but adds no round trip."""
        if not self.released:
            self.confirm_wanted = True
        await self.release()
        await self.settled()
        if self.release_failure is not None:
            raise ReleaseUnconfirmed(
                f"release of {self.kind} {self.number} of {self.name!r} not confirmed: "
                f"{self.release_failure}; the broker frees it when it sees the connection end"
            )


def _run_callbacks(callbacks: list[Callable[[], Any]]) -> None:
    for cb in callbacks:
        try:
            cb()
        except Exception:
            log.exception("on_lost callback %r failed", cb)
