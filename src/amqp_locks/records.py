"""The records lock reads return: what a lock is and who holds it.

Plain data, below every lock kind: each kind reads its own :class:`LockStatus`
(``read_*`` beside its protocol), `holders.py` adds the :class:`HolderRecord`s its
holders answer with, and `status.py` puts the kinds of one name together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

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


#: The kinds of lock one name can be, in the order :func:`amqp_locks.lock_status` lists them.
ALL_KINDS: tuple[Kind, ...] = ("semaphore", "token", "rwlock", "mutex")
