"""Reading a persistent semaphore's slots: how many there are and which are held.

Slot k exists while `A[k]` routes (and, for quorum slots, has no tombstone) and is held
while `B[k]` does; both are probed in *pipelined* windows (one round trip per window,
windows doubling from the size last seen; burial.py's look) by the client's search
(client.py), the administration (admin.py) and the status read.
In cluster mode the slots are tokens of ``N.slots`` (cluster.py) and are read as such.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..holders import Reading
from ..names import holder_queue, slots_name
from ..records import LockStatus
from ..tokens.ledger import read_token_as
from ..transport.broker import BrokerCore
from ..transport.session import Session
from .burial import look

FIRST_WINDOW = 8
MAX_WINDOW = 2048


def windows(first: int = FIRST_WINDOW) -> Iterator[range]:
    """Slot ranges probed per round trip: [1..first], then windows doubling in size.

    Doubling keeps the probes sent past the semaphore's end below the number needed
    (a window of 8x growth probed 4,680 slots to find the end of a 1,000-slot semaphore).
    ``first`` comes from the session's hint of the semaphore's size, so a client that has
    seen the semaphore before covers it in one round trip.
    """
    start, size = 1, max(1, min(first, MAX_WINDOW))
    while True:
        yield range(start, start + size)
        start += size
        size = min(size * 2, MAX_WINDOW)


def first_window(session: Session, name: str) -> int:
    """Probe up to one past the last size seen (so the end shows in the same round trip)."""
    hint = session.size_hints.get(name)
    return FIRST_WINDOW if hint is None else max(FIRST_WINDOW, hint + 1)


async def find_max(session: Session, name: str) -> int:
    """The highest k such that slots 1..k all exist (0: no semaphore)."""
    return (await survey(session, name))[0]


async def survey(session: Session, name: str) -> tuple[int, tuple[int, ...], bool]:
    """(C, the slots with a tombstone among those looked at, whether the slots are quorum
    queues): C is the highest k such that slots 1..k all exist."""
    buried: list[int] = []
    for window in windows(first_window(session, name)):
        seen = await look(session, name, list(window), holders=False)
        buried.extend(seen.buried)
        for k, alive in zip(seen.ks, seen.alive, strict=True):
            if not alive:
                session.size_hints[name] = k - 1
                return k - 1, tuple(buried), seen.quorum
    raise AssertionError("unreachable")  # pragma: no cover


async def held_slots(session: Session, name: str, upto: int) -> list[int]:
    """Slot numbers in 1..upto whose `B` queue exists."""
    return await held_slots_among(session, name, range(1, upto + 1))


async def held_slots_among(session: Session, name: str, ks: Sequence[int]) -> list[int]:
    found = await session.probe([holder_queue(name, k) for k in ks])
    return [k for k, exists in zip(ks, found, strict=True) if exists]


async def read_semaphore(core: BrokerCore, name: str) -> Reading | None:
    """Semaphore `name` as a lock status: slots and the held ones (None: no slots)."""
    if core.cluster:
        return await read_token_as(core, name, "semaphore", slots_name(name))
    session = await core.session()
    slots = await find_max(session, name)
    if not slots:
        return None
    held = await held_slots(session, name, slots)
    return Reading(LockStatus(name, "semaphore", slots, len(held), slots - len(held), tuple(held)))
