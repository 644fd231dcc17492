"""A released name costs the broker nothing (issue 30): on one node a mutex's per-name
queues go once unused, its fencing token comes from a shared shard and keeps rising across
that, and a helper queue an earlier release made with a 10-minute expiry is used as it is."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest

from amqp_locks import Broker, Lease, LockError, Mutex, ReadWriteLock, fencing, prepare_fences
from amqp_locks.names import FENCE_SHARDS, fence_marker, sentinel_queue
from amqp_locks.transport import features
from amqp_locks_dev import devbroker

from .conftest import fence_counter, fence_messages, queue_exists
from .waiting import wait_until

#: The expiry the tests give per-name queues (the library's is 60 s).
EXPIRES_MS = 2_000


@pytest.fixture
def short_expiry(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(features, "HELPER_EXPIRES_MS", EXPIRES_MS)
    yield EXPIRES_MS


def _queues(node: devbroker.NodeInfo) -> set[str]:
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "--no-table-headers", "--quiet")
    return {line.strip() for line in out.splitlines() if line.strip()}


def test_released_mutex_names_leave_no_queue_and_tokens_keep_rising(
    short_expiry: int, broker: Broker, amqp_url: str, name: str, node: devbroker.NodeInfo
) -> None:
    names = [f"{name}-order-{i}" for i in range(60)]
    first = Mutex(broker, names[0]).acquire(timeout=5)
    assert first is not None
    first_token = first.fencing_token
    first.release()
    tokens: dict[str, list[int]] = {}
    with Broker(amqp_url) as other:
        # Every fourth name contended: a waiter makes its wake-up and sentinel queues.
        for i, n in enumerate(names[1:], 1):
            lease = Mutex(broker, n).acquire(timeout=5)
            assert lease is not None
            tokens[n] = [lease.fencing_token]
            if i % 4 == 0:
                got: list[Lease | None] = []
                waiter = threading.Thread(
                    target=lambda n=n, got=got: got.append(Mutex(other, n).acquire(timeout=40))
                )
                waiter.start()
                wait_until(
                    lambda n=n: queue_exists(broker, sentinel_queue(n, "mutex")), 10, "waiter"
                )
                lease.release()
                # Ceilings, not bounds: on a loaded CI lane (load 17) a 10 s wait ran out
                # while the waiter was still setting up.
                waiter.join(45)
                granted = got[0] if got else None
                assert granted is not None, "the waiter was not granted"
                tokens[n].append(granted.fencing_token)
                granted.release()
            else:
                lease.release()
    for n, seen in tokens.items():
        assert seen == sorted(set(seen)), f"{n}: tokens {seen} did not rise"

    def leftovers() -> set[str]:
        return {q for q in _queues(node) if q.startswith(name)}

    # Event: the broker deleted them (polled with a deadline of several expiry periods).
    wait_until(lambda: not leftovers(), 10 * EXPIRES_MS / 1000, "per-name queues to expire")
    counters = {q for q in _queues(node) if re.fullmatch(r"amqp-locks-fence-\d\d-g\d+", q)}
    assert fence_counter(broker, names[0]) in counters
    again = Mutex(broker, names[0]).acquire(timeout=5)
    assert again is not None
    assert again.fencing_token > first_token  # across its queues coming and going
    again.release()


def test_a_helper_queue_made_with_the_old_expiry_is_used_as_it_is(
    broker: Broker, amqp_url: str, name: str, node: devbroker.NodeInfo
) -> None:
    """An earlier release declared the sentinel queue with a 10-minute x-expires: our
    declaration (60 s) would get 406; the library declares it as it was made."""
    watch = sentinel_queue(name, "mutex")

    async def make_old() -> None:
        session = await broker.core.session()
        old = features.OLD_HELPER_EXPIRES_MS
        await session.call(
            watch,
            lambda ch: ch.queue_declare(watch, durable=True, arguments={"x-expires": old}),
        )

    broker.core.run(make_old())
    try:
        with Broker(amqp_url) as other:
            lease = Mutex(broker, name).acquire(timeout=5)
            assert lease is not None

            async def watchers() -> int:
                session = await other.core.session()
                return (await session.declare_passive_counts(watch))[1]

            # The holder's sentinel consumer: its declaration adapted to the old queue.
            wait_until(lambda: other.core.run(watchers()) >= 1, 10, "the holder's sentinel")
            box: list[Lease | None] = []
            waiter = threading.Thread(
                target=lambda: box.append(Mutex(other, name).acquire(timeout=10))
            )
            waiter.start()
            lease.release()
            waiter.join(15)
            granted = box[0] if box else None
            assert granted is not None and granted.fencing_token > lease.fencing_token
            granted.release()
    finally:
        devbroker.rabbitmqctl(node, "delete_queue", watch)


@pytest.fixture
def short_lock_expiry(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(features, "NAME_EXPIRES_MS", EXPIRES_MS)
    monkeypatch.setattr(features, "HELPER_EXPIRES_MS", EXPIRES_MS)
    yield EXPIRES_MS


def test_an_unused_read_write_lock_leaves_no_queue_and_is_made_again(
    short_lock_expiry: int, broker: Broker, name: str, node: devbroker.NodeInfo
) -> None:
    rw = ReadWriteLock(broker, name, readers=2)
    with rw.write_lock.acquire(timeout=5) as w:  # type: ignore[union-attr]
        first = w.fencing_token
    with rw.read_lock.acquire(timeout=5) as r:  # type: ignore[union-attr]
        assert r.fencing_token > first

    def leftovers() -> set[str]:
        return {q for q in _queues(node) if q.startswith(name)}

    wait_until(lambda: not leftovers(), 10 * EXPIRES_MS / 1000, "the lock's queues to expire")
    assert rw.status() is None
    with rw.write_lock.acquire(timeout=5) as w:  # type: ignore[union-attr]
        assert w.fencing_token > r.fencing_token
        assert rw.read_lock.acquire(blocking=False) is None
    st = rw.status()
    assert st is not None and (st.readers, st.free, st.writer) == (2, 2, False)


def test_a_read_write_lock_whose_writer_queue_expired_still_excludes(
    short_lock_expiry: int, broker: Broker, amqp_url: str, name: str, node: devbroker.NodeInfo
) -> None:
    """Only read for longer than the expiry: the writer queue goes, the readers queue (in
    use) stays. A writer then makes the turn again, exactly one, and waits for the
    reader; R comes from the readers queue (another R is refused, naming it)."""
    rw = ReadWriteLock(broker, name, readers=2)
    held = rw.read_lock.acquire(timeout=5)
    assert held is not None
    wait_until(
        lambda: f"{name}.rwlock-writer" not in _queues(node),
        10 * EXPIRES_MS / 1000,
        "the unused writer queue to expire",
    )
    assert f"{name}.rwlock-readers" in _queues(node)
    with Broker(amqp_url) as other:
        with pytest.raises(LockError, match="has 2 reader tokens, not 3"):
            ReadWriteLock(other, name, readers=3).write_lock.acquire(timeout=5)
        writer = ReadWriteLock(other, name)  # no R given: the lock's
        assert writer.write_lock.acquire(blocking=False) is None  # the reader holds
        box: list[Lease | None] = []
        t = threading.Thread(target=lambda: box.append(writer.write_lock.acquire(timeout=20)))
        t.start()
        wait_until(lambda: (rw.status() or _NoStatus()).writer, 10, "the writer's turn")
        st = rw.status()
        assert st is not None and st.readers == 2
        held.release()
        t.join(25)
        lease = box[0] if box else None
        assert lease is not None and lease.fencing_token > held.fencing_token
        assert rw.read_lock.acquire(blocking=False) is None  # the writer excludes readers
        lease.release()
    with rw.read_lock.acquire(timeout=5):  # type: ignore[union-attr]
        pass
    # one turn, not two: a second writer waits while the first holds
    ready, _ = broker.core.run(_counts(broker, f"{name}.rwlock-writer"))
    assert ready == 1


class _NoStatus:
    writer = False


async def _counts(broker: Broker, queue: str) -> tuple[int, int]:
    session = await broker.core.session()
    return await session.declare_passive_counts(queue)


def test_prepare_fences_makes_the_sixteen_shards_once(
    broker: Broker, node: devbroker.NodeInfo
) -> None:
    prepare_fences(broker)  # whatever earlier tests made, all 16 exist now
    markers = {q for q in _queues(node) if re.fullmatch(r"amqp-locks-fence-\d\d", q)}
    assert markers == {fence_marker(k) for k in range(FENCE_SHARDS)}
    assert prepare_fences(broker) == []  # idempotent: nothing made twice
    one_name = {fence_counter(broker, f"x{k}"): f"x{k}" for k in range(200)}
    assert len(one_name) == FENCE_SHARDS  # one current generation per shard
    assert [fence_messages(broker, n) for n in one_name.values()] == [1] * FENCE_SHARDS


def test_a_fence_generation_is_renewed_and_tokens_keep_rising(
    monkeypatch: pytest.MonkeyPatch, broker: Broker, amqp_url: str, name: str
) -> None:
    """Every RENEW_AFTER returns a take makes the shard's next generation and deletes the
    old one (so no quorum queue's log grows for ever): tokens keep rising across it, taken
    from two connections, and the shard keeps one counter message."""
    monkeypatch.setattr(fencing, "RENEW_AFTER", 5)
    before = fence_counter(broker, name)

    async def take(b: Broker) -> int:
        return await fencing.take_token(await b.core.session(), name)

    tokens: list[int] = []
    with Broker(amqp_url) as other:
        for i in range(40):
            b = other if i % 2 else broker
            tokens.append(b.core.run(take(b)))
    assert tokens == sorted(set(tokens)), tokens
    after = fence_counter(broker, name)
    assert int(after.rsplit("-g", 1)[1]) >= int(before.rsplit("-g", 1)[1]) + 2, "not renewed"
    assert fence_messages(broker, name) == 1  # never doubled nor lost
    assert broker.core.run(take(broker)) > tokens[-1]
