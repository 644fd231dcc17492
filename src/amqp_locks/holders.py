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

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from .errors import BrokerTimeout
from .records import HOLDER_TIMEOUT, HolderRecord, LockStatus
from .transport.broker import BrokerCore, BrokerLike
from .transport.holders import QueryResult
from .transport.session import Session
from .transport.shield import within

__all__ = [
    "HOLDER_TIMEOUT",
    "HolderQueries",
    "HolderRecord",
    "Reading",
    "ask_holders",
    "pick_holder",
    "read_holders",
    "read_locked",
    "with_records",
]


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


@dataclass(frozen=True)
class Reading:
    """One kind's status of a lock, as that kind read it. ``wire``: in cluster mode a
    mutex or persistent semaphore is the token semaphore ``wire`` on the broker, so its
    holders answer for that name as tokens (docs/protocol.md section 11)."""

    status: LockStatus
    wire: str | None = None


#: A lock kind's own read: its :class:`Reading` of `name`, None when it does not exist.
StatusReader = Callable[[BrokerCore, str], Awaitable[Reading | None]]


async def with_records(
    session: Session, readings: Sequence[Reading], timeout: float
) -> list[LockStatus]:
    """The statuses of `readings` (one name), each with the records of its holders,
    waiting up to `timeout` seconds for silent ones."""
    direct = [r.status for r in readings if r.wire is None]
    by_kind: dict[str, tuple[HolderRecord, ...]] = {}
    note = None
    if direct:
        by_kind, note = await ask_holders(session, direct[0].name, direct, timeout)
    out: list[LockStatus] = []
    for reading in readings:
        st = reading.status
        if reading.wire is None:
            got = by_kind.get(st.kind, ())
            out.append(replace(st, records=got, records_note=note if st.held else None))
            continue
        as_token = replace(st, name=reading.wire, kind="token")
        tokens, wire_note = await ask_holders(session, reading.wire, [as_token], timeout)
        got = tuple(replace(r, name=st.name, kind=st.kind) for r in tokens.get("token", ()))
        numbers = tuple(sorted(r.number for r in got if r.number is not None))
        out.append(
            replace(
                st,
                holders=numbers if st.kind == "semaphore" else st.holders,
                records=got,
                records_note=wire_note if st.held else None,
            )
        )
    return out


async def read_locked(core: BrokerCore, read: StatusReader, name: str) -> bool:
    """Whether anyone holds `name` by the kind's own read (no holder queries)."""

    async def attempt() -> bool:
        reading = await read(core, name)
        return reading is not None and reading.status.held > 0

    return await core.read(attempt)


async def read_holders(
    core: BrokerCore, read: StatusReader, name: str, timeout: float = HOLDER_TIMEOUT
) -> list[HolderRecord]:
    """The records of `name`'s holders by the kind's own read (empty when free)."""

    async def attempt() -> list[HolderRecord]:
        reading = await read(core, name)
        if reading is None:
            return []
        [st] = await with_records(await core.session(), [reading], timeout)
        return list(st.records)

    return await core.read(attempt)


T = TypeVar("T")


async def bounded(coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
    """`coro` (a read that waits `timeout` for holders' answers), answered within
    `timeout` + 1 s even when the broker stops answering: else :class:`BrokerTimeout`."""

    def late() -> BaseException:
        return BrokerTimeout(f"{what}: the broker answered nothing in time")

    result = await within(coro, timeout, cut=late)
    assert result is not None  # within raises late() rather than answer None
    return result


class HolderQueries:
    """``locked()`` and ``holders()`` of the lock kinds (sync; aio has twins). A kind
    gives its own read as :meth:`own_status`."""

    kind: ClassVar[str]
    broker: BrokerLike
    name: str

    @staticmethod
    async def own_status(core: BrokerCore, name: str) -> Reading | None:
        """This kind's read of `name`; a kind that must exist raises when it does not."""
        raise NotImplementedError

    def locked(self) -> bool:
        """True when at least one slot (semaphore), permit (token semaphore), the mutex or
        a read or write hold (read-write lock) is held by anyone, this process included,
        as the broker sees it now: one read, no holder queries. A token semaphore counts
        permits a drain or audit holds too.
        Raises :class:`SemaphoreNotFound` / :class:`TokenSemaphoreNotFound` for a
        semaphore that does not exist."""
        core = self.broker.core
        return core.run(read_locked(core, self.own_status, self.name))

    def holders(self, timeout: float = HOLDER_TIMEOUT) -> list[HolderRecord]:
        """A record per held slot, permit or mutex (empty when none is held), waiting up to
        `timeout` seconds for the holders' answers; a holder that did not answer is a
        record with ``holder_id=None`` (see :class:`HolderRecord`). Answers within
        `timeout` + 1 s whatever the broker does, or raises :class:`BrokerTimeout`."""
        core = self.broker.core
        what = f"holders of {self.name!r}"
        read = read_holders(core, self.own_status, self.name, timeout)
        return core.run(bounded(read, timeout, what))
