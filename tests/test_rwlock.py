"""The read-write lock against a real broker: sharing, exclusion, starvation, crashes."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from amqp_locks import (
    Broker,
    ConfigurationError,
    InvalidName,
    Lease,
    LockError,
    LockTimeout,
    ReadWriteLock,
    aio,
    lock_status,
)
from amqp_locks.rwlock import readers_queue, writer_queue

from . import rwlock_workers as w
from .conftest import on_session, queue_counts
from .spawn import spawn_held


def _consumers(broker: Broker, queue: str) -> int:
    return queue_counts(broker, queue)[1]


def _wait_for(predicate: Any, what: str, limit: float = 20.0) -> None:
    """Re-check `predicate` (each check is a broker round trip) until it holds."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


def _spawn_holder(url: str, name: str, mode: str) -> tuple[subprocess.Popen[str], int]:
    p, numbers = spawn_held("tests.rwlock_workers", url, name, mode)
    return p, numbers[0]


def _acquired(lease: Lease | None) -> Lease:
    assert lease is not None
    return lease


# --- input ------------------------------------------------------------------------------


def test_bad_input(broker: Broker, name: str) -> None:
    for bad in ("", "amq.x", "a\nb", "x.rwlock", "x.mutex", "é" * 256):
        with pytest.raises(InvalidName):
            ReadWriteLock(broker, bad)
    for readers in (0, -1, True, 1.5, 10_001):
        with pytest.raises(ConfigurationError):
            ReadWriteLock(broker, name, readers=readers)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        ReadWriteLock(broker, name, blocking=False, timeout=1)
    with pytest.raises(ConfigurationError):
        ReadWriteLock(broker, name).read_lock.acquire(timeout=-2)


def test_setup_is_idempotent_and_refuses_another_count(broker: Broker, name: str) -> None:
    rw = ReadWriteLock(broker, name, readers=3)
    assert rw.status() is None
    assert rw.setup() == 3
    assert rw.setup() == 3
    assert ReadWriteLock(broker, name).setup() == 3  # no count given: the lock's own
    with pytest.raises(LockError, match="3 reader tokens"):
        ReadWriteLock(broker, name, readers=4).setup()
    st = rw.status()
    assert st is not None and (st.readers, st.free, st.writer, st.held) == (3, 3, False, 0)


# --- sharing and exclusion --------------------------------------------------------------


def test_readers_share_and_a_writer_excludes(broker: Broker, amqp_url: str, name: str) -> None:
    rw = ReadWriteLock(broker, name, readers=4)  # set up by the first acquire
    with Broker(amqp_url) as other:
        orw = ReadWriteLock(other, name)
        r1 = _acquired(rw.read_lock.acquire())
        r2 = _acquired(orw.read_lock.acquire(timeout=5))
        assert {r1.number, r2.number} <= {1, 2, 3, 4} and r1.number != r2.number
        assert orw.write_lock.acquire(blocking=False) is None
        assert orw.write_lock.acquire(timeout=0.3) is None
        r1.release()
        assert orw.write_lock.acquire(timeout=0.3) is None  # r2 still reads
        r2.release()
        wl = _acquired(orw.write_lock.acquire(timeout=5))
        assert wl.number == 0 and wl.fencing_token > max(r1.fencing_token, r2.fencing_token)
        assert rw.read_lock.acquire(blocking=False) is None
        assert rw.write_lock.acquire(timeout=0.3) is None
        st = rw.status()
        assert st is not None and st.writer and st.free == 0
        wl.release()
        again = _acquired(rw.read_lock.acquire(timeout=5))
        assert again.fencing_token > wl.fencing_token
        again.release()
    _wait_for(lambda: (s := rw.status()) is not None and s.free == 4, "all tokens back")


def test_with_blocks_and_lock_timeout(broker: Broker, name: str) -> None:
    # The holds get 10 s: a free lock's acquire takes a few round trips, which a busy
    # machine can stretch past a short timeout. The 0.2 s is for the wait that must fail.
    rw = ReadWriteLock(broker, name, readers=2, timeout=10)
    rw.setup()
    with rw.write_lock as lease:
        assert lease.held
        with pytest.raises(LockTimeout), ReadWriteLock(broker, name, blocking=False).read_lock:
            pass
        with pytest.raises(LockTimeout), ReadWriteLock(broker, name, timeout=0.2).read_lock:
            pass
        with pytest.raises(LockError, match="already held"), rw.write_lock:
            pass
    with rw.read_lock as a:
        b = _acquired(rw.read_lock.acquire(timeout=5))  # another thread could hold it too
        b.release()
        assert a.held
    assert lease.released and a.released


def _run_plan(
    amqp_url: str,
    name: str,
    plan: list[tuple[bool, int, float]],
    quorum: bool,
    together: bool = False,
) -> Any:
    """One spawned `rwlock_workers.contend` process per (shared, rounds, hold) of `plan`,
    all started together (`together`: meeting at a barrier once every reader holds its
    first grant); the shared counters they recorded in, once all exited cleanly."""
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    counters = ctx.Array("i", 6, lock=False)
    barrier = ctx.Barrier(len(plan)) if together else None
    procs = [
        ctx.Process(
            target=w.contend,
            args=(amqp_url, name, shared, n, hold, lock, counters, quorum, None, barrier),
        )
        for shared, n, hold in plan
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return counters


def test_processes_never_overlap_a_writer(
    amqp_url: str, broker: Broker, name: str, quorum: bool
) -> None:
    """Readers and writers in separate processes; every hold recorded in shared memory. The
    four readers first hold at once (a barrier), so sharing is shown on every run, not
    only when the spawned processes happen to start close together."""
    ReadWriteLock(broker, name, readers=8, quorum=quorum).setup()
    plan = [(True, 12, 0.02)] * 4 + [(False, 6, 0.01)] * 2
    counters = _run_plan(amqp_url, name, plan, quorum, together=True)
    assert counters[w.VIOLATIONS] == 0, f"{counters[w.VIOLATIONS]} overlaps with a writer"
    assert (counters[w.READ_GRANTS], counters[w.WRITE_GRANTS]) == (48, 12)
    assert counters[w.MOST_READERS] == 4, "the four readers never held at the same time"
    st = ReadWriteLock(broker, name).status()
    _wait_for(
        lambda: (s := ReadWriteLock(broker, name).status()) is not None and s.free == 8, "tokens"
    )
    assert st is not None and st.readers == 8


# --- starvation -------------------------------------------------------------------------


@contextlib.contextmanager
def _contending(
    amqp_url: str, name: str, *, shared: bool, hold: float, processes: int
) -> Iterator[tuple[Any, Any]]:
    """``processes`` spawned workers take the read (``shared``) or write half back to back,
    holding each grant ``hold`` seconds, until the block ends; yields the lock and the
    shared counters they record in (rwlock_workers)."""
    ctx = multiprocessing.get_context("spawn")
    lock, stop = ctx.Lock(), ctx.Event()
    counters = ctx.Array("i", 6, lock=False)
    procs = [
        ctx.Process(
            target=w.contend,
            args=(amqp_url, name, shared, 10**6, hold, lock, counters, False, stop),
        )
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        yield lock, counters
    finally:
        stop.set()
        for p in procs:
            p.join(60)


def test_a_waiting_writer_goes_ahead_of_waiting_readers(
    broker: Broker, amqp_url: str, name: str
) -> None:
    """Two readers hold both tokens; reader B waits, then a writer, then reader D. Each
    freed token is pushed to the writer (consumer priority), not to B, which waited longer,
    nor to D; when the writer releases, B and D get in together."""
    rw = ReadWriteLock(broker, name, readers=2)
    a, c = _acquired(rw.read_lock.acquire()), _acquired(rw.read_lock.acquire())
    got: dict[str, Lease | None] = {}
    with Broker(amqp_url) as b1, Broker(amqp_url) as b2, Broker(amqp_url) as b3:

        def start(key: str, broker_: Broker, shared: bool, consumers: int) -> threading.Thread:
            orw = ReadWriteLock(broker_, name)
            side = orw.read_lock if shared else orw.write_lock
            t = threading.Thread(target=lambda: got.__setitem__(key, side.acquire(timeout=30)))
            t.start()
            _wait_for(lambda: _consumers(broker, readers_queue(name)) == consumers, key)
            return t

        tb = start("B", b1, True, 3)  # a, c, B
        tw = start("W", b2, False, 4)  # ... and the writer with the turn
        td = start("D", b3, True, 5)
        assert rw.read_lock.acquire(blocking=False) is None
        a.release()
        c.release()
        tw.join(30)
        writer = _acquired(got["W"])
        assert "B" not in got and "D" not in got, "a reader went ahead of the waiting writer"
        writer.release()
        tb.join(30)
        td.join(30)
        for key in "BD":
            lease = _acquired(got[key])
            assert lease.fencing_token > writer.fencing_token
            lease.release()


def test_writer_is_not_starved_by_a_stream_of_readers(
    amqp_url: str, broker: Broker, name: str
) -> None:
    """Four processes read in 0.3 s holds on two reader tokens, so readers always hold and
    wait; a writer still gets in, and while it waits no reader is let in that was not
    already on its way (at most one grant per reader process)."""
    ReadWriteLock(broker, name, readers=2).setup()
    with _contending(amqp_url, name, shared=True, hold=0.3, processes=4) as (lock, counters):
        _wait_for(lambda: counters[w.READ_GRANTS] >= 6, "the readers going", 60)
        before = counters[w.READ_GRANTS]
        lease = _acquired(ReadWriteLock(broker, name).write_lock.acquire(timeout=30))
        with lock:
            granted_meanwhile = counters[w.READ_GRANTS] - before
            readers_now = counters[w.READERS_NOW]
        lease.release()
    assert readers_now == 0
    assert granted_meanwhile <= 4, f"{granted_meanwhile} readers went ahead of a waiting writer"
    assert counters[w.VIOLATIONS] == 0


def test_readers_are_not_starved_by_a_stream_of_writers(
    amqp_url: str, broker: Broker, name: str
) -> None:
    """Two processes write back to back; a reader gets in at the next hand-off: at most
    one writer is granted between its request and its grant."""
    ReadWriteLock(broker, name, readers=8).setup()
    rw = ReadWriteLock(broker, name)
    with _contending(amqp_url, name, shared=False, hold=0.1, processes=2) as (lock, counters):
        _wait_for(lambda: counters[w.WRITE_GRANTS] >= 4, "the writers going", 60)
        ahead = []
        for _ in range(3):
            before = counters[w.WRITE_GRANTS]
            lease = _acquired(rw.read_lock.acquire(timeout=30))
            with lock:
                ahead.append(counters[w.WRITE_GRANTS] - before)
                writing = counters[w.WRITERS_NOW]
            lease.release()
            assert writing == 0
    assert max(ahead) <= 1, f"writers granted ahead of a waiting reader: {ahead}"
    assert counters[w.VIOLATIONS] == 0


# --- crashes and losses -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["read", "write"])
def test_kill_9_of_a_holder_frees_it(amqp_url: str, broker: Broker, name: str, mode: str) -> None:
    rw = ReadWriteLock(broker, name)
    rw.setup()
    proc, token = _spawn_holder(amqp_url, name, mode)
    assert rw.write_lock.acquire(blocking=False) is None
    waiter: list[Lease | None] = []
    t = threading.Thread(target=lambda: waiter.append(rw.write_lock.acquire(timeout=30)))
    t.start()  # waits as a consumer: the dead holder's tokens are pushed to it
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    t.join(30)
    lease = _acquired(waiter[0])
    assert lease.fencing_token > token
    lease.release()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_cut_connection_marks_the_hold_lost(
    proxy: Any, broker: Broker, name: str, mode: str
) -> None:
    rw = ReadWriteLock(broker, name)
    with Broker(proxy.url()) as b:
        orw = ReadWriteLock(b, name)
        lease = _acquired((orw.read_lock if mode == "read" else orw.write_lock).acquire(timeout=10))
        called = threading.Event()
        lease.on_lost(lambda _: called.set())
        proxy.reset()
        assert lease.lost.wait(10) and called.wait(10)
        assert not lease.verify()
    again = _acquired(rw.write_lock.acquire(timeout=10))
    again.release()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_destroy_marks_holders_lost(broker: Broker, amqp_url: str, name: str, mode: str) -> None:
    rw = ReadWriteLock(broker, name, readers=2)
    with Broker(amqp_url) as other:
        orw = ReadWriteLock(other, name)
        lease = _acquired((orw.read_lock if mode == "read" else orw.write_lock).acquire(timeout=10))
        assert lease.verify()
        rw.destroy()
        assert lease.lost.wait(10)
        assert "cancelled" in (lease.lost_reason or "")
        lease.release()  # harmless after a loss
    assert rw.status() is None
    fresh = _acquired(rw.write_lock.acquire(timeout=10))  # set up again on first use
    assert fresh.fencing_token > lease.fencing_token  # the fence queue was kept
    fresh.release()


# --- fencing, timeouts ------------------------------------------------------------------


def test_fencing_tokens_rise_across_grants(broker: Broker, amqp_url: str, name: str) -> None:
    rw = ReadWriteLock(broker, name, readers=3)
    seen: list[int] = []
    with Broker(amqp_url) as other:
        orw = ReadWriteLock(other, name)
        for i in range(20):
            side = [rw.read_lock, orw.read_lock, rw.write_lock, orw.write_lock][i % 4]
            lease = _acquired(side.acquire(timeout=10))
            seen.append(lease.fencing_token)
            lease.release()
        a, b = _acquired(rw.read_lock.acquire()), _acquired(orw.read_lock.acquire())
        seen += [a.fencing_token, b.fencing_token]
        a.release()
        b.release()
    assert seen == sorted(set(seen)), seen
    unfenced = ReadWriteLock(broker, name, fencing=False)
    lease = _acquired(unfenced.write_lock.acquire(timeout=10))
    assert lease.fencing_token == 0
    lease.release()


def test_timeouts_never_strand_a_token(broker: Broker, amqp_url: str, name: str) -> None:
    rw = ReadWriteLock(broker, name, readers=2)
    rw.setup()
    stop = threading.Event()

    def churn() -> None:
        with Broker(amqp_url) as b:
            orw = ReadWriteLock(b, name)
            i = 0
            while not stop.is_set():
                side = orw.write_lock if i % 3 == 0 else orw.read_lock
                lease = side.acquire(timeout=30)
                assert lease is not None
                lease.release()
                i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        for i in range(60):
            side = rw.write_lock if i % 2 else rw.read_lock
            lease = side.acquire(timeout=0.005 * (i % 5))
            if lease is not None:
                lease.release()
    finally:
        stop.set()
        t.join(60)
    lease = _acquired(rw.write_lock.acquire(timeout=10))  # all 2 tokens and the turn exist
    lease.release()
    _wait_for(lambda: (s := rw.status()) is not None and s.free == 2 and not s.writer, "tokens")
    assert _consumers(broker, writer_queue(name)) == 0


def test_status_lists_the_rwlock(broker: Broker, name: str) -> None:
    rw = ReadWriteLock(broker, name, readers=5)
    lease = _acquired(rw.read_lock.acquire())
    found = lock_status(broker, name)
    kinds = {st.kind: st for st in found}
    assert "rwlock" in kinds, found
    st = kinds["rwlock"]
    assert (st.capacity, st.held, st.free) == (5, 1, 4)
    lease.release()


# --- asyncio ----------------------------------------------------------------------------


def test_aio_readers_share_and_writer_excludes(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url) as broker:
            rw = aio.ReadWriteLock(broker, name, readers=4)
            assert await rw.setup() == 4
            async with rw.read_lock as a, rw.read_lock.acquire() as b:
                assert a.number != b.number
                assert await rw.write_lock.acquire(blocking=False) is None
            async with rw.write_lock as wl:
                assert wl.held and wl.fencing_token > b.fencing_token
                assert await rw.read_lock.acquire(timeout=0.2) is None
            # a cancelled waiter leaves nothing behind
            async with rw.write_lock:
                task = asyncio.ensure_future(rw.read_lock.acquire())

                async def consumers() -> int:
                    session = await broker.core.session()
                    return (await session.declare_passive_counts(readers_queue(name)))[1]

                # the writer and our waiter
                while await asyncio.wrap_future(broker.core.submit(consumers())) < 2:
                    pass
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            lease = await rw.write_lock.acquire(timeout=10)
            assert lease is not None
            await lease.release()
            st = await rw.status()
            assert st is not None and st.readers == 4
            await rw.destroy()
            assert await rw.status() is None

    asyncio.run(main())


def test_holders_and_locked_name_readers_and_the_writer(amqp_url: str, name: str) -> None:
    """Holder records (issue 14) for a read-write lock: one per read hold (its reader
    token), one for a write hold (number 0, though it holds every token)."""
    with (
        Broker(amqp_url, holder_id="reader-a") as a,
        Broker(amqp_url, holder_id="reader-b") as b,
        Broker(amqp_url, holder_id="writer") as c,
    ):
        rw_a, rw_b, rw_c = (ReadWriteLock(x, name, readers=4) for x in (a, b, c))
        assert not rw_c.locked() and rw_c.holders(timeout=0.5) == []
        with rw_a.read_lock as ra, rw_b.read_lock as rb:
            got = rw_c.holders(timeout=10)  # returns once both answered (their binds lag)
            assert sorted(r.holder_id or "" for r in got) == ["reader-a", "reader-b"]
            assert {r.number for r in got} == {ra.number, rb.number}
            assert all(r.kind == "rwlock" and r.pid == os.getpid() for r in got)
            assert rw_c.locked()
        with rw_c.write_lock as wl:
            got = rw_a.holders(timeout=10)
            assert [(r.holder_id, r.number, r.fencing_token) for r in got] == [
                ("writer", 0, wl.fencing_token)
            ]
            # A plain release returns before the broker has the turn back
            # (docs/operations.md); what is asserted next needs its word.
            wl.release(wait=True)
        assert not rw_a.locked()


def test_aio_holders_of_a_read_write_lock(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url, holder_id="aio-reader") as broker:
            rw = aio.ReadWriteLock(broker, name, readers=2)
            assert await rw.setup() == 2
            async with rw.read_lock as lease:
                assert await rw.locked()
                got = await rw.holders(timeout=10)  # the record's bind lags the grant
                assert [r.holder_id for r in got] == ["aio-reader"]
                st = await rw.status()
                assert st is not None and st.readers == 2
                # A plain release's reject is not answered: the broker may serve the
                # status read below first (docs/operations.md). Ask for its word.
                await lease.release(wait=True)
            assert not await rw.locked()
            await rw.destroy()
            assert await rw.status() is None

    asyncio.run(main())


# --- first use ----------------------------------------------------------------------------


@pytest.mark.parametrize("quorum", [False, True], ids=["classic", "quorum"])
def test_processes_racing_on_a_fresh_name_make_it_once(
    amqp_url: str, broker: Broker, name: str, quorum: bool
) -> None:
    """Readers and writers in separate processes start together on a name nobody set up:
    each missing queue is made by one test-and-set, so the lock has exactly R (64) reader
    tokens and one turn afterwards, no hold overlapped a writer (counted), and no
    administration mutex was taken (its sentinel queue would linger for a minute)."""
    counters = _run_plan(amqp_url, name, [(True, 5, 0.01)] * 3 + [(False, 3, 0.01)] * 2, quorum)
    assert counters[w.VIOLATIONS] == 0, f"{counters[w.VIOLATIONS]} overlaps with a writer"
    assert (counters[w.READ_GRANTS], counters[w.WRITE_GRANTS]) == (15, 6)

    _wait_for(lambda: queue_counts(broker, readers_queue(name)) == (64, 0), "64 tokens")
    _wait_for(lambda: queue_counts(broker, writer_queue(name)) == (1, 0), "one turn")
    st = ReadWriteLock(broker, name).status()
    assert st is not None and (st.readers, st.free, st.writer) == (64, 64, False)

    watch = f"{name}.rwlock-mutex-watch"
    assert not on_session(broker, lambda session: session.exists_passive(watch))
    ReadWriteLock(broker, name).destroy()


def test_a_lock_made_with_another_r_is_refused_by_name(broker: Broker, name: str) -> None:
    """R is carried by the readers queue's stamp: a user giving another R is refused with
    both counts named; one giving none takes the lock's."""
    with ReadWriteLock(broker, name, readers=3).read_lock.acquire(timeout=10) as lease:
        assert lease is not None
        with pytest.raises(LockError, match="has 3 reader tokens, not 5"):
            ReadWriteLock(broker, name, readers=5).write_lock.acquire(timeout=5)
    assert ReadWriteLock(broker, name).setup() == 3
    st = ReadWriteLock(broker, name).status()
    assert st is not None and st.readers == 3
    with ReadWriteLock(broker, name).write_lock.acquire(timeout=10) as lease:
        assert lease is not None and lease.number == 0
    ReadWriteLock(broker, name).destroy()


def test_a_lock_of_the_previous_format_keeps_its_r(broker: Broker, name: str) -> None:
    """A readers queue whose x-max-length is R itself (the release before stamps): its R
    is read as it is, and writers and readers use it."""
    from amqp_locks.rwlock.admin import lock_arguments

    async def make_old() -> None:
        session = await broker.core.session()
        args = {**lock_arguments(session, False, True), "x-max-length": 2}
        await session.declare(readers_queue(name), durable=True, arguments=args)
        for k in (1, 2):
            await session.publish("", readers_queue(name), str(k).encode(), persistent=True)

    broker.core.run(make_old())
    assert ReadWriteLock(broker, name).setup() == 2
    with ReadWriteLock(broker, name).write_lock.acquire(timeout=10) as lease:
        assert lease is not None
        st = ReadWriteLock(broker, name).status()
        assert st is not None and (st.readers, st.free, st.writer) == (2, 0, True)
    ReadWriteLock(broker, name).destroy()
