"""Taking the lock `run` holds, by kind, and what its wait line says about the holders."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import LockError, SemaphoreNotFound
from ..holders import HolderRecord, pick_holder
from ..lease import Lease
from ..mutex import Mutex
from ..rwlock import ReadWriteLock
from ..semaphore import PersistentSemaphore, SemaphoreAdmin
from ..status import of_kind
from ..tokens import TokenSemaphore, TokenSemaphoreNotFound
from ..transport.broker import Broker
from ..transport.shield import within
from .common import CliError, read_status
from .exitcodes import Exit
from .status import since_text
from .waitline import Probe


def _slots_conflict(name: str, kind: str, have: int, asked: int) -> CliError:
    """-n that disagrees with the existing lock's count (`consul lock` refuses it too)."""
    if kind == "semaphore":
        what, unit, admin = (
            f"semaphore {name!r}",
            "slots",
            f"amqp-locks semaphore add|remove {name}",
        )
    else:
        what, unit, admin = (
            f"token semaphore {name!r}",
            "permits",
            f"amqp-locks token add|remove {name}",
        )
    return CliError(
        Exit.DATAERR,
        f"{what} has {have} {unit}, not {asked} (-n {asked}): "
        f"change its count with '{admin} COUNT', or leave out -n",
    )


def _semaphore_size(broker: Broker, name: str) -> int:
    """The persistent semaphore's slot count, 0 if absent (read-only; no admin mutex)."""
    st = of_kind(read_status(broker, name, ("semaphore",)), "semaphore")
    return 0 if st is None else st.capacity


def ensure(broker: Broker, kind: str, name: str, slots: int | None, priority: int = 0) -> None:
    """With -n: create the semaphore of `slots` if it is missing; refuse (65) one that
    exists with another count.

    The count is read first without the admin mutex (the common case: it matches). Any
    other answer — absent, another count, or a semaphore half made by a concurrent
    creator — is settled by the idempotent create/setup, which runs under the mutex and
    refuses another count."""
    if slots is None or kind in ("mutex", "shared", "exclusive"):
        return
    if kind == "semaphore":
        if _semaphore_size(broker, name) == slots:
            return
        try:
            SemaphoreAdmin(broker, name).create(slots)
            return
        except LockError:
            have = _semaphore_size(broker, name)
            if have in (0, slots):
                raise  # not a count conflict (other queue flags, ...): as it is
            raise _slots_conflict(name, kind, have, slots) from None
    tokens = TokenSemaphore(broker, name, priority=priority)
    try:
        if tokens.status().permits == slots:
            return
    except TokenSemaphoreNotFound:
        pass
    try:
        tokens.setup(slots)
    except TokenSemaphoreNotFound:
        raise
    except LockError:
        have = tokens.status().permits
        if have == slots:
            raise
        raise _slots_conflict(name, kind, have, slots) from None


def connect_within(broker: Broker, timeout: float | None, what: str) -> None:
    """With -n, the connection the count check needs is made within the -w wait, as
    the lock's own acquire makes it: a broker that accepts TCP and never answers the
    handshake is "no connection was made" (69) after -w, not after the 10 s connect
    timeout. Without -w (or with --nonblock) the connect timeout bounds it."""
    core = broker.core
    if timeout is None or core.connected:
        return

    async def connect() -> bool:
        await core.session()
        return True

    core.run(within(connect(), timeout, cut=lambda: core.unconnected_error(timeout, what)))


def acquire(
    broker: Broker,
    kind: str,
    name: str,
    slots: int | None,
    *,
    blocking: bool,
    timeout: float | None,
    priority: int = 0,
) -> Lease | None:
    """Take the lock `name` of `kind`; with `slots`, a semaphore of that count (created if
    missing, refused if it has another)."""
    if slots is not None and kind in ("semaphore", "token"):
        what = "PersistentSemaphore" if kind == "semaphore" else "TokenSemaphore"
        connect_within(broker, timeout if blocking else None, f"{what}({name!r})")
    ensure(broker, kind, name, slots, priority)
    if kind in ("shared", "exclusive"):
        rw = ReadWriteLock(broker, name)
        side = rw.read_lock if kind == "shared" else rw.write_lock
        return side.acquire(blocking, timeout)
    if kind == "mutex":
        return Mutex(broker, name).acquire(blocking, timeout)
    if kind == "semaphore":
        try:
            return PersistentSemaphore(broker, name).acquire(blocking, timeout)
        except SemaphoreNotFound:
            raise SemaphoreNotFound(
                f"semaphore {name!r} does not exist: create it with "
                f"'amqp-locks semaphore create {name} SLOTS' or pass -n SLOTS"
            ) from None
    try:
        return TokenSemaphore(broker, name, priority=priority).acquire(blocking, timeout)
    except TokenSemaphoreNotFound:
        raise TokenSemaphoreNotFound(
            f"token semaphore {name!r} does not exist: set it up with "
            f"'amqp-locks token setup {name} PERMITS' or pass -n PERMITS"
        ) from None


def holders_probe(broker: Broker, kind: str, name: str) -> Probe:
    """What the wait line says about the holders: who (holder id, host, pid, since, as
    they answer themselves; "an unknown holder" when one does not) and how many. Read-only,
    no admin mutex, on the wait line's own thread."""

    def who(records: Sequence[HolderRecord]) -> str:
        parts = []
        for r in records:
            label = {"semaphore": "slot ", "token": "permit "}.get(r.kind)
            part = "" if label is None or r.number is None else f"{label}{r.number} "
            part += f"held by {r.describe()}"
            parts.append(part + (f" since {since_text(r.since)}" if r.known else ""))
        return ", ".join(parts)

    def probe() -> str | None:
        if kind in ("shared", "exclusive"):
            rw = ReadWriteLock(broker, name).status()
            if rw is None:
                return None
            writer = "a writer has the turn" if rw.writer else "no writer"
            return (
                f"{rw.held} of {rw.readers} reader token(s) out, {writer}, "
                f"{rw.writers_waiting} writer(s) waiting"
            )
        if kind == "mutex":
            mutex = of_kind(read_status(broker, name, ("mutex",), records=True), "mutex")
            if mutex is None or not mutex.held:
                return None
            holder = pick_holder(mutex.records)
            return "held elsewhere" if holder is None else who([holder])
        if kind == "semaphore":
            sem = of_kind(read_status(broker, name, ("semaphore",), records=True), "semaphore")
            if sem is None:
                return None
            if not sem.holders:
                return f"{sem.capacity} slot(s), none held"
            return f"{who(sem.records)} ({sem.held} of {sem.capacity} slot(s))"
        tok = of_kind(read_status(broker, name, ("token",), records=True), "token")
        if tok is None:
            return None
        held = f"{tok.held} of {tok.capacity} permit(s) held"
        if tok.records:
            held = f"{who(tok.records)} ({held})"
        return f"{held}, {tok.waiting} waiting"

    return probe
