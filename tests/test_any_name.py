"""Any name works (issue 36 case 7): names users build from data (``order=42``, ``café``,
``job(1)``, CJK, emoji, spaces, names of the maximum length) are acquired and released
through every primitive, their holders answer under the user's name, and nothing of
them is left on the broker once the first-use queues expire.

1,000 random names in all: 300 through a single-node ``Mutex``, 150 through a
cluster-mode ``Mutex`` (``Broker(url, cluster=True)``: a quorum token queue), 150
through a ``PersistentSemaphore`` (created, then destroyed), 250 through a first-use
``TokenSemaphore(permits=2)`` and 150 through a ``ReadWriteLock`` (read, then write).
The CLI's share is in tests/cli/test_any_name_cli.py.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from amqp_locks import (
    Broker,
    Lease,
    Mutex,
    PersistentSemaphore,
    ReadWriteLock,
    SemaphoreAdmin,
    TokenSemaphore,
    lock_status,
)
from amqp_locks.names import MAX_NAME_CHARS, is_readable, validate_name
from amqp_locks.tokens import fresh
from amqp_locks.transport import features
from amqp_locks_dev import devbroker

from .waiting import wait_until

#: The expiry the test gives first-use and helper queues (the library's is 60 s).
EXPIRES_MS = 1_500
COUNTS = {"mutex": 300, "cluster mutex": 150, "semaphore": 150, "token": 250, "rwlock": 150}
#: Queues every lock shares and keeps (the fence shards) or the cluster mode's probes.
SHARED = ("amqp-locks-fence-", "amqp-locks-shard-", "amqp-locks.quorum-guard.")

_PIECES = (
    list("abcxyzABC0123456789")
    + list("=()|*:/%#,+@ .-_")
    + list("éèüñçÅøß")
    + list("日本語漢字한국")
    + ["🙂", "🔒", "🚀", "λ", "Ω"]
    + ["-1-A", "-fence", ".semaphore", "#", "  "]
)


def random_names(rng: random.Random, count: int, tag: str) -> list[str]:
    """`count` distinct valid names, each holding `tag` (unique to the run); one in ten
    exactly :data:`MAX_NAME_CHARS` characters long, one in ten plain ASCII."""
    out: list[str] = []
    while len(out) < count:
        i = len(out)
        body = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 30)))
        name = rng.choice([f"{tag}{body}", f"{body}{tag}", f"{body[:5]}{tag}{body[5:]}"])
        if i % 10 == 3:
            name = (name + "".join(rng.choice(_PIECES) for _ in range(MAX_NAME_CHARS)))[
                :MAX_NAME_CHARS
            ]
        elif i % 10 == 7:
            name = f"{tag}-plain-{i}"
        try:
            validate_name(name)
        except ValueError:
            continue
        out.append(name)
    assert len(set(out)) == count
    return out


@pytest.fixture
def short_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fresh, "EXPIRES_MS", EXPIRES_MS)
    monkeypatch.setattr(features, "HELPER_EXPIRES_MS", EXPIRES_MS)
    monkeypatch.setattr(features, "NAME_EXPIRES_MS", EXPIRES_MS)


def _queues(node: devbroker.NodeInfo) -> set[str]:
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "--no-table-headers", "--quiet")
    return {line.strip() for line in out.splitlines() if line.strip()}


def _held(lease: Lease | None, name: str) -> Lease:
    assert lease is not None, f"{name!r} was not granted"
    assert lease.held
    return lease


def _check_records(b: Broker, name: str, kind: str) -> None:
    """While held: status shows the user's name, and the holder answers for it."""
    found = [st for st in lock_status(b, name, records=True, timeout=5) if st.kind == kind]
    assert found, (name, lock_status(b, name))
    st = found[0]
    assert st.name == name and st.held >= 1
    assert [r.holder_id for r in st.records] == ["any-name"] * len(st.records), st
    assert st.records and all(r.name == name for r in st.records)


@pytest.fixture
def brokers(amqp_url: str) -> Iterator[tuple[Broker, Broker]]:
    single = Broker(amqp_url, holder_id="any-name")
    cluster = Broker(amqp_url, cluster=True, holder_id="any-name")
    try:
        yield single, cluster
    finally:
        single.close()
        cluster.close()


def test_a_thousand_random_names_through_every_primitive(
    short_expiry: None,
    brokers: tuple[Broker, Broker],
    node: devbroker.NodeInfo,
    name: str,
) -> None:
    single, cluster = brokers
    rng = random.Random(36)
    before = _queues(node)
    per_kind = {kind: random_names(rng, n, name) for kind, n in COUNTS.items()}
    assert sum(len(v) for v in per_kind.values()) == 1000
    escaped = sum(not is_readable(n) for v in per_kind.values() for n in v)
    assert escaped > 500  # most random names need escaping: the mapping is exercised

    def mutex(b: Broker, kind: str) -> Callable[[str, bool], None]:
        def run(n: str, check: bool) -> None:
            lease = _held(Mutex(b, n).acquire(timeout=10), n)
            if check:
                _check_records(b, n, "mutex")
                assert Mutex(b, n).holder() is not None
            lease.release(wait=True)

        return run

    def semaphore(n: str, check: bool) -> None:
        admin = SemaphoreAdmin(single, n)
        assert admin.create(1) == 1
        lease = _held(PersistentSemaphore(single, n).acquire(timeout=10), n)
        if check:
            _check_records(single, n, "semaphore")
        lease.release(wait=True)
        admin.destroy()

    def token(n: str, check: bool) -> None:
        sem = TokenSemaphore(single, n, first_use=True, permits=2)
        first = _held(sem.acquire(timeout=10), n)
        second = _held(TokenSemaphore(single, n, first_use=True, permits=2).acquire(timeout=10), n)
        if check:
            _check_records(single, n, "token")
        assert sem.acquire(blocking=False) is None  # two permits, both held
        first.release(wait=True)
        second.release(wait=True)

    def rwlock(n: str, check: bool) -> None:
        rw = ReadWriteLock(single, n, readers=4)
        read = _held(rw.read_lock.acquire(timeout=10), n)
        if check:
            _check_records(single, n, "rwlock")
        read.release(wait=True)
        _held(rw.write_lock.acquire(timeout=10), n).release(wait=True)

    runs: dict[str, Callable[[str, bool], None]] = {
        "mutex": mutex(single, "mutex"),
        "cluster mutex": mutex(cluster, "cluster mutex"),
        "semaphore": semaphore,
        "token": token,
        "rwlock": rwlock,
    }
    took: dict[str, float] = {}
    for kind, kind_names in per_kind.items():
        start = time.monotonic()
        for i, n in enumerate(kind_names):
            runs[kind](n, i < 3 or i % 10 == 3)  # records of a few, maximum-length ones too
        took[kind] = time.monotonic() - start
    single.close()
    cluster.close()

    def left() -> set[str]:
        return {q for q in _queues(node) - before if not q.startswith(SHARED)}

    # Nothing but the shared queues stays once the first-use and helper queues expire.
    start = time.monotonic()
    try:
        wait_until(lambda: not left(), 60, "every queue of the names to go", step=0.5)
    except AssertionError:
        rest = sorted(left())
        raise AssertionError(f"{len(rest)} queues left, e.g. {rest[:5]}; took {took}") from None
    print(f"took {took}; nothing left {time.monotonic() - start:.1f} s after the last release")
