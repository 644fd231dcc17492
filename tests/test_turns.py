"""Waiters of a mutex or persistent semaphore take turns: a freed lock goes to the waiter
the broker pushed the notice to, and nobody takes it in between (docs/protocol.md 5.2).

A subscribed waiter tries only when pushed (a notice, a sentinel) and on its own only as
the last resort, every ``Backoff.maximum``: a re-check of its own that lands between a
release and the woken waiter's attempt would take the lock out of turn."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from amqp_locks import Backoff, Broker, Lease, Mutex, PersistentSemaphore, SemaphoreAdmin, waiting
from amqp_locks.transport.wakeups import Waiter, Wake

KINDS = ["mutex", "semaphore"]


class Attempts:
    """Counts the attempts `acquire_loop` has made (answered), per Broker (by its I/O
    loop), and wakes a test waiting for a count."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}
        self.changed = threading.Condition()

    def seen(self, loop: int) -> None:
        with self.changed:
            self.count[loop] = self.count.get(loop, 0) + 1
            self.changed.notify_all()

    def wait_for(self, loop: int, n: int, timeout: float = 20.0) -> None:
        with self.changed:
            ok = self.changed.wait_for(lambda: self.count.get(loop, 0) >= n, timeout)
        assert ok, f"attempt {n} was never made ({self.count.get(loop, 0)} made)"


@pytest.fixture
def attempts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Attempts]:
    counter = Attempts()
    attempt = waiting._attempt

    async def counting(coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await attempt(coro)
        finally:  # counted once its answer is in
            counter.seen(id(asyncio.get_running_loop()))

    monkeypatch.setattr(waiting, "_attempt", counting)
    yield counter


def _lock(broker: Broker, name: str, kind: str, backoff: Backoff | None = None) -> Any:
    if kind == "mutex":
        return Mutex(broker, name, backoff=backoff)
    return PersistentSemaphore(broker, name, backoff=backoff)


def _loop_of(broker: Broker) -> int:
    """The Broker's I/O loop (connecting it first), which its attempts run on."""
    broker.connect()
    io = broker.core._io
    assert io is not None
    return id(io.loop)


@pytest.mark.parametrize("kind", KINDS)
def test_a_subscribed_waiter_tries_only_when_pushed(
    broker: Broker, amqp_url: str, name: str, kind: str, attempts: Attempts
) -> None:
    """Behind a holder, a waiter with a fast back-off (10 ms, doubling) tries once, once
    more after subscribing, and then not again until the release's notice: before, it
    re-checked at 10, 30, 70, 150, 310 ms ... and each re-check could take a freed lock
    from the waiter the notice went to."""
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
    held = _lock(broker, name, kind).acquire()
    assert held is not None
    with Broker(amqp_url) as other:
        waiter_loop = _loop_of(other)
        lock = _lock(other, name, kind, Backoff(initial=0.01, maximum=5.0))
        got: list[Lease | None] = []
        t = threading.Thread(target=lambda: got.append(lock.acquire(timeout=30)))
        t.start()
        attempts.wait_for(waiter_loop, 2)  # the first try, and the one after subscribing
        window = time.monotonic() + 0.5
        while time.monotonic() < window:  # the old back-off would have tried 5 more times
            assert attempts.count[waiter_loop] == 2, "a subscribed waiter tried unpushed"
            time.sleep(0.01)
        held.release()
        t.join(15)
        assert not t.is_alive() and got and got[0] is not None
        assert attempts.count[waiter_loop] == 3  # pushed by the notice, and granted
        got[0].release()


@pytest.mark.parametrize("kind", KINDS)
def test_waiters_are_served_in_the_order_they_queued(
    broker: Broker, amqp_url: str, name: str, kind: str, attempts: Attempts
) -> None:
    """Four waiters queue one after the other behind a holder; each holds the lock for
    a moment and releases it. They get it in the order they queued, every round."""
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
    held = _lock(broker, name, kind).acquire()
    assert held is not None
    order: list[int] = []
    loops: list[int] = []
    brokers = [Broker(amqp_url) for _ in range(4)]
    try:
        threads = []
        for i, b in enumerate(brokers):
            lock = _lock(b, name, kind, Backoff(initial=0.01, maximum=5.0))

            def take_turn(i: int = i, lock: Any = lock) -> None:
                lease = lock.acquire(timeout=30)
                assert lease is not None
                order.append(i)
                time.sleep(0.03)  # holding: the others' old re-checks fall in here
                lease.release()

            loop = _loop_of(b)
            loops.append(loop)
            t = threading.Thread(target=take_turn)
            t.start()
            threads.append(t)
            attempts.wait_for(loop, 2)  # subscribed (and tried again): queued
        held.release()
        for t in threads:
            t.join(30)
        assert order == [0, 1, 2, 3], f"attempts per waiter: {[attempts.count[x] for x in loops]}"
    finally:
        for b in brokers:
            b.close()


def test_a_wake_tells_a_sentinel_from_a_notice() -> None:
    """Only a sentinel (a holder died) makes a failed attempt worth repeating shortly;
    a clean release's notice says the lock was free when it was sent."""

    def message(routed_to: str, tag: int, body: bytes) -> Any:
        return SimpleNamespace(
            delivery=SimpleNamespace(delivery_tag=tag, routing_key=routed_to),
            channel=SimpleNamespace(is_closed=False),
            body=body,
        )

    async def run() -> list[Wake]:
        waiter = Waiter(sentinels="L-sem-watch")
        wakes = []
        await waiter.on_notice(message("L-sem-wakeups", 1, b"3"))
        wakes.append(waiter.take())
        await waiter.on_notice(message("L-sem-watch", 2, b"2"))
        await waiter.on_notice(message("L-sem-wakeups", 3, b"0"))
        wakes.append(waiter.take())
        wakes.append(waiter.take())  # nothing since: no tags, no sentinel
        return wakes

    notice, both, empty = asyncio.run(run())
    assert (len(notice.tags), notice.hint, notice.sentinel) == (1, 3, False)
    assert ([t for _, t in both.tags], both.hint, both.sentinel) == ([2, 3], None, True)
    assert (empty.tags, empty.hint, empty.sentinel) == ([], None, False)
