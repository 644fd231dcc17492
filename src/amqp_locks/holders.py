"""Who holds a lock: holder records, read by asking the holders themselves.

A held lock's record (holder id, host, pid, since, fencing token, slot or permit) is
answered by its holder's I/O thread (`transport/holders.py`), so it exists exactly as
long as the holder's connection holds the lock. The reader first reads how much of the
lock is held (the same reads as :func:`amqp_locks.lock_status`), then asks and waits for
that many answers, for at most `timeout` seconds. A held slot, permit or mutex whose
holder does not answer in time (a frozen or partitioned process, a holder running an
amqp-locks without records, or one without permission to publish them) is reported as a
record with ``holder_id=None``: known to be held, holder unknown. Nothing is invented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, cast

from .transport.holders import QueryResult

if TYPE_CHECKING:
    from .status import Kind, LockStatus
    from .transport.broker import BrokerCore, BrokerLike
    from .transport.session import Session

#: How long a reader waits for silent holders (seconds).
HOLDER_TIMEOUT = 1.0


@dataclass(frozen=True)
class HolderRecord:
    """One held slot, permit or mutex, and who holds it.

    ``number`` is the slot or permit id (1 for a mutex; None for a permit whose holder did
    not answer: the broker says how many permits are held, not which). ``holder_id``,
    ``host``, ``pid``, ``since`` (UTC) and ``fencing_token`` are None when the holder did
    not answer (:attr:`known` is False).
    """

    name: str
    kind: str
    number: int | None
    holder_id: str | None = None
    host: str | None = None
    pid: int | None = None
    since: datetime | None = None
    fencing_token: int | None = None

    @property
    def known(self) -> bool:
        """The holder answered; False: held by a holder that did not say who it is."""
        return self.holder_id is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "number": self.number,
            "holder_id": self.holder_id,
            "host": self.host,
            "pid": self.pid,
            "since": None if self.since is None else self.since.isoformat(),
            "fencing_token": self.fencing_token,
        }

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> HolderRecord:
        """The record :meth:`as_dict` wrote (``amqp-locks status --json`` rows)."""
        since = d.get("since")
        return cls(
            name,
            d["kind"],
            d.get("number"),
            d.get("holder_id"),
            d.get("host"),
            d.get("pid"),
            datetime.fromisoformat(since) if since else None,
            d.get("fencing_token"),
        )

    def describe(self) -> str:
        """``worker-7 (host a, pid 123)``, or ``a:123`` for the default id, or ``unknown``."""
        if not self.known:
            return "an unknown holder (it did not answer)"
        if self.holder_id == f"{self.host}:{self.pid}":
            return str(self.holder_id)
        return f"{self.holder_id} (host {self.host}, pid {self.pid})"


def _records(name: str, result: QueryResult) -> list[HolderRecord]:
    """Every record the answers carry, newest answer per responder."""
    out: list[HolderRecord] = []
    for answer in result.answers.values():
        for r in answer.get("records", ()):
            try:
                since = datetime.fromisoformat(r["since"]) if r.get("since") else None
                out.append(
                    HolderRecord(
                        name,
                        str(r["kind"]),
                        int(r["number"]),
                        str(answer["holder_id"]),
                        str(answer.get("host")),
                        int(r["pid"]),
                        since,
                        int(r["token"]),
                    )
                )
            except (KeyError, TypeError, ValueError):
                continue  # a malformed answer is ignored, never shown half-read
    return out


def _expected(found: Sequence[LockStatus]) -> dict[str, Any]:
    """What the status says is held: per kind, slot numbers (semaphore), a count
    (token), True (mutex), or (tokens out, reader tokens) (rwlock)."""
    want: dict[str, Any] = {}
    for st in found:
        if st.kind == "semaphore" and st.holders:
            want["semaphore"] = set(st.holders)
        elif st.kind == "token" and st.held:
            want["token"] = st.held
        elif st.kind == "mutex" and st.held:
            want["mutex"] = True
        elif st.kind == "rwlock" and st.held:
            want["rwlock"] = (st.held, st.capacity)
    return want


def _rwlock_covered(records: Sequence[HolderRecord], readers: int) -> int:
    """Reader tokens the answered rwlock records account for: a writer (number 0) holds
    all `readers` of them, a reader one."""
    return sum(readers if r.number == 0 else 1 for r in records)


def _satisfied(name: str, want: dict[str, Any], result: QueryResult) -> bool:
    got = _records(name, result)
    for kind, need in want.items():
        mine = [r for r in got if r.kind == kind]
        if kind == "semaphore" and not need <= {r.number for r in mine}:
            return False
        if kind == "token" and len(mine) < need:
            return False
        if kind == "mutex" and not mine:
            return False
        if kind == "rwlock" and _rwlock_covered(mine, need[1]) < need[0]:
            return False
    return True


async def ask_holders(
    session: Session, name: str, found: Sequence[LockStatus], timeout: float
) -> tuple[dict[str, tuple[HolderRecord, ...]], str | None]:
    """Records per kind for the held entries of `found` (a :func:`read_lock_status`
    answer), with an unknown record for each held unit nobody answered for; and a note
    saying why there may be no answers at all."""
    want = _expected(found)
    if not want:
        return {}, None
    result = await session.holder_reader.ask(name, timeout, lambda res: _satisfied(name, want, res))
    got = _records(name, result)
    out: dict[str, tuple[HolderRecord, ...]] = {}
    for kind, need in want.items():
        mine = sorted(
            (r for r in got if r.kind == kind), key=lambda r: (r.number or 0, r.fencing_token)
        )
        if kind == "semaphore":
            answered = {r.number for r in mine}
            mine += [HolderRecord(name, kind, k) for k in sorted(need - answered)]
            mine.sort(key=lambda r: r.number or 0)
        elif kind == "token":
            mine += [HolderRecord(name, kind, None)] * max(0, need - len(mine))
        elif kind == "rwlock":
            held, readers = need
            if not mine and held >= readers:
                mine = [HolderRecord(name, kind, None)]  # one writer, or readers: unknown
            else:
                missing = max(0, held - _rwlock_covered(mine, readers))
                mine += [HolderRecord(name, kind, None)] * missing
        elif not mine:
            mine = [HolderRecord(name, kind, 1)]
        out[kind] = tuple(mine)
    return out, result.note


def pick_holder(records: Sequence[HolderRecord]) -> HolderRecord | None:
    """A mutex's holder: the answered record (the newest token if a hand-off answered
    twice), else the unknown one, else None (free)."""
    known = [r for r in records if r.known]
    if known:
        return max(known, key=lambda r: r.fencing_token or 0)
    return records[0] if records else None


class HolderQueries:
    """``locked()`` and ``holders()`` of the three lock kinds (sync; aio has twins)."""

    kind: ClassVar[str]
    broker: BrokerLike
    name: str

    def locked(self) -> bool:
        """True when at least one slot (semaphore), permit (token semaphore), the mutex or
        a read or write hold (read-write lock) is held by anyone, this process included,
        as the broker sees it now: one read, no holder queries. A token semaphore counts
        permits a drain or audit holds too.
        Raises :class:`SemaphoreNotFound` / :class:`TokenSemaphoreNotFound` for a
        semaphore that does not exist."""
        core = self.broker._core
        return core.run(read_locked(core, self.kind, self.name))

    def holders(self, timeout: float = HOLDER_TIMEOUT) -> list[HolderRecord]:
        """A record per held slot, permit or mutex (empty when none is held), waiting up to
        `timeout` seconds for the holders' answers; a holder that did not answer is a
        record with ``holder_id=None`` (see :class:`HolderRecord`)."""
        core = self.broker._core
        return core.run(read_holders(core, self.kind, self.name, timeout))


async def read_kind(
    core: BrokerCore, kind: str, name: str, *, records: bool, timeout: float = HOLDER_TIMEOUT
) -> LockStatus:
    """The status of the `kind` lock `name` (with its records if asked), raising for a
    semaphore that does not exist."""
    from .errors import SemaphoreNotFound, TokenSemaphoreNotFound
    from .status import LockStatus, read_lock_status

    kinds = cast("tuple[Kind]", (kind,))
    found = await read_lock_status(core, name, kinds, records=records, timeout=timeout)
    for st in found:
        if st.kind == kind:
            return st
    if kind == "semaphore":
        raise SemaphoreNotFound(f"semaphore {name!r} does not exist (no slots)")
    if kind == "token":
        raise TokenSemaphoreNotFound(f"token semaphore {name!r} is not set up")
    if kind == "rwlock":
        return LockStatus(name, "rwlock", 0, 0, 0)  # not set up yet: nobody holds it
    return LockStatus(name, "mutex", 1, 0, 1)  # no queue `name`: a free mutex


async def read_locked(core: BrokerCore, kind: str, name: str) -> bool:
    return (await read_kind(core, kind, name, records=False)).held > 0


async def read_holders(
    core: BrokerCore, kind: str, name: str, timeout: float = HOLDER_TIMEOUT
) -> list[HolderRecord]:
    return list((await read_kind(core, kind, name, records=True, timeout=timeout)).records)
