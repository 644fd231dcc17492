"""How acquire is called: the asyncio ``acquire()`` is a coroutine asyncio takes anywhere
(``create_task``, ``TaskGroup``, ``wait_for``, ``gather``) and still an ``async with``
form; ``acquire(blocking=False, timeout=X)`` is a ValueError, as for ``threading.Lock``,
on every primitive, sync and asyncio."""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from amqp_locks import (
    Broker,
    LockTimeout,
    Mutex,
    PersistentSemaphore,
    ReadWriteLock,
    SemaphoreAdmin,
    TokenSemaphore,
    aio,
)

KINDS = ("mutex", "semaphore", "token", "read", "write")


def sync_lock(kind: str, broker: Broker, name: str) -> Any:
    if kind == "mutex":
        return Mutex(broker, name)
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
        return PersistentSemaphore(broker, name)
    if kind == "token":
        sem = TokenSemaphore(broker, name)
        sem.setup(1)
        return sem
    rw = ReadWriteLock(broker, name)
    return rw.read_lock if kind == "read" else rw.write_lock


async def aio_lock(kind: str, broker: aio.Broker, name: str) -> Any:
    if kind == "mutex":
        return aio.Mutex(broker, name)
    if kind == "semaphore":
        await aio.SemaphoreAdmin(broker, name).create(1)
        return aio.PersistentSemaphore(broker, name)
    if kind == "token":
        sem = aio.TokenSemaphore(broker, name)
        await sem.setup(1)
        return sem
    rw = aio.ReadWriteLock(broker, name)
    return rw.read_lock if kind == "read" else rw.write_lock


@pytest.mark.parametrize("kind", KINDS)
def test_sync_nonblocking_acquire_with_a_timeout_is_a_value_error(
    kind: str, broker: Broker, name: str
) -> None:
    lock = sync_lock(kind, broker, name)
    for timeout in (5, 0, 0.5):
        with pytest.raises(ValueError, match="blocking=False"):
            lock.acquire(blocking=False, timeout=timeout)
    # threading.Lock's "no timeout" (-1) is accepted, blocking or not.
    lease = lock.acquire(blocking=False, timeout=-1)
    assert lease is not None
    lease.release(wait=True)
    lease = lock.acquire(timeout=-1)
    assert lease is not None
    lease.release(wait=True)
    if kind in ("mutex", "semaphore", "token"):  # what `with lock:` waits: the same rule
        with pytest.raises(ValueError):
            type(lock)(broker, name, blocking=False, timeout=5)


def test_threading_lock_refuses_the_same() -> None:
    """The rule followed (documented behaviour of the standard library)."""
    with pytest.raises(ValueError):
        threading.Lock().acquire(blocking=False, timeout=5)


@pytest.mark.parametrize("kind", KINDS)
def test_aio_nonblocking_acquire_with_a_timeout_is_a_value_error(
    kind: str, amqp_url: str, name: str
) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            lock = await aio_lock(kind, broker, name)
            with pytest.raises(ValueError, match="blocking=False"):
                await lock.acquire(blocking=False, timeout=5)
            lease = await lock.acquire(blocking=False, timeout=-1)
            assert lease is not None
            await lease.release(wait=True)

    asyncio.run(main())


def test_aio_acquire_is_a_coroutine_for_create_task_taskgroup_wait_for_gather(
    amqp_url: str, name: str
) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            await aio.SemaphoreAdmin(broker, name).create(2)
            sem = aio.PersistentSemaphore(broker, name)
            call = sem.acquire(timeout=5)
            assert asyncio.iscoroutine(call)
            # 3.12+ marks it (inspect.markcoroutinefunction); 3.11 has no marker.
            assert inspect.iscoroutinefunction(sem.acquire) == (sys.version_info >= (3, 12))
            first = await asyncio.create_task(call)
            assert first is not None
            async with asyncio.TaskGroup() as tg:
                second_task = tg.create_task(sem.acquire(timeout=5))
            second = second_task.result()
            assert second is not None
            assert {first.number, second.number} == {1, 2}
            # Both slots held: wait_for cancels the wait at its own timeout.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sem.acquire(), 0.5)
            await first.release(wait=True)
            third = await asyncio.wait_for(sem.acquire(), 10)
            assert third is not None and third.number == first.number
            assert await sem.acquire(blocking=False) is None
            await asyncio.gather(second.release(wait=True), third.release(wait=True))
            leases = await asyncio.gather(sem.acquire(timeout=5), sem.acquire(timeout=5))
            assert sorted(lease.number for lease in leases if lease is not None) == [1, 2]
            for lease in leases:
                assert lease is not None
                await lease.release(wait=True)

    asyncio.run(main())


def test_aio_acquire_keeps_its_async_with_forms(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            mutex = aio.Mutex(broker, name, timeout=0.2)
            async with mutex.acquire(timeout=5) as lease:
                assert lease.held
                assert await mutex.locked()
                with pytest.raises(LockTimeout):
                    async with mutex:  # the lock's own timeout (0.2 s)
                        pass
                with pytest.raises(LockTimeout):
                    async with mutex.acquire(blocking=False):
                        pass
            assert lease.released
            async with mutex as again:
                assert again.held
            assert again.released

    asyncio.run(main())


def test_an_acquire_never_awaited_costs_nothing(
    amqp_url: str, name: str, recwarn: pytest.WarningsRecorder
) -> None:
    """The coroutine is made on first use: no "never awaited" warning, nothing taken."""

    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            mutex = aio.Mutex(broker, name)
            unused: Callable[[], Any] = mutex.acquire
            unused()
            assert not await mutex.locked()

    asyncio.run(main())
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
