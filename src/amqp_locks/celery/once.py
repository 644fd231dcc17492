"""Enqueue-time deduplication (``once=True``): at most one call of a key queued or
running, with every state change made through the public lock API.

Each key has a *ticket*: a token semaphore of one permit (``<lock>.once``). Its state is
the key's state:

========  =====================================================================
free      the ticket is in its queue, ready
queued    the ticket was taken out of circulation (``remove_permits``) by the
          producer that enqueued the task: durable broker state, no holder
running   the worker holds the ticket as a permit: freed by the broker when the
          worker releases it *or its connection dies* (a killed worker)
========  =====================================================================

A producer claims the key by taking the ticket (a non-blocking acquire) and removing it
from circulation; finding none ready, the key is queued or running (``AlreadyQueued``).
The worker puts the ticket back and takes it as a permit before the task runs. Those two
steps, and the producer's claim, run under a *guard* mutex per key (``<lock>.once-guard``)
so no producer can take the ticket back between them, and two workers never both put one
back (the count stays one). A revoked task's ticket is put back by the worker that
discards it; a retry keeps the key queued (the ticket is released and removed again
under the guard).

Nobody waits for the guard while holding the ticket: whoever holds the guard may be
waiting for that very ticket (a claim or a retry's hand-over removing it, a worker taking
it). A producer holding the ticket therefore only *tries* the guard, and finding it held
(the key is being claimed, started or handed over) gives the ticket back at once and is
refused; a worker takes the guard before the ticket.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import TokenSemaphoreNotFound
from ..lease import Lease
from ..mutex import Mutex
from ..tokens import TokenSemaphore
from ..transport import Broker

log = logging.getLogger("amqp_locks.celery")

#: How long the guard is waited for (it is held for a few round trips at a time).
GUARD_TIMEOUT = 30.0
#: How long a claim or a retry's hand-over waits for the ticket it just released to come
#: back to be removed (milliseconds: a producer that took it meanwhile gives it back at
#: once; longer only when a second copy of the task, sent around the dedup, waits for it).
HANDOVER_WAIT = 5.0
#: How long a starting worker, holding the guard, waits for the ticket it put back: a
#: producer that took it meanwhile gives it back within a few round trips; a second copy
#: of the task running holds it longer.
START_WAIT = 2.0


class Ticket:
    """The ticket semaphore and guard mutex of one key, on one Broker."""

    def __init__(self, broker: Broker, name: str, quorum: bool | None) -> None:
        self.name = name
        self.semaphore = TokenSemaphore(broker, f"{name}.once", quorum=quorum, fencing=True)
        self.guard = Mutex(broker, f"{name}.once-guard", fencing=False, timeout=GUARD_TIMEOUT)
        self._ready = False

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """Hold the key's guard; set the ticket semaphore up (one permit) on first use.

        Every read or write of the ticket semaphore's ledger (``status``, ``setup``,
        ``add_permits``, ``remove_permits``) happens under the guard: a ledger read holds
        the ledger's message for a moment, and a second reader at that moment would
        find no ledger at all."""
        with self.guard:
            if not self._ready:
                try:
                    self.semaphore.status()
                except TokenSemaphoreNotFound:
                    self.semaphore.setup(1)
                self._ready = True
            yield

    def claim(self) -> bool:
        """Free -> queued: True if this producer took the ticket out of circulation.

        The first step reads no ledger and takes no guard: a non-blocking acquire of the
        ticket, None at once when it is out (queued) or held (running), which is what
        every refused enqueue costs. Holding it, the producer tries the guard without
        waiting: held, someone is claiming, starting or handing over the key and may be
        waiting for this ticket, so it goes back at once and the claim is refused. Got
        it, the producer releases the ticket and removes it under the guard, where no
        other producer or starting worker can come between."""
        try:
            lease = self.semaphore.acquire(blocking=False)
        except TokenSemaphoreNotFound:
            with self.guarded():  # first use of the key: set up, then as usual
                pass
            lease = self.semaphore.acquire(blocking=False)
        if lease is None:
            return False
        try:
            guard = self.guard.acquire(blocking=False)
        except BaseException:
            lease.release()
            raise
        if guard is None:
            lease.release()
            return False
        try:
            lease.release(wait=True)
            return bool(self.semaphore.remove_permits(1, timeout=HANDOVER_WAIT))
        finally:
            guard.release()

    def restore(self) -> bool:
        """Put the ticket back if it is out of circulation (queued): True if it was.
        Caller holds the guard."""
        if self.semaphore.status().permits == 0:
            self.semaphore.add_permits(1)
            return True
        return False

    def unclaim(self) -> None:
        """Undo a claim (the task could not be sent, or was revoked while queued)."""
        with self.guarded():
            self.restore()

    def start(self) -> Lease | None:
        """Queued -> running: put the ticket back and hold it, in one guarded step. A
        producer may take the ticket for a moment (it then finds the guard held and gives
        it back), hence a short wait; None when another holder keeps it (a second copy of
        the task is running)."""
        with self.guarded():
            self.restore()
            return self.semaphore.acquire(timeout=START_WAIT)

    def wait(self, timeout: float | None) -> Lease | None:
        """Wait for the ticket (a copy of the task is running)."""
        return self.semaphore.acquire(timeout=timeout)

    def hand_over(self, lease: Lease) -> None:
        """Running -> queued (a retry was sent): release the ticket and take it out of
        circulation again, under the guard so no producer claims it in between."""
        with self.guarded():
            lease.release(wait=True)
            if not self.semaphore.remove_permits(1, timeout=HANDOVER_WAIT):
                log.warning(
                    "%s: the retry's ticket was not back within %.0f s; the key is free "
                    "while the retry is queued",
                    self.name,
                    HANDOVER_WAIT,
                )


class Tickets:
    """Ticket objects per (Broker, key), kept so a key's setup is checked once per process."""

    def __init__(self, size: int = 1024) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[int, str], Ticket] = OrderedDict()

    def get(self, broker: Broker, name: str, quorum: bool | None) -> Ticket:
        key = (id(broker), name)
        with self._lock:
            ticket = self._items.get(key)
            if ticket is None or ticket.semaphore.broker is not broker:
                ticket = self._items[key] = Ticket(broker, name, quorum)
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
            return ticket


__all__ = ["Ticket", "Tickets"]
