"""Read-only status of named locks: what each name is, how much of it is held, by whom.

What ``amqp-locks status`` shows, as a public API. Each lock kind reads its own status
(``read_semaphore``, ``read_token``, ``read_rwlock``, ``read_mutex``, beside their
protocols); this module puts the kinds one name may be together, on top of them all.
Reads take no administration mutex (one passive declare or pipelined probe per queue), so
they can be polled without disturbing holders or administrators. AMQP cannot list queues:
names must be given.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConfigurationError
from .holders import Reading, StatusReader, bounded, with_records
from .mutex import read_mutex
from .names import validate_name
from .records import ALL_KINDS, HOLDER_TIMEOUT, Kind, LockStatus
from .rwlock import read_rwlock
from .semaphore.slots import read_semaphore
from .tokens.ledger import read_token
from .transport.broker import BrokerCore, BrokerLike

__all__ = ["ALL_KINDS", "Kind", "LockStatus", "lock_status", "of_kind", "read_lock_status"]

READERS: dict[Kind, StatusReader] = {
    "semaphore": read_semaphore,
    "token": read_token,
    "rwlock": read_rwlock,
    "mutex": read_mutex,
}
#: Cluster mode lists the kinds that are token semaphores there (protocol.md 11) first.
CLUSTER_ORDER: tuple[Kind, ...] = ("semaphore", "mutex", "token", "rwlock")


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
    name = validate_name(name, admin=True)
    if timeout < 0:
        raise ConfigurationError(f"timeout must be >= 0 seconds, got {timeout}")
    return await core.read(lambda: _read(core, name, kinds, records, timeout))


async def _read(
    core: BrokerCore, name: str, kinds: Sequence[Kind], records: bool, timeout: float
) -> list[LockStatus]:
    readings: list[Reading] = []
    for kind in CLUSTER_ORDER if core.cluster else ALL_KINDS:
        reading = await READERS[kind](core, name) if kind in kinds else None
        if reading is None:
            continue
        if kind == "mutex" and not core.cluster and not reading.status.held and readings:
            continue  # an unheld queue `name` beside a lock of that name is no mutex
        readings.append(reading)
    if not readings:
        return [LockStatus(name, "absent", 0, 0, 0)]
    if not records:
        return [r.status for r in readings]
    return await with_records(await core.session(), readings, timeout)


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
    with ``holder_id=None`` rather than guessed. Answers within `timeout` + 1 s whatever
    the broker does, or raises :class:`~amqp_locks.errors.BrokerTimeout`."""
    read = read_lock_status(broker.core, name, kinds, records=records, timeout=timeout)
    return broker.core.run(bounded(read, timeout, f"status of {name!r}"))


def of_kind(found: Sequence[LockStatus], kind: Kind) -> LockStatus | None:
    """The entry of `kind` in a :func:`lock_status` answer, if there is one."""
    return next((st for st in found if st.kind == kind), None)
