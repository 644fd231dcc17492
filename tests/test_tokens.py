"""The token semaphore (the RabbitMQ blog's design) against a real broker."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from amqp_locks import (
    Broker,
    ConfigurationError,
    InvalidName,
    Lease,
    LockError,
    TokenSemaphore,
    TokenSemaphoreNotFound,
)

from . import workers
from .test_semaphore_client import _spawn_holder


def _consumers(ts: TokenSemaphore) -> int:
    async def count() -> int:
        session = await ts.broker.core.session()
        return (await session.declare_passive_counts(f"{ts.name}.semaphore"))[1]

    return ts.broker.core.run(count())


def _wait_for(predicate, what: str, limit: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Poll the broker (each check is a round trip) until `predicate` holds."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


def test_setup_is_idempotent_and_counts(broker: Broker, name: str, quorum: bool) -> None:
    ts = TokenSemaphore(broker, name, quorum=quorum)
    assert ts.setup(3) == 3
    assert ts.setup(3) == 3  # twice: never doubles the tokens
    status = ts.status()
    assert (status.permits, status.ready, status.held) == (3, 3, 0)
    with pytest.raises(LockError, match="already has 3 permits"):
        ts.setup(4)
    assert ts.audit(timeout=2).ok
    ts.destroy()


def test_bad_input(broker: Broker, name: str) -> None:
    with pytest.raises(ConfigurationError):
        TokenSemaphore(broker, name).setup(0)
    with pytest.raises(ConfigurationError):
        TokenSemaphore(broker, name, priority=2**31)
    with pytest.raises(InvalidName):
        TokenSemaphore(broker, "x.mutex")  # cluster-mode Mutex("x")'s token semaphore
    with pytest.raises(TokenSemaphoreNotFound):
        TokenSemaphore(broker, name).acquire(blocking=False)
    with pytest.raises(TokenSemaphoreNotFound):
        TokenSemaphore(broker, name).acquire(timeout=1)


def test_binary_semaphore_acquire_release(broker: Broker, name: str, quorum: bool) -> None:
    ts = TokenSemaphore(broker, name, quorum=quorum)
    ts.setup(1)
    with ts.acquire(timeout=5) as permit:  # type: ignore[union-attr]
        assert permit.number == 1 and permit.verify()
        assert ts.acquire(blocking=False) is None
        assert ts.acquire(timeout=0.2) is None
    again = ts.acquire(timeout=5)
    assert again is not None and again.fencing_token > permit.fencing_token
    again.release()
    # release() returns before the broker's commit (docs/tokens.md): the token is back
    # within a round trip.
    _wait_for(lambda: ts.status().ready == 1, "the released token back in the queue")
    assert ts.status().held == 0


def test_highest_priority_waiter_gets_the_next_token(
    amqp_url: str, broker: Broker, name: str
) -> None:
    admin = TokenSemaphore(broker, name)
    admin.setup(1)
    holder = admin.acquire()
    assert holder is not None
    order: list[str] = []
    leases: dict[str, Lease] = {}

    def wait(label: str, priority: int, b: Broker) -> None:
        lease = TokenSemaphore(b, name, priority=priority).acquire(timeout=60)
        assert lease is not None
        order.append(label)
        leases[label] = lease

    with Broker(amqp_url) as b_low, Broker(amqp_url) as b_high:
        low = threading.Thread(target=wait, args=("low", 1, b_low))
        low.start()
        _wait_for(lambda: _consumers(admin) == 2, "the low-priority waiter")
        high = threading.Thread(target=wait, args=("high", 10, b_high))
        high.start()
        _wait_for(lambda: _consumers(admin) == 3, "the high-priority waiter")
        holder.release()
        high.join(30)
        assert order == ["high"]  # the later but higher-priority waiter won
        leases["high"].release()
        low.join(30)
        assert order == ["high", "low"]
        leases["low"].release()


def test_processes_contending_never_exceed_permits(
    amqp_url: str, broker: Broker, name: str
) -> None:
    permits, procs_n, rounds = 2, 6, 12
    TokenSemaphore(broker, name).setup(permits)
    counters = workers.contend_in_processes(amqp_url, name, permits, procs_n, rounds, kind="token")
    assert counters[3] == procs_n * rounds
    assert counters[2] == 0, f"{counters[2]} overlaps"
    assert counters[1] <= permits
    assert TokenSemaphore(broker, name).audit(timeout=2).ok


def test_kill_9_of_a_holder_hands_its_token_on(amqp_url: str, broker: Broker, name: str) -> None:
    ts = TokenSemaphore(broker, name)
    ts.setup(1)
    proc, permit_id, token = _spawn_holder(amqp_url, name, "token")
    assert permit_id == 1
    assert ts.acquire(blocking=False) is None
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    lease = ts.acquire(timeout=30)
    assert lease is not None and lease.number == 1 and lease.fencing_token > token
    lease.release()


def test_thousand_handoffs_lose_no_token(
    broker: Broker, amqp_url: str, name: str, quorum: bool
) -> None:
    ts = TokenSemaphore(broker, name, quorum=quorum)
    ts.setup(2)
    last: dict[int, int] = {}
    with Broker(amqp_url) as other:
        sems = [ts, TokenSemaphore(other, name)]
        for i in range(1000):
            lease = sems[i % 2].acquire(timeout=10)
            assert lease is not None
            assert lease.fencing_token > last.get(lease.number, 0)
            last[lease.number] = lease.fencing_token
            lease.release()
    # The last release returns before the broker's commit (docs/tokens.md).
    _wait_for(lambda: ts.status().ready == 2, "both tokens back in the queue")
    assert ts.status().permits == 2
    assert ts.audit(timeout=2).ok


def test_remove_permits_waits_for_held_tokens(broker: Broker, amqp_url: str, name: str) -> None:
    ts = TokenSemaphore(broker, name)
    ts.setup(2)
    with Broker(amqp_url) as holder_broker:
        holders = [TokenSemaphore(holder_broker, name).acquire() for _ in range(2)]
        removed: list[list[int]] = []
        remover = threading.Thread(target=lambda: removed.append(ts.remove_permits(2, timeout=60)))
        remover.start()
        _wait_for(lambda: _consumers(TokenSemaphore(holder_broker, name)) == 3, "the drain")
        for h in holders:
            assert h is not None
            h.release()
        remover.join(60)
    assert removed and sorted(removed[0]) == [1, 2]
    status = ts.status()
    assert (status.permits, status.ready) == (0, 0)
    assert ts.add_permits(1) == [3]


def test_deleted_queue_marks_the_permit_lost(broker: Broker, amqp_url: str, name: str) -> None:
    TokenSemaphore(broker, name).setup(1)
    with Broker(amqp_url) as other:
        lease = TokenSemaphore(other, name).acquire()
        assert lease is not None
        called = threading.Event()
        lease.on_lost(lambda _: called.set())
        TokenSemaphore(broker, name).destroy()
        assert lease.lost.wait(10) and called.wait(10)
        assert "cancelled" in (lease.lost_reason or "")


def test_cut_connection_marks_the_permit_lost_and_returns_the_token(
    proxy, broker: Broker, name: str
) -> None:  # type: ignore[no-untyped-def]
    ts = TokenSemaphore(broker, name)
    ts.setup(1)
    with Broker(proxy.url()) as b:
        lease = TokenSemaphore(b, name).acquire()
        assert lease is not None
        proxy.reset()
        assert lease.lost.wait(10)
    again = ts.acquire(timeout=10)
    assert again is not None
    again.release()


def test_timeouts_and_cancels_never_strand_a_token(
    broker: Broker, amqp_url: str, name: str
) -> None:
    ts = TokenSemaphore(broker, name)
    ts.setup(1)
    stop = threading.Event()

    def churn() -> None:
        with Broker(amqp_url) as b:
            mine = TokenSemaphore(b, name)
            while not stop.is_set():
                lease = mine.acquire(timeout=5)
                if lease is not None:
                    lease.release()

    churner = threading.Thread(target=churn)
    churner.start()
    with Broker(amqp_url) as b:
        racer = TokenSemaphore(b, name)
        got = 0
        for i in range(150):
            lease = (
                racer.acquire(timeout=0.001 * (i % 7)) if i % 3 else racer.acquire(blocking=False)
            )
            if lease is not None:
                got += 1
                lease.release()
    stop.set()
    churner.join(30)
    audit = ts.audit(timeout=3)
    assert audit.ok, audit
    assert ts.status().ready == 1


def test_quorum_tokens_keep_rising_after_destroy_and_setup(broker: Broker, name: str) -> None:
    ts = TokenSemaphore(broker, name, quorum=True)
    ts.setup(1)
    with ts.acquire(timeout=5) as first:  # type: ignore[union-attr]
        pass
    ts.destroy()
    ts.setup(1)  # a fresh token message: its delivery count starts at 0 again
    with ts.acquire(timeout=5) as second:  # type: ignore[union-attr]
        assert second.number == first.number
        assert second.fencing_token > first.fencing_token


def test_fencing_can_be_skipped_on_classic_queues(broker: Broker, name: str) -> None:
    """A holder without fencing returns the token as it came (a reject, no transaction):
    the next fencing holder still gets a token above every earlier one (a new epoch)."""
    TokenSemaphore(broker, name).setup(1)
    with TokenSemaphore(broker, name).acquire(timeout=5) as before:  # type: ignore[union-attr]
        pass
    fast = TokenSemaphore(broker, name, fencing=False)
    for _ in range(3):
        with fast.acquire(timeout=5) as permit:  # type: ignore[union-attr]
            assert permit.fencing_token == 0 and permit.number == 1
    with TokenSemaphore(broker, name).acquire(timeout=5) as fenced:  # type: ignore[union-attr]
        assert fenced.fencing_token > before.fencing_token
    audit = TokenSemaphore(broker, name).audit()
    assert audit.ok, audit


def _take_fence(broker: Broker, name: str) -> int:
    from amqp_locks.fencing import take_epoch

    async def take() -> int:  # the token semaphore's own fence: its epochs
        return await take_epoch(await broker.core.session(), name)

    return broker.core.run(take())


def test_polite_handoffs_carry_the_counter_without_the_fence(
    broker: Broker, amqp_url: str, name: str
) -> None:
    """A classic token released politely is published again with its counter raised, in
    one transaction: each next holder reads its fencing token off the message (exactly
    one more), and the fence queue is not touched at all."""
    ts = TokenSemaphore(broker, name)
    ts.setup(1)
    before = _take_fence(broker, name)
    with Broker(amqp_url) as other:
        tokens = []
        for i in range(10):
            permit = TokenSemaphore(other if i % 2 else broker, name).acquire(timeout=5)
            assert permit is not None
            tokens.append(permit.fencing_token)
            permit.release()
    assert tokens == list(range(tokens[0], tokens[0] + 10))
    assert _take_fence(broker, name) == before + 1  # nobody else read it meanwhile
    audit = ts.audit()
    assert audit.ok, audit


def test_a_redelivered_token_takes_a_fresh_epoch(amqp_url: str, broker: Broker, name: str) -> None:
    """A holder killed with the token: the broker returns it flagged redelivered, and the
    next holder's token is above anything the dead one can have used (a new epoch)."""
    ts = TokenSemaphore(broker, name)
    ts.setup(1)
    first = ts.acquire(timeout=5)
    assert first is not None
    first.release()
    proc, _, dead = _spawn_holder(amqp_url, name, "token")
    assert dead == first.fencing_token + 1  # the carried counter, one more
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    lease = ts.acquire(timeout=30)
    assert lease is not None
    assert lease.fencing_token >> 32 > dead >> 32  # a new epoch from the fence queue
    lease.release()
    again = ts.acquire(timeout=5)
    assert again is not None and again.fencing_token == lease.fencing_token + 1
    again.release()
