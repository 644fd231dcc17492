"""Quorum slots are buried before they are deleted, and looked at so that no client touches
one while it goes.

RabbitMQ closes a client's whole connection, every lease on it lost, when the client
publishes to (a probe) or consumes from (a holder's watch) a quorum queue that is being
deleted: 3.10.8 with 541 (``case_clause`` registering the publish's enqueuer), 4.3.6 with
541 "failed consuming from quorum queue ...: noproc" (``python -m benchmarks.slot_churn
--quorum``). Classic queues are touched safely while they go on 3.10 and 4.0; on 4.2+ a
publish that meets any queue in the instant of its delete can close the connection too
(docs/protocol.md, "Known gaps"), which tombstones make rare for slots. So a semaphore whose
slots are quorum queues (``SemaphoreAdmin(..., quorum=True)``) removes slot k in three
steps, as the fence generations do (fencing.py):

1. declare `T[k]` (``N-0k-A``, a classic queue that holds nothing): slot k now counts as
   missing for every look;
2. wait :data:`BURY_GRACE`;
3. delete `A[k]`, then `T[k]`.

Such a semaphore also has a marker `M` (``N-0-A``, classic), declared before its first
slot and deleted after its last. A client looks at slots with :func:`look`:

- a connection's first look at a name asks `M` alone (one round trip); every later look
  asks it again in its own first write, so a change of kind is seen there;
- classic slots: `M`, `A[ks]` and `B[ks]` in one write, as the seed probes them;
- quorum slots: `M` and `T[ks]` first, then `A` of the slots below the first tombstone
  (a slot above a missing one is past the semaphore's end anyway) and `B[ks]`. A slot
  with no tombstone is not deleted for BURY_GRACE;
- a holder's consume on `A[k]` follows its look within :data:`LOOK_FRESH` (< BURY_GRACE),
  else it looks again (:func:`still_there`); ``verify()`` asks `T[k]` before `A[k]`.

An administration action that finds tombstones left by a cut removal finishes it (or,
adding slots, takes them back); semaphore/admin.py. Residual risk, stated in
docs/protocol.md: a connection that saw classic slots under a name, idle while the name was
destroyed and made again with quorum slots, probes `A` directly in its first look after
(that look sees `M`); a delete running at that instant closes it. So does a client paused
for longer than BURY_GRACE - LOOK_FRESH between its look and its consume.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..names import holder_queue, quorum_marker, slot_queue, slot_tombstone
from ..transport.session import Session

#: Seconds between a quorum slot's tombstone and its delete.
BURY_GRACE = 10.0
#: Longest time from a client's look to its consume on the slot it found (< BURY_GRACE).
LOOK_FRESH = 5.0
#: Tombstones and the marker exist and hold nothing (probes vanish).
TOMBSTONE_ARGS: dict[str, Any] = {"x-max-length": 0}


@dataclass(frozen=True)
class Look:
    """What one look found for slots `ks`."""

    ks: tuple[int, ...]
    #: `A[k]` exists and has no tombstone (False above the first tombstone).
    alive: tuple[bool, ...]
    #: `B[k]` exists (all False when holders were not asked).
    held: tuple[bool, ...]
    #: Slots with a tombstone (being removed), among those asked.
    buried: tuple[int, ...]
    #: The slots are quorum queues (the marker exists).
    quorum: bool
    #: When the look's first write was sent (monotonic): the tombstones were absent then.
    at: float

    def fresh(self) -> bool:
        """Whether a consume sent now may rely on this look's tombstones being absent."""
        return not self.quorum or time.monotonic() - self.at < LOOK_FRESH


async def look(session: Session, name: str, ks: Sequence[int], *, holders: bool) -> Look:
    """Which of slots `ks` exist (`A` routes, no tombstone), and with `holders` which are
    held, touching a quorum `A` only when its tombstone was absent a round trip before."""
    marker = quorum_marker(name)
    quorum = session.quorum_slots.get(name)
    if quorum is None:  # first look on this connection: which kind, before touching A
        quorum = (await session.probe([marker]))[0]
    ks = tuple(ks)
    bs = [holder_queue(name, k) for k in ks] if holders else []
    at = time.monotonic()
    if not quorum:
        found = await session.probe([marker] + [slot_queue(name, k) for k in ks] + bs)
        session.quorum_slots[name] = found[0]
        if not found[0]:
            n = len(ks)
            held = tuple(found[1 + n :]) if holders else (False,) * n
            return Look(ks, tuple(found[1 : 1 + n]), held, (), False, at)
        # Made again with quorum slots since this connection last looked: look properly.
        at = time.monotonic()
    found = await session.probe([marker] + [slot_tombstone(name, k) for k in ks])
    session.quorum_slots[name] = found[0]
    n = len(ks)
    graves = found[1:]
    buried = tuple(k for k, t in zip(ks, graves, strict=True) if t)
    below = ks if True not in graves else ks[: graves.index(True)]
    # The holders are asked with the slots, a round trip later than the tombstones: an
    # older answer would send more claims into a declare race.
    routes = await session.probe([slot_queue(name, k) for k in below] + bs)
    m = len(below)
    alive = tuple(routes[:m]) + (False,) * (n - m)
    held = tuple(routes[m:]) if holders else (False,) * n
    return Look(ks, alive, held, buried, found[0], at)


async def still_there(session: Session, name: str, k: int, seen: Look) -> bool:
    """Before consuming on `A[k]`: whether slot k still exists, looked at again when
    `seen` is too old for the consume to rely on (:data:`LOOK_FRESH`)."""
    if seen.fresh():
        return True
    again = await look(session, name, [k], holders=False)
    return again.alive[0]
