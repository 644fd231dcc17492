"""A session's per-name memory is bounded (transport/recent.py): a process that locks names
without end keeps the names it used last only, and a forgotten name works as a new one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from amqp_locks import Broker, Mutex
from amqp_locks.transport import recent
from amqp_locks.transport.recent import RecentDict, RecentSet
from amqp_locks.transport.session import Session

#: The maps a session keeps per lock name.
PER_NAME = (
    "fences_known",
    "modes_checked",
    "released_at",
    "sentinels_declared",
    "slot_hints",
    "size_hints",
    "ledger_versions",
)


def test_5000_names_stay_within_the_bound() -> None:
    seen: RecentSet[str] = RecentSet()
    last: RecentDict[str, int] = RecentDict()
    for i in range(5000):
        seen.add(f"order-{i}")
        last[f"order-{i}"] = i
        assert len(seen) <= recent.NAMES_REMEMBERED
        assert len(last) <= recent.NAMES_REMEMBERED
    assert len(seen) == len(last) == recent.NAMES_REMEMBERED
    assert "order-4999" in seen and last["order-4999"] == 4999
    assert "order-0" not in seen and "order-0" not in last


def test_a_name_in_use_is_kept_however_many_others_come() -> None:
    seen: RecentSet[str] = RecentSet(size=10)
    last: RecentDict[str, int] = RecentDict(size=10)
    seen.add("busy")
    last["busy"] = 1
    for i in range(5000):
        seen.add(f"n{i}")
        last[f"n{i}"] = i
        assert "busy" in seen  # each lookup keeps it
        assert last.get("busy") == 1
    assert len(seen) == len(last) == 10


@pytest.fixture
def small_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(recent, "NAMES_REMEMBERED", 20)
    yield 20


def test_a_session_locking_many_names_stays_bounded(
    small_memory: int, amqp_url: str, broker: Broker, name: str
) -> None:
    """200 distinct mutexes (fenced: fence, mode, sentinel and release entries per name)
    through one session that remembers 20 names; the first name, long forgotten, is locked
    again with its fencing token still rising."""
    names = [f"{name}-{i}" for i in range(200)]
    with Broker(amqp_url) as b:
        first = Mutex(b, names[0]).acquire(timeout=5)
        assert first is not None
        first_token = first.fencing_token
        first.release()
        for name in names[1:]:
            lease = Mutex(b, name).acquire(timeout=5)
            assert lease is not None
            lease.release()
            session = b.core._session
            assert session is not None
            for attr in PER_NAME:
                size = len(getattr(session, attr))
                assert size <= small_memory, f"{attr} holds {size} names"
        assert isinstance(session, Session)
        again = Mutex(b, names[0]).acquire(timeout=5)
        assert again is not None
        assert again.fencing_token > first_token
        again.release()
