"""AMQP locker: the exclusive-queue mutex as a locker (master/standby over RabbitMQ).

A standby waits *pushed*, not polled: `start()` keeps one `Mutex.acquire_later()` wait
for as long as it stands by (woken by the mutex's release notices; the mutex re-checks at
most every `lock_acquire_sleep_interval`, since a crashed master publishes nothing), and
looks for `stop()` every second meanwhile.
The keep-alive is the lease not being lost, plus `verify()` (one round trip).

A standby rides out a broker it cannot reach (a restart, a network fault) and keeps
trying, like the database lockers; only a broker never reached at all is reported
(`BrokerUnreachable` from `start()`: a wrong URL should not look like a long wait).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from ..errors import BrokerUnreachable, ConnectionLost
from ..lease import Lease
from ..mutex import Mutex
from ..transport.broker import BrokerLike
from ..waiting import Backoff
from .base import Locker

log = logging.getLogger("amqp_locks.lockers")


class AmqpLocker(Locker):
    def __init__(self, broker: BrokerLike, name: str, **options: object) -> None:
        super().__init__(name, **options)  # type: ignore[arg-type]
        # A crashed master publishes no notice: re-check at most every interval (<= 1 s).
        poll = min(1.0, self.lock_acquire_sleep_interval)
        self._mutex = Mutex(broker, name, backoff=Backoff(min(0.05, poll), poll))
        self._core = broker.core
        self._lease: Lease | None = None
        self._reached = False  # whether an attempt ever got an answer from the broker
        #: The standby's one wait, kept across attempts (:meth:`_granted`).
        self._pending: concurrent.futures.Future[Lease | None] | None = None

    def _try_acquire(self) -> bool:
        # A standby waits (pushed) up to a second per call, so `stop()` is noticed within a
        # second; with `fail_if_locked` one non-blocking attempt.
        try:
            if not self._reached:
                # The first contact gets the Broker's own connect timeout, not the 1 s
                # slice below: a node slow to accept (one side of a cluster mid-partition,
                # measured on 4.3.6: over 1 s) is not a wrong URL.
                self._core.run(self._core.session())
                self._reached = True
            if self.fail_if_locked:
                # The broker's own answer: None only when it says the lock is held. A
                # timed attempt read a busy broker as a holder (rehearsal 114, 4.3.6 with
                # 2 CPU burners: a 0.2 s attempt right after the holder's release had
                # returned raised LockedElsewhere).
                self._lease = self._mutex.acquire(blocking=False)
            else:
                self._lease = self._granted(min(1.0, self.lock_acquire_sleep_interval))
        except (BrokerUnreachable, ConnectionLost) as exc:
            if self.fail_if_locked or (isinstance(exc, BrokerUnreachable) and not self._reached):
                # Never reached the broker (a wrong URL or a missing broker), or nobody
                # stands by to ride it out: say so, rather than "held elsewhere".
                raise
            # A broker restart or a network fault: a standby waits it out, as the database
            # lockers do.
            log.warning("%r: broker unavailable while standing by: %s", self, exc)
            self._stopping.wait(self.lock_acquire_sleep_interval)
            return False
        if self._lease is None:
            return False
        self.fencing_token = self._lease.fencing_token
        # Missed heartbeats or a closed connection mark the lease lost: tell the service at
        # once rather than at its next keep-alive.
        self._lease.on_lost(lambda _lease: self._alarm())
        return True

    def _granted(self, seconds: float) -> Lease | None:
        """The lease of the standby's one wait, if it ended within `seconds`; a new wait
        starts only when the last one ended without a grant. One wait rather than an
        acquire per second: in cluster mode each acquire registers and cancels a quorum
        consumer (two Raft commands), and a cut cluster answered neither for tens of
        seconds (4.3.6 partition matrix: a standby of 1 s acquires, each cut and left
        behind, was never granted within 70 s after a silent cut; one long wait is)."""
        if self._pending is None:
            self._pending = self._mutex.acquire_later()
        try:
            lease = self._pending.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            return None
        except BaseException:
            self._pending = None
            raise
        self._pending = None
        return lease

    def _give_up_wait(self) -> None:
        """End the standby's wait (stop, interrupt, start() left): a grant that came
        meanwhile is given back."""
        pending, self._pending = self._pending, None
        if pending is None or pending.cancel():
            return
        try:
            lease = pending.result()
        except BaseException:  # the wait had failed: nothing is held
            return
        if lease is not None:
            lease.release()

    def start(self, stop: threading.Event | None = None) -> None:
        try:
            super().start(stop)
        finally:
            self._give_up_wait()

    def _pause(self) -> None:
        """No sleep between attempts: each attempt already waited, woken by push."""

    def default_keep_alive_timeout(self, period: float) -> float | None:
        """None: the keep-alive cannot outlive the broker's loss timeout — missed heartbeats
        end the connection and fail the call — so a partition shorter than that is ridden
        out rather than cut short at one keep-alive period."""
        return None

    def _keep_alive(self) -> bool:
        lease = self._lease
        return lease is not None and not lease.lost.is_set() and lease.verify()

    def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    @property
    def lease(self) -> Lease | None:
        return self._lease

    def __repr__(self) -> str:
        return f"AmqpLocker({self.name!r})"
