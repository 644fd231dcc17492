"""Read-only status of named locks: what each name is, how much of it is held, by whom.

What ``amqp-locks status`` shows, as a public API. Reads take no administration mutex
(one passive declare or pipelined probe per queue), so they can be polled without
disturbing holders or administrators. AMQP cannot list queues: names must be given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from .errors import ConfigurationError, QueueNotFound, ResourceLocked, TokenSemaphoreNotFound
from .holders import HOLDER_TIMEOUT, HolderRecord, ask_holders
from .names import quorum_mutex_name, token_queue, validate_name
from .rwlock import read_status as read_rwlock_status
from .semaphore.admin import find_max, held_slots
from .semaphore.cluster import slots_name
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
    ``consumers`` of the tokens, ``waiting`` writers waiting for the turn.
    ``records``: who holds it, one :class:`HolderRecord` per held slot, permit, mutex or
    read-write hold (read only with ``records=True``); ``records_note``: why records may
    be missing."""

    name: str
    kind: Kind
    capacity: int
    held: int
    free: int
    holders: tuple[int, ...] = field(default_factory=tuple)
    consumers: int | None = None
    waiting: int | None = None
    records: tuple[HolderRecord, ...] = ()
    records_note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["holders"] = list(self.holders)
        out["records"] = [r.as_dict() for r in self.records]
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
    core: BrokerCore,
    name: str,
    kinds: Sequence[Kind] = ALL_KINDS,
    *,
    records: bool = False,
    timeout: float = HOLDER_TIMEOUT,
) -> list[LockStatus]:
    """Every kind of lock named `name` that exists, among `kinds` (one name may be
    several: a semaphore and its administration mutex share it), or one ``absent`` entry.
    With `records`, also ask the holders who they are, waiting up to `timeout` seconds for
    silent ones (amqp_locks/holders.py)."""
    name = validate_name(name)
    if timeout < 0:
        raise ConfigurationError(f"timeout must be >= 0 seconds, got {timeout}")
    session = await core.session()
    found: list[LockStatus] = []
    if core.cluster:  # mutex and semaphore are token semaphores there (protocol.md 11)
        cluster_kinds = [k for k in kinds if k in ("semaphore", "mutex")]
        found += await _cluster_entries(session, name, cluster_kinds, records, timeout)
        kinds = [k for k in kinds if k not in ("semaphore", "mutex")]
    cluster_found = list(found)
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
    if records:
        done = len(cluster_found)  # cluster mode's entries came with their records
        by_kind, note = await ask_holders(session, name, found[done:], timeout)
        found = found[:done] + [
            replace(st, records=by_kind.get(st.kind, ()), records_note=note if st.held else None)
            for st in found[done:]
        ]
    return found


async def _cluster_entries(
    session: Session, name: str, kinds: Sequence[Kind], records: bool, timeout: float
) -> list[LockStatus]:
    """Cluster mode's mutex `name` (token semaphore ``name.mutex``) and semaphore `name`
    (``name.slots``), as the lock kinds they stand for."""
    out: list[LockStatus] = []
    subs: tuple[tuple[Kind, str], ...] = (
        ("semaphore", slots_name(name)),
        ("mutex", quorum_mutex_name(name)),
    )
    for kind, sub in subs:
        if kind not in kinds or not await session.exists_passive(token_queue(sub)):
            continue
        try:
            st = await read_status(session, sub)
        except TokenSemaphoreNotFound:
            continue
        entry = LockStatus(
            sub, "token", st.permits, st.held, st.ready, (), st.consumers, st.waiting
        )
        got: tuple[HolderRecord, ...] = ()
        note = None
        if records:
            by_kind, note = await ask_holders(session, sub, [entry], timeout)
            got = tuple(replace(r, name=name, kind=kind) for r in by_kind.get("token", ()))
        numbers = tuple(sorted(r.number for r in got if r.number is not None))
        out.append(
            replace(
                entry,
                name=name,
                kind=kind,
                holders=numbers if kind == "semaphore" else (),
                records=got,
                records_note=note if st.held else None,
            )
        )
    return out


def lock_status(
    broker: BrokerLike,
    name: str,
    kinds: Sequence[Kind] = ALL_KINDS,
    *,
    records: bool = False,
    timeout: float = HOLDER_TIMEOUT,
) -> list[LockStatus]:
    """Sync read of :func:`read_lock_status` (``amqp_locks.aio.lock_status`` awaits it).

    ``records=True`` adds who holds each lock (:attr:`LockStatus.records`): the holders
    answer themselves, and one that has not answered within `timeout` seconds is listed
    with ``holder_id=None`` rather than guessed."""
    return broker._core.run(
        read_lock_status(broker._core, name, kinds, records=records, timeout=timeout)
    )


def of_kind(found: Sequence[LockStatus], kind: Kind) -> LockStatus | None:
    """The entry of `kind` in a :func:`lock_status` answer, if there is one."""
    return next((st for st in found if st.kind == kind), None)
