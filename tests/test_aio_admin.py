"""The asyncio admin twins await the admin core on the I/O loop: concurrent calls on one
event loop take no worker thread, never stall the loop, and cancel cleanly."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from amqp_locks import AdminLockTimeout, ConfigurationError, aio

T = TypeVar("T")


class Heartbeat:
    """A task ticking every 20 ms that records its longest gap and the most threads seen:
    an admin call that blocked the loop or ran on a worker thread shows up here."""

    def __init__(self) -> None:
        self.ticks = 0
        self.longest_gap = 0.0
        self.most_threads = threading.active_count()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.02)
            now = loop.time()
            self.ticks += 1
            self.longest_gap = max(self.longest_gap, now - last)
            self.most_threads = max(self.most_threads, threading.active_count())
            last = now


async def _watched(beat: Heartbeat, aw: Awaitable[T]) -> T:
    task = asyncio.ensure_future(beat.run())
    try:
        return await aw
    finally:
        task.cancel()


def test_aio_admin_calls_run_concurrently_without_threads(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            tokens = aio.TokenAdmin(broker, name)
            slots = aio.SemaphoreAdmin(broker, name + "s")
            assert await tokens.setup(2) == 2 and await slots.create(1) == 1
            permit = await aio.TokenSemaphore(broker, name).acquire(timeout=5)
            slot = await aio.PersistentSemaphore(broker, name + "s").acquire(timeout=5)
            assert permit is not None and slot is not None
            before = threading.active_count()  # the I/O thread is running by now
            beat = Heartbeat()
            loop = asyncio.get_running_loop()
            spans: dict[str, tuple[float, float]] = {}

            async def timed(what: str, aw: Awaitable[T]) -> T:
                start = loop.time()
                try:
                    return await aw
                finally:
                    spans[what] = (start, loop.time())

            # Both wait their whole timeout: the held token and the held slot never return.
            removed, still_held, status = await _watched(
                beat,
                asyncio.gather(
                    timed("remove", tokens.remove_permits(2, timeout=1.5)),
                    timed("wait", slots.wait_for_holders([1], timeout=1.5, interval=0.05)),
                    tokens.status(),
                ),
            )
            assert len(removed) == 1 and removed != [permit.number]
            assert still_held == [1]
            assert status.permits == 2
            # Concurrent, not one after the other: each waited its 1.5 s, and each was
            # still waiting when the other ended (run in turn, one would end 1.5 s late).
            (r0, r1), (w0, w1) = spans["remove"], spans["wait"]
            assert r1 - r0 >= 1.5 and w1 - w0 >= 1.5, spans
            assert abs(r1 - w1) < 1.5, spans
            assert beat.most_threads == before, "an admin call ran on a worker thread"
            # A call that blocked the loop would stop the 20 ms ticks for its whole 1.5 s;
            # a loaded machine only delays them (scheduling, not the library), so the
            # bounds leave room for that and stay well short of a blocked loop.
            assert beat.longest_gap < 1.0 and beat.ticks >= 10, (beat.longest_gap, beat.ticks)
            await permit.release()
            await slot.release()
            assert await slots.wait_for_holders([1], timeout=10) == []
            assert (await tokens.status()).permits == 1

    asyncio.run(main())


def test_aio_cancelled_admin_call_lets_the_admin_mutex_go(amqp_url: str, name: str) -> None:
    """Cancelling an awaiting remove_permits cancels its drain on the I/O loop, which
    releases the admin mutex at once (a worker thread would have held it for 60 s)."""

    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            admin = aio.TokenAdmin(broker, name, mutex_timeout=5)
            await admin.setup(1)
            ts = aio.TokenSemaphore(broker, name)
            async with ts.acquire(timeout=5) as permit:
                draining = asyncio.ensure_future(admin.remove_permits(1, timeout=60))
                # The drain consumes beside the holder while it waits for the held token.
                deadline = asyncio.get_running_loop().time() + 10
                while (await admin.status()).consumers != 2:
                    assert asyncio.get_running_loop().time() < deadline, "no drain consumer"
                    await asyncio.sleep(0.02)
                assert not draining.done()
                draining.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await draining
                assert await admin.add_permits(1) == [2]  # the mutex is free
                assert permit.held
            audit = await ts.audit(timeout=5)
            assert audit.ok and audit.seen == (1, 2)

    asyncio.run(main())


def test_aio_token_semaphore_admin_is_an_aio_token_admin(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            ts = aio.TokenSemaphore(broker, name, quorum=True, mutex_timeout=0.5)
            assert isinstance(ts.admin, aio.TokenAdmin)
            assert await ts.setup(2) == 2
            assert await ts.add_permits(1) == [3]
            assert await ts.remove_permits(1, timeout=1) in ([1], [2], [3])
            repaired = await ts.repair(timeout=2)
            assert repaired.ok and repaired.permits == 2
            async with aio.Broker(amqp_url) as other, aio.Mutex(other, name).acquire(timeout=5):
                with pytest.raises(AdminLockTimeout):
                    await ts.destroy()
            await ts.destroy()
            with pytest.raises(ConfigurationError):
                await ts.setup(0)

    asyncio.run(main())


def test_aio_semaphore_admin_twins(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            admin = aio.SemaphoreAdmin(broker, name)
            assert repr(admin) == f"aio.SemaphoreAdmin({name!r})"
            assert await admin.create(2) == 2
            assert await admin.add_slots(1) == 3
            assert await admin.max_slots() == 3
            lease = await aio.PersistentSemaphore(broker, name).acquire(timeout=5)
            assert lease is not None
            assert await admin.holders() == [lease.number]
            removal = await admin.remove_slots(3, wait=0)
            assert removal.still_held == (lease.number,)
            waiter = asyncio.ensure_future(admin.wait_for_holders([lease.number], timeout=30))
            done, _ = await asyncio.wait({waiter}, timeout=0.2)
            assert not done  # still waiting while the slot is held
            await lease.release()
            assert await asyncio.wait_for(waiter, 10) == []
            assert await admin.repair_fence(0) is False  # the fence message is there
            assert (await admin.destroy()).removed == ()

    asyncio.run(main())
