"""The public read-only status API (what `amqp-locks status` shows), on the real broker."""

from __future__ import annotations

import asyncio

from amqp_locks import (
    Broker,
    LockStatus,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
    TokenSemaphore,
    aio,
    lock_status,
)


def test_status_of_each_kind(broker: Broker, name: str) -> None:
    assert lock_status(broker, name) == [LockStatus(name, "absent", 0, 0, 0)]

    with Mutex(broker, name):
        assert lock_status(broker, name) == [LockStatus(name, "mutex", 1, 1, 0)]

    sem = f"{name}-sem"
    SemaphoreAdmin(broker, sem).create(3)
    with PersistentSemaphore(broker, sem, timeout=5) as slot:
        [st] = lock_status(broker, sem)
        assert (st.kind, st.capacity, st.held, st.free) == ("semaphore", 3, 1, 2)
        assert st.holders == (slot.number,)
        assert st.as_dict()["holders"] == [slot.number]

    tok = f"{name}-tok"
    TokenSemaphore(broker, tok).setup(permits=2)
    with TokenSemaphore(broker, tok, timeout=5):
        [st] = lock_status(broker, tok)
        assert (st.kind, st.capacity, st.held, st.free) == ("token", 2, 1, 1)
        assert st.consumers == 1 and st.waiting == 0


def test_status_from_asyncio(amqp_url: str, name: str) -> None:
    async def main() -> list[LockStatus]:
        async with aio.Broker(amqp_url) as b, aio.Mutex(b, name):
            return await aio.lock_status(b, name)

    assert asyncio.run(main()) == [LockStatus(name, "mutex", 1, 1, 0)]
