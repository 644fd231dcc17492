"""Read-only status of named locks: what each name is, how much of it is held, by whom.

What ``amqp-locks status`` shows, as a public API. Reads take no administration mutex
(one passive declare or pipelined probe per queue), so they can be polled without
disturbing holders or administrators. AMQP cannot list queues: names must be given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .errors import QueueNotFound, ResourceLocked, TokenSemaphoreNotFound
from .names import token_queue, validate_name
from .rwlock import read_status as read_rwlock_status
from .semaphore.admin import find_max, held_slots
from .tokens import read_status
from .transport.broker import BrokerCore, BrokerLike
from .transport.session import Session

Kind = Literal["semaphore", "token", "rwlock", "mutex", "absent"]


@dataclass(frozen=True)
class LockStatus:
    """One lock named `name`. ``capacity``: slots, permits, or 1 for a mutex; ``held``:
    how many are held now; ``free``: free slots, ready tokens, or 1 for a free mutex;
    ``holders``: held slot numbers (persistent semaphore); ``consumers`` / ``waiting``: the
    token queue's consumers and those waiting for a token (token semaphore). A read-write
    lock: ``capacity`` reader tokens, ``held`` of them out (all while a writer holds),
    ``consumers`` of the tokens, ``waiting`` writers waiting for the turn."""

    name: str
    kind: Kind
    capacity: int
    held: int
    free: int
    holders: tuple[int, ...] = field(default_factory=tuple)
    consumers: int | None = None
    waiting: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["holders"] = list(self.holders)
        return out


async def mutex_held(session: Session, name: str) -> bool | None:
    """True: the exclusive queue `name` is held by a connection; False: it exists unheld
    (a queue that is not a mutex); None: no such queue (the mutex is free)."""
    if name in session.held:  # held through this very connection (the declare would pass)
        return True
    try:
        await session.call(name, lambda ch: ch.queue_declare(name, passive=True))
    except ResourceLocked:
        return True
    except QueueNotFound:
        return None
    return False


ALL_KINDS: tuple[Kind, ...] = ("semaphore", "token", "rwlock", "mutex")


async def read_lock_status(
    core: BrokerCore, name: str, kinds: Sequence[Kind] = ALL_KINDS
) -> list[LockStatus]:
    """Every kind of lock named `name` that exists, among `kinds` (one name may be
    several: a semaphore and its administration mutex share it), or one ``absent`` entry."""
    name = validate_name(name)
    session = await core.session()
    found: list[LockStatus] = []
    slots = await find_max(session, name) if "semaphore" in kinds else 0
    if slots:
        holders = await held_slots(session, name, slots)
        found.append(
            LockStatus(name, "semaphore", slots, len(holders), slots - len(holders), tuple(holders))
        )
    if "token" in kinds and await session.exists_passive(token_queue(name)):
        try:
            st = await read_status(session, name)
        except TokenSemaphoreNotFound:
            pass
        else:
            found.append(
                LockStatus(
                    name, "token", st.permits, st.held, st.ready, (), st.consumers, st.waiting
                )
            )
    rw = await read_rwlock_status(session, name) if "rwlock" in kinds else None
    if rw is not None:
        found.append(
            LockStatus(
                name, "rwlock", rw.readers, rw.held, rw.free, (), rw.consumers, rw.writers_waiting
            )
        )
    mutex = await mutex_held(session, name) if "mutex" in kinds else None
    if mutex or not found:
        # Queue `name` is a mutex, or the admin mutex of the semaphore `name` (busy admin).
        if mutex is None:
            found.append(LockStatus(name, "absent", 0, 0, 0))
        else:
            found.append(LockStatus(name, "mutex", 1, int(mutex), 1 - int(mutex)))
    return found


def lock_status(
    broker: BrokerLike, name: str, kinds: Sequence[Kind] = ALL_KINDS
) -> list[LockStatus]:
    """Sync read of :func:`read_lock_status` (``amqp_locks.aio.lock_status`` awaits it)."""
    return broker._core.run(read_lock_status(broker._core, name, kinds))


def of_kind(found: Sequence[LockStatus], kind: Kind) -> LockStatus | None:
    """The entry of `kind` in a :func:`lock_status` answer, if there is one."""
    return next((st for st in found if st.kind == kind), None)
