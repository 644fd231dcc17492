"""The lock objects as users of redis-py and filelock hold them: ``with Mutex(...) as lease``,
shared by threads, and a Broker inherited through ``fork()``. Against the real broker."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from collections.abc import Callable

import pytest

from amqp_locks import (
    Broker,
    LockError,
    LockTimeout,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
    TokenSemaphore,
    WrongProcess,
    aio,
)
from amqp_locks.lockobject import LockObject

from .threads import run_in_threads

Factory = Callable[..., LockObject]


@pytest.fixture(params=["mutex", "semaphore", "tokens"])
def make(request: pytest.FixtureRequest, broker: Broker, name: str) -> Factory:
    """A lock of one permit of each kind, built with the given wait settings."""
    if request.param == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
        return lambda b=broker, **kw: PersistentSemaphore(b, name, **kw)
    if request.param == "tokens":
        TokenSemaphore(broker, name).setup(permits=1)
        return lambda b=broker, **kw: TokenSemaphore(b, name, **kw)
    return lambda b=broker, **kw: Mutex(b, name, **kw)


def test_with_lock_holds_and_releases(make: Factory, amqp_url: str) -> None:
    lock = make()
    with Broker(amqp_url) as other:
        with lock as lease:
            assert lease.held and lease.fencing_token >= 0
            assert make(other).acquire(blocking=False) is None  # held by us
        assert lease.released
        again = make(other).acquire(timeout=10)  # free once the block ended
        assert again is not None
        again.release()


def test_with_lock_raises_lock_timeout(make: Factory, amqp_url: str) -> None:
    holder = make().acquire(timeout=10)
    assert holder is not None
    with Broker(amqp_url) as other:
        for lock in (make(other, timeout=0.3), make(other, blocking=False)):
            with pytest.raises(LockTimeout) as info, lock:
                pytest.fail("entered a lock that is held elsewhere")
            assert isinstance(info.value, TimeoutError) and lock.name in str(info.value)
    holder.release()


def test_one_lock_object_shared_by_threads(broker: Broker, name: str) -> None:
    """Per-thread leases: each thread's ``with`` releases its own, and they never overlap."""
    lock = Mutex(broker, name, timeout=30)
    inside = 0
    most = 0
    tokens: list[int] = []
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside, most
        for _ in range(3):
            with lock as lease:
                with guard:
                    inside += 1
                    most = max(most, inside)
                    tokens.append(lease.fencing_token)
                with guard:
                    inside -= 1

    errors = run_in_threads(worker, 4)
    assert not errors, errors
    assert most == 1 and len(tokens) == 12
    assert tokens == sorted(tokens) and len(set(tokens)) == 12  # one grant after another


def test_nested_with_on_a_mutex_is_refused(broker: Broker, name: str) -> None:
    lock = Mutex(broker, name, timeout=5)
    with lock, pytest.raises(LockError, match="already held by this thread"), lock:
        pass


def test_nested_with_on_a_semaphore_takes_a_second_slot(broker: Broker, name: str) -> None:
    SemaphoreAdmin(broker, name).create(2)
    sem = PersistentSemaphore(broker, name, timeout=5)
    with sem as first, sem as second:
        assert {first.number, second.number} == {1, 2}
    assert first.released and second.released


def _child(url: str, name: str, conn: object) -> None:
    """Runs in a forked child: uses the Broker and leases the parent made before the fork."""
    from multiprocessing.connection import Connection

    assert isinstance(conn, Connection)
    broker, held = _inherited
    out: dict[str, object] = {"pid": os.getpid()}
    try:
        # The parent's mutex stays the parent's: the child waits, then times out.
        out["parents_mutex"] = Mutex(broker, name).acquire(timeout=1)
        with Mutex(broker, name + "-child", timeout=10) as lease:
            out["own_mutex"] = lease.held and lease.verify()
        try:
            held.release()
        except WrongProcess as exc:
            out["release_parents"] = str(exc)
    except BaseException as exc:
        out["error"] = repr(exc)
    conn.send(out)


_inherited: tuple[Broker, object] | None = None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_a_forked_child_gets_its_own_connection(amqp_url: str, name: str) -> None:
    """gunicorn --preload / Celery prefork: a Broker used before fork() works in the child
    (it used to hang for ever), and the parent's leases stay the parent's."""
    global _inherited
    broker = Broker(amqp_url)
    held = Mutex(broker, name).acquire(timeout=10)
    assert held is not None
    _inherited = (broker, held)
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_child, args=(amqp_url, name, theirs))
    child.start()
    assert ours.poll(60), "the forked child hung"
    out = ours.recv()
    child.join(30)
    assert child.exitcode == 0 and "error" not in out, out
    assert out["parents_mutex"] is None and out["own_mutex"] is True
    assert "granted to process" in str(out["release_parents"])
    assert held.verify() and not held.lost.is_set()  # the child did not touch the parent's
    held.release()
    broker.close()
    _inherited = None


def test_async_with_lock_objects(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker, aio.Broker(amqp_url) as other:
            lock = aio.Mutex(broker, name, timeout=0.3)
            async with lock as lease:
                assert lease.held and not lease.lost.is_set()
                with pytest.raises(LockTimeout):
                    async with aio.Mutex(other, name, timeout=0.3):
                        pytest.fail("entered a held mutex")
            assert lease.released
            # One object shared by tasks: each task's `async with` releases its own lease.
            sem_admin = aio.SemaphoreAdmin(broker, name + "-s")
            await sem_admin.create(2)
            sem = aio.PersistentSemaphore(broker, name + "-s", timeout=10)
            numbers: list[int] = []
            gate = asyncio.Event()

            async def hold() -> None:
                async with sem as slot:
                    numbers.append(slot.number)
                    if len(numbers) == 2:
                        gate.set()
                    await gate.wait()  # both held at once, by two tasks

            await asyncio.wait_for(asyncio.gather(hold(), hold()), 30)
            assert sorted(numbers) == [1, 2]
            assert await sem_admin.holders() == []

    asyncio.run(main())
