"""A first-use token queue that lost tokens at its creation is healed by its waiters
(tokens/heal.py): issue 36's case 1, and the crash points of a creation.

A creation is one write: the stamped declaration, then one publish (method, header and
body frames) per token. The broker handles a channel's frames in order, so a creator cut
off after any frame leaves one of these states: no queue, or the queue with the first `j`
of its `K` tokens (a publish missing its body frame is dropped). Each is built here on a
real broker, and the name must grant all its permits again within the stated bound, never
more than `K` at once, with exactly `K` tokens afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from amqp_locks import Broker, Mutex, TokenSemaphore, stamps
from amqp_locks.names import quorum_mutex_name, token_queue, token_waiting_queue
from amqp_locks.tokens import fresh, heal
from amqp_locks.tokens.message import token_properties
from amqp_locks.transport import features
from amqp_locks.transport.quorum_guard import MIN_MARGIN

from . import waiting
from .conftest import heal_bound
from .conftest import queue_counts as counts

#: The lock delay of these tests' brokers (s): the heal period is this + HEAL_MARGIN. Its
#: guard bound (heal_broker) is 3 s: at 1 s, then 2 s, a loaded CI lane (4.3.6) dropped a
#: healthy holder.
LOCK_DELAY = 4.0
#: What a heal may take with LOCK_DELAY (conftest.heal_bound: heal.py's bound from the
#: first waiter's arrival), read at import, before quick_heal shortens the registration
#: and the jitter; plus a generous allowance for a loaded 2-core machine.
BOUND = heal_bound(LOCK_DELAY)
ALLOWANCE = 6.0

pytestmark = pytest.mark.usefixtures("quick_heal")


def heal_broker(url: str) -> Broker:
    """A cluster-mode Broker with the tests' lock delay and the longest guard bound it
    allows (`lock_delay - MIN_MARGIN`, 3 s): these tests hold tokens for up to ~20 s while
    the queue they hold is healed beside them, and rehearsal 19 (4.3.6, four CI lanes on
    two cores) saw the default bound (half the delay, 2 s) pass without an answer to a
    healthy holder's check; the guard's bound is tested in test_quorum_guard.py."""
    return Broker(
        url,
        cluster=True,
        heartbeat=5.0,
        lock_delay=LOCK_DELAY,
        quorum_timeout=LOCK_DELAY - MIN_MARGIN,
    )


@pytest.fixture
def cluster_broker(amqp_url: str) -> Iterator[Broker]:
    b = heal_broker(amqp_url)
    yield b
    b.close()


def make_partial(broker: Broker, semaphore: str, permits: int, published: int) -> None:
    """The state a creator cut off after `published` of its `permits` token publishes
    leaves: the stamped queue with tokens 1..published (the real write, truncated)."""

    async def go() -> None:
        session = await broker.core.session()
        messages = [
            (str(k).encode(), token_properties(semaphore, k, {"amqp-locks-fencing": "shard"}))
            for k in range(1, published + 1)
        ]
        await session.declare_and_publish(
            token_queue(semaphore),
            fresh.fresh_arguments(session, stamps.new_stamp(permits), broker.core.cluster),
            messages,
        )

    broker.core.run(go())


def test_a_mutex_whose_creator_died_before_its_token_grants_again(
    cluster_broker: Broker, name: str
) -> None:
    """Issue 36 case 1: the queue exists with no token. A waiter retrying short acquires
    (as a standby does) is granted the name within the bound; on 71753d0 it never was."""
    wire = quorum_mutex_name(name)
    make_partial(cluster_broker, wire, 1, 0)
    assert counts(cluster_broker, token_queue(wire)) == (0, 0)
    started = time.monotonic()
    lease = None
    tries = 0
    while lease is None and time.monotonic() - started < BOUND + ALLOWANCE:
        tries += 1
        lease = Mutex(cluster_broker, name).acquire(timeout=2.5)
    took = time.monotonic() - started
    assert lease is not None, f"no grant in {took:.1f}s over {tries} tries"
    assert tries >= 2, "healing is meant to carry across retries"
    assert took >= LOCK_DELAY + heal.HEAL_MARGIN, f"healed after {took:.1f}s: too early"
    lease.release(wait=True)
    waiting.wait_until(
        lambda: counts(cluster_broker, token_queue(wire)) == (1, 0), 10, "exactly one token"
    )


def _cancels_reach_holders(broker: Broker) -> bool:
    async def go() -> bool:
        return features.cancels_reach_holders(await broker.core.session())

    return broker.core.run(go())


def _token_permit(b: Broker, name: str, permits: int) -> Any:
    return TokenSemaphore(b, name, first_use=True, permits=permits)


def _read_permit(b: Broker, name: str, permits: int) -> Any:
    from amqp_locks import ReadWriteLock

    return ReadWriteLock(b, name, readers=permits).read_lock


class _Holders:
    """Workers that each acquire one permit of `name` (`lock`: of the first-use token
    semaphore, or a read-write lock's reader tokens) and, with `all_at_once`, hold it
    until `permits` of them hold together (or the barrier times out): the most held at
    once, when each was granted, and what they raised."""

    def __init__(
        self,
        name: str,
        permits: int,
        timeout: float,
        all_at_once: bool,
        barrier: float,
        lock: Callable[[Broker, str, int], Any] = _token_permit,
    ) -> None:
        self.name, self.permits, self.timeout, self.lock_of = name, permits, timeout, lock
        self.all_at_once = all_at_once
        self.lock = threading.Lock()
        self.held = [0, 0]  # now, most at once
        self.barrier = threading.Barrier(permits, timeout=barrier)
        self.got: list[float] = []  # monotonic instants of the grants
        self.errors: list[BaseException] = []

    def worker(self, b: Broker) -> None:
        try:
            lease = self.lock_of(b, self.name, self.permits).acquire(timeout=self.timeout)
            if lease is None:
                return
            with self.lock:
                self.held[0] += 1
                self.held[1] = max(self.held[1], self.held[0])
                self.got.append(time.monotonic())
            if self.all_at_once:
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.barrier.wait()
            with self.lock:
                self.held[0] -= 1
            lease.release(wait=True)
        except BaseException as exc:  # reported by end()
            self.errors.append(exc)

    def start(self, brokers: list[Broker]) -> list[threading.Thread]:
        """One started worker per broker."""
        threads = [threading.Thread(target=self.worker, args=(b,)) for b in brokers]
        for t in threads:
            t.start()
        return threads

    def end(self, threads: list[threading.Thread], brokers: list[Broker], timeout: float) -> None:
        """Join the workers (`timeout` each at most), close their brokers, and fail with
        what any of them raised."""
        try:
            for t in threads:
                t.join(timeout)
        finally:
            for b in brokers:
                b.close()
        assert not self.errors, self.errors


@pytest.mark.parametrize(("permits", "published"), [(1, 0), (3, 0), (3, 1), (3, 2)])
def test_every_crash_point_of_a_creation_grants_all_permits_again(
    cluster_broker: Broker, amqp_url: str, name: str, permits: int, published: int
) -> None:
    """Cut after the declaration and `published` token publishes: `permits` waiters all
    hold at once within the bound, never more than `permits`, then exactly `permits`
    tokens are left. RabbitMQ 3.x (features.cancels_reach_holders): a queue left with some of
    its tokens is not replaced while they are held, so there every waiter is granted in
    turn on the tokens that are left, never more at once, and they stay as they are."""
    make_partial(cluster_broker, name, permits, published)
    whole = published == 0 or _cancels_reach_holders(cluster_broker)
    brokers = [heal_broker(amqp_url) for _ in range(permits + 1)]
    run = _Holders(name, permits, BOUND + ALLOWANCE, whole, BOUND + ALLOWANCE + 10)
    started = time.monotonic()
    threads = run.start(brokers)
    run.end(threads, brokers, BOUND + ALLOWANCE + 30)
    most, got = run.held[1], [t - started for t in run.got]
    if whole:
        assert most == permits, f"at most {most} held at once, want {permits}"
        assert len(got) >= permits
        assert max(got[:permits]) <= BOUND + ALLOWANCE
    else:
        assert 1 <= most <= published, run.held
        assert len(got) == permits + 1, "every waiter is granted in turn"
    left = permits if whole else published
    waiting.wait_until(
        lambda: counts(cluster_broker, token_queue(name)) == (left, 0), 10, f"{left} tokens"
    )


def _replace_at_once(broker: Broker, semaphore: str, permits: int) -> None:
    """Delete the token queue and make it again with all its tokens in the next round trip
    by the library's own creation (fresh.create), as a fast creator does right behind a
    heal's delete."""

    async def go() -> None:
        session = await broker.core.session()
        await session.delete(token_queue(semaphore))
        # "found": a waiter's own creation came first (4.x cancels it, it consumes again
        # and finds no queue; rehearsal 109, 4.3.6 loaded), which is as good.
        made = await fresh.create(session, semaphore, permits, broker.core.cluster)
        assert made in ("made", "found"), made

    broker.core.run(go())


def _replace_readers_at_once(broker: Broker, name: str, readers: int) -> None:
    """The same for a read-write lock's readers queue, made again by the library's own
    creation (rwlock/admin.ensure_readers) in the next round trip."""
    from amqp_locks.rwlock.admin import ensure_readers, readers_queue

    async def go() -> None:
        session = await broker.core.session()
        await session.delete(readers_queue(name))
        await ensure_readers(session, name, readers, broker.core.cluster)

    broker.core.run(go())


def _reader_queues(name: str) -> tuple[str, str]:
    from amqp_locks.rwlock.admin import readers_queue, waiting_queue

    return readers_queue(name), waiting_queue(readers_queue(name))


#: Per kind: how the lock is left without tokens, how its queue is replaced at once, the
#: waiters' permit, and (its queue, its waiting queue).
_REPLACED: dict[str, tuple[Callable[..., None], Callable[..., None], Any, Any]] = {
    "tokens": (
        lambda b, name: make_partial(b, name, 2, 0),
        _replace_at_once,
        _token_permit,
        lambda name: (token_queue(name), token_waiting_queue(name)),
    ),
    "readers": (
        lambda b, name: make_rwlock(b, name, 2, 0, True),
        _replace_readers_at_once,
        _read_permit,
        _reader_queues,
    ),
}

#: What waiters of a queue replaced under them may take to be granted: the next sample
#: of each (SAMPLE_EVERY, +20 %), a new channel and consume; generous for a loaded machine.
REPLACED_BOUND = 2 * 1.2 * heal.SAMPLE_EVERY + ALLOWANCE

#: Which read of a waiter's watch lands between the replacement's delete and its
#: declaration, and so is answered 404 (each waiter's `n`-th call of that function).
_WINDOWS: dict[str, tuple[str, int]] = {
    "first stamp": ("stamp_of_either", 1),
    "sample": ("visible_tokens", 1),
    "stamp check": ("stamp_of_either", 2),
}


def _answer_404_once(monkeypatch: pytest.MonkeyPatch, window: str) -> list[Any]:
    """Make the `window` read of each waiter's watch (one per session) raise QueueNotFound,
    as the broker answers a read that falls between a replacement's delete and its
    declaration (rehearsal stop 63 on 3.10.8: both waiters sampled in that round trip,
    their watches ended, and neither was ever granted). Returns the sessions it hit."""
    from amqp_locks.errors import QueueNotFound

    function, nth = _WINDOWS[window]
    real = getattr(heal, function)
    calls: dict[int, int] = {}
    hit: list[Any] = []

    async def answered_404(session: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
        calls[id(session)] = calls.get(id(session), 0) + 1
        if calls[id(session)] == nth:
            hit.append(session)
            raise QueueNotFound(f"no queue {queue!r} (between a delete and its declaration)")
        return await real(session, queue, *args, **kwargs)

    monkeypatch.setattr(heal, function, answered_404)
    return hit


@pytest.mark.parametrize("window", ["none", *_WINDOWS])
@pytest.mark.parametrize("kind", sorted(_REPLACED))
def test_waiters_of_a_queue_replaced_at_once_are_granted_its_tokens(
    cluster_broker: Broker,
    amqp_url: str,
    name: str,
    kind: str,
    window: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two waiters wait on a first-use queue with no token (a token semaphore's, or a
    read-write lock's readers queue, its turn free); the queue is deleted and made again
    with both tokens in the next round trip. Both are granted within REPLACED_BOUND,
    never more than 2 at once, and 2 tokens are left. RabbitMQ 3.10.8 tells them nothing
    and moves their consumers onto the new queue, where they take both tokens and are
    handed none (features.cancels_reach_holders): CI of rehearsal 102 saw a heal's creator do
    this to one waiter of three (2 held at once). Before the fix they waited to their
    timeout; 4.x cancels them and they consume again. `window`: a read of each waiter's
    watch is answered 404, as one landing between the delete and the declaration is; the
    watch goes on (before, it ended, and on 3.10.8 its waiter was never granted). Each
    watch makes those reads as it starts (its first sample follows its registration), so
    the queue is replaced once both were answered: rehearsal 109 (4.3.6, loaded) replaced
    it first, and a waiter granted at once never sampled. 4.x reads no stamp while it
    waits (the cancel tells it), so there the stamp check is never hit."""
    leave_empty, replace, permit, queues = _REPLACED[kind]
    queue, waiting_on = queues(name)
    leave_empty(cluster_broker, name)
    hit = [] if window == "none" else _answer_404_once(monkeypatch, window)
    brokers = [heal_broker(amqp_url) for _ in range(2)]
    run = _Holders(
        name, 2, BOUND + REPLACED_BOUND, True, BOUND + ALLOWANCE + REPLACED_BOUND, permit
    )
    threads = run.start(brokers)
    try:
        waiting.wait_until(  # both consume the queue and are registered as waiters
            lambda: _consumers(cluster_broker, waiting_on) == 2,
            BOUND,
            "two registered waiters",
        )
        checks_stamps = window != "stamp check" or not _cancels_reach_holders(cluster_broker)
        forced = 2 if window != "none" and checks_stamps else 0
        waiting.wait_until(lambda: len(hit) >= forced, BOUND, f"{window} answered 404 twice")
        replaced_at = time.monotonic()
        replace(cluster_broker, name, 2)
    finally:
        run.end(threads, brokers, BOUND + REPLACED_BOUND + 30)
    assert len(run.got) == 2, f"{len(run.got)} of 2 waiters granted"
    took = max(run.got) - replaced_at
    assert took <= REPLACED_BOUND, f"granted {took:.1f}s after the replacement"
    assert run.held[1] == 2
    waiting.wait_until(lambda: counts(cluster_broker, queue) == (2, 0), 10, "2 tokens")
    assert len(hit) == forced, hit


def test_a_token_held_longer_than_the_period_is_not_taken(
    cluster_broker: Broker, amqp_url: str, name: str
) -> None:
    """The safety side: a live holder keeps its token however long a waiter waits; the
    waiter's samples count the holder, so it never deletes the queue."""
    holder = Mutex(cluster_broker, name).acquire(timeout=10)
    assert holder is not None
    period = LOCK_DELAY + heal.HEAL_MARGIN + heal.HEAL_JITTER + heal.REGISTER_AFTER
    with heal_broker(amqp_url) as other:
        assert Mutex(other, name).acquire(timeout=period + 3) is None
        assert not holder.lost.is_set()
        wire = token_queue(quorum_mutex_name(name))
        # still there, its token still held (the timed-out waiter's consumer goes a
        # moment after its acquire returned)
        waiting.wait_until(lambda: counts(cluster_broker, wire) == (0, 1), 10, "one holder")
        holder.release(wait=True)
        lease = Mutex(other, name).acquire(timeout=10)
        assert lease is not None
        lease.release(wait=True)


def test_a_waiter_registers_and_withdraws(cluster_broker: Broker, name: str) -> None:
    """A waiter consumes from the waiting queue after REGISTER_AFTER, and a grant
    withdraws it before the holder is told: the holder never counts as a waiter."""
    holder = Mutex(cluster_broker, name).acquire(timeout=10)
    assert holder is not None
    wire = quorum_mutex_name(name)
    result: list[Any] = []
    t = threading.Thread(
        target=lambda: result.append(Mutex(cluster_broker, name).acquire(timeout=30))
    )
    t.start()
    try:
        waiting.wait_until(
            lambda: _consumers(cluster_broker, token_waiting_queue(wire)) == 1,
            10,
            "registered",
            0.05,
        )
    finally:
        holder.release(wait=True)
        t.join(30)
    [lease] = result
    assert lease is not None
    # Granted: our registration was withdrawn before acquire returned.
    assert _consumers(cluster_broker, token_waiting_queue(wire)) in (0, None)
    lease.release(wait=True)


def _consumers(broker: Broker, queue: str) -> int | None:
    from amqp_locks.errors import QueueNotFound

    async def go() -> int | None:
        try:
            return (await (await broker.core.session()).declare_passive_counts(queue))[1]
        except QueueNotFound:
            return None

    return broker.core.run(go())


def _clocks(broker: Broker, queue: str) -> tuple[Any, float | None, Any]:
    """(the waiter's current session or None, its quiet_since and heal run of `queue`),
    read on the I/O loop without connecting."""

    async def go() -> tuple[Any, float | None, Any]:
        session = broker.core._session
        if session is None or not session.alive:
            return None, None, None
        return session, session.quiet_since.get(queue), session.heal_runs.get(queue)

    return broker.core.run(go())


def _drop(broker: Broker, session: Any) -> float:
    """Drop `session` as its quorum guard does (Session.drop); returns the wall-clock time."""

    async def go() -> float:
        session.drop("test: dropped as the quorum guard drops a connection")
        return time.time()

    return broker.core.run(go())


def test_a_waiter_dropped_while_it_waits_keeps_its_clocks(
    cluster_broker: Broker, amqp_url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter on a tokenless first-use queue whose connection is dropped (its quorum
    guard, a reset) and who waits on, keeps its clocks on the next connection
    (Session.carry_from): dropped once 2 s into its wait for the queue to run, then once
    it has a run of samples, it replaces the queue with a run that began before the
    second drop, and no later than a clock started again at the first drop would allow.
    Rehearsal 74 (4.3.6) saw a waiter dropped by its guard begin again and miss its bound."""
    wire = quorum_mutex_name(name)
    queue = token_queue(wire)
    make_partial(cluster_broker, wire, 1, 0)
    caplog.set_level("WARNING", logger="amqp_locks.tokens")
    with heal_broker(amqp_url) as waiter:
        result: list[Any] = []
        started = time.monotonic()
        t = threading.Thread(
            target=lambda: result.append(Mutex(waiter, name).acquire(timeout=BOUND + ALLOWANCE))
        )
        t.start()
        try:
            quiet = waiting.wait_until(lambda: _clocks(waiter, queue)[1], 10, "quiet clock")
            waiting.wait_until(
                lambda: time.monotonic() - quiet >= 2.0, 10, "2 s into the wait", 0.05
            )
            first = _clocks(waiter, queue)[0]
            assert first is not None
            first_drop = _drop(waiter, first)
            second = waiting.wait_until(
                lambda: (c := _clocks(waiter, queue))[0] is not first and c[2] and c[0],
                BOUND,
                "a run of samples on the next connection",
                0.05,
            )
            second_drop = _drop(waiter, second)
        finally:
            t.join(BOUND + ALLOWANCE + 5)
        took = time.monotonic() - started
    [lease] = result
    assert lease is not None, f"no grant in {took:.1f}s"
    assert took <= BOUND + ALLOWANCE
    [heal_log] = [r for r in caplog.records if "a creator died mid-creation" in r.getMessage()]
    run_began = heal_log.created - float(heal_log.args[3])  # type: ignore[index]
    assert run_began < second_drop, "the run of samples began again after the drop"
    # A quiet clock started again at the first drop would let the waiter consume, then
    # register and sample, no sooner than RUNNING_WAIT + REGISTER_AFTER after it.
    assert run_began < first_drop + fresh.RUNNING_WAIT + heal.REGISTER_AFTER
    lease.release(wait=True)
    waiting.wait_until(lambda: counts(cluster_broker, queue) == (1, 0), 10, "exactly one token")


def test_a_cut_creator_leaves_a_name_that_grants_again(
    amqp_url: str, name: str, proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real cut: the creator's TCP connection is reset the moment its creation write is
    on the socket (whatever prefix of it the broker handled); another client is granted
    the name within the bound."""
    from amqp_locks.transport import queue_ops

    original = queue_ops._declare_and_publish
    cut: list[str] = []

    async def and_cut(ch: Any, queue: str, arguments: Any, messages: Any) -> None:
        if cut:
            return await original(ch, queue, arguments, messages)
        creation = asyncio.ensure_future(original(ch, queue, arguments, messages))
        for _ in range(100):  # until the frames are on the socket
            await asyncio.sleep(0)
            if ch.write_queue.empty():
                break
        cut.append(queue)
        proxy.reset()
        return await creation

    creator = heal_broker(proxy.url())
    monkeypatch.setattr(queue_ops, "_declare_and_publish", and_cut)
    try:
        # The cut: a ConnectionLost, or a grant on the next connection (closed below).
        with contextlib.suppress(Exception):
            Mutex(creator, name).acquire(timeout=1.0)
    finally:
        monkeypatch.setattr(queue_ops, "_declare_and_publish", original)
        creator.close(timeout=1)
    assert cut == [token_queue(quorum_mutex_name(name))]
    with heal_broker(amqp_url) as other:
        started = time.monotonic()
        lease = Mutex(other, name).acquire(timeout=BOUND + ALLOWANCE)
        assert lease is not None, f"no grant in {time.monotonic() - started:.1f}s"
        lease.release(wait=True)


# --- read-write locks: the readers queue's R tokens and the writer queue's turn ----------


def make_rwlock(broker: Broker, name: str, readers: int, published: int, turn: bool) -> None:
    """A read-write lock whose creation was cut: the readers queue with `published` of its
    `readers` tokens, the writer queue with (`turn`) or without its turn."""
    from pamqp.commands import Basic

    from amqp_locks.rwlock.admin import lock_arguments, readers_queue, writer_queue

    def props(ident: str) -> Basic.Properties:
        return Basic.Properties(delivery_mode=2, message_id=ident, app_id="amqp-locks")

    async def go() -> None:
        session = await broker.core.session()
        quorum = broker.core.cluster
        await session.declare_and_publish(
            readers_queue(name),
            {**lock_arguments(session, quorum, True), "x-max-length": stamps.new_stamp(readers)},
            [(str(k).encode(), props(f"{name}#r{k}")) for k in range(1, published + 1)],
        )
        await session.declare_and_publish(
            writer_queue(name),
            {**lock_arguments(session, quorum, False), "x-max-length": stamps.new_stamp()},
            [(str(readers).encode(), props(f"{name}#w"))] if turn else [],
        )

    broker.core.run(go())


@pytest.mark.parametrize(
    ("mode", "published", "turn"),
    [("read", 0, True), ("write", 1, True), ("write", 3, False), ("read", 0, False)],
    ids=["reader-no-tokens", "writer-1-of-3", "writer-no-turn", "reader-nothing"],
)
def test_a_read_write_lock_cut_at_creation_grants_again(
    cluster_broker: Broker, name: str, mode: str, published: int, turn: bool
) -> None:
    """Issue 36 case 1, read-write lock: readers queue short of its R tokens or writer
    queue without its turn. A reader (or writer) is granted within the bound; then a
    writer and R readers both get their turn, and exactly R tokens and one turn are left."""
    from amqp_locks import ReadWriteLock
    from amqp_locks.rwlock.admin import readers_queue, writer_queue

    make_rwlock(cluster_broker, name, 3, published, turn)
    rw = ReadWriteLock(cluster_broker, name, readers=3)
    half = rw.read_lock if mode == "read" else rw.write_lock
    started = time.monotonic()
    lease = half.acquire(timeout=BOUND + ALLOWANCE)
    took = time.monotonic() - started
    assert lease is not None, f"no {mode} grant in {took:.1f}s"
    assert took >= LOCK_DELAY + heal.HEAL_MARGIN, f"healed after {took:.1f}s: too early"
    lease.release(wait=True)
    write = rw.write_lock.acquire(timeout=20)
    assert write is not None
    write.release(wait=True)
    reads = [rw.read_lock.acquire(timeout=20) for _ in range(3)]
    assert all(r is not None for r in reads)
    for r in reads:
        assert r is not None
        r.release(wait=True)
    waiting.wait_until(
        lambda: counts(cluster_broker, readers_queue(name)) == (3, 0), 10, "exactly 3 tokens"
    )
    waiting.wait_until(
        lambda: counts(cluster_broker, writer_queue(name)) == (1, 0), 10, "exactly one turn"
    )


def test_a_writer_waiting_on_a_long_read_does_not_replace_the_lock(
    cluster_broker: Broker, amqp_url: str, name: str
) -> None:
    """Safety: a reader holds longer than the period while a writer holds the turn and
    waits for that reader's token; the writer counts the reader as a holder and waits."""
    from amqp_locks import ReadWriteLock

    rw = ReadWriteLock(cluster_broker, name, readers=3)
    read = rw.read_lock.acquire(timeout=10)
    assert read is not None
    period = LOCK_DELAY + heal.HEAL_MARGIN + heal.HEAL_JITTER + heal.REGISTER_AFTER
    with heal_broker(amqp_url) as other:
        assert ReadWriteLock(other, name, readers=3).write_lock.acquire(timeout=period + 3) is None
        assert not read.lost.is_set()
        read.release(wait=True)
        write = ReadWriteLock(other, name, readers=3).write_lock.acquire(timeout=10)
        assert write is not None
        write.release(wait=True)


def test_repair_replaces_a_first_use_queue_and_never_duplicates_a_held_token(
    cluster_broker: Broker, name: str
) -> None:
    """`TokenAdmin.repair` of a first-use queue short of tokens replaces the queue (a
    missing token that may still come back dies with it): with one of 2 permits held,
    the holder is told (consumer cancelled) and the queue has exactly 2 tokens, never 3.
    RabbitMQ 3.x would not tell the holder (features.cancels_reach_holders): repair refuses."""
    from amqp_locks import LockError, TokenAdmin

    make_partial(cluster_broker, name, 2, 2)
    sem = TokenSemaphore(cluster_broker, name, first_use=True, permits=2)
    held = sem.acquire(timeout=10)
    assert held is not None
    if not _cancels_reach_holders(cluster_broker):
        with pytest.raises(LockError, match="would not be told"):
            TokenAdmin(cluster_broker, name).repair(timeout=1)
        assert not held.lost.is_set()
        held.release(wait=True)
        return
    audit = TokenAdmin(cluster_broker, name).repair(timeout=1)
    assert len(audit.missing) == 1  # the held one did not come back
    assert held.lost.wait(10), "the holder of the replaced queue must be told"
    waiting.wait_until(
        lambda: counts(cluster_broker, token_queue(name)) == (2, 0), 10, "exactly 2 tokens"
    )


def test_repair_of_a_set_up_queue_refuses_while_a_holder_may_hold_a_missing_id(
    broker: Broker, name: str
) -> None:
    """A set-up queue's missing ids are re-published only while nobody consumes: with a
    holder, a missing id may be the held one, and repair refuses (LockError)."""
    from amqp_locks import LockError, TokenAdmin

    TokenAdmin(broker, name).setup(1)
    held = TokenSemaphore(broker, name).acquire(timeout=10)
    assert held is not None
    with pytest.raises(LockError, match="duplicate"):
        TokenAdmin(broker, name).repair(timeout=0.5)
    held.release(wait=True)
    assert TokenAdmin(broker, name).audit(timeout=5).ok
    TokenAdmin(broker, name).destroy()


def test_repair_refuses_when_the_count_did_not_come_from_the_leader(
    broker: Broker, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RabbitMQ answers "0 ready, 0 consumers" for a quorum queue whose leader the node
    cannot hear within 250 ms (heal.FAILED_STAT; injected here as the broker's answer to
    the token queue's passive declares). Repair must not read it as "nobody holds": with
    the missing id held, it refuses and changes nothing (no second token)."""
    from amqp_locks import LockError, TokenAdmin
    from amqp_locks.transport.session import Session

    TokenAdmin(broker, name).setup(1)
    held = TokenSemaphore(broker, name).acquire(timeout=10)
    assert held is not None
    real = Session.declare_passive_counts

    async def unanswered(self: Session, queue: str) -> tuple[int, int]:
        if queue == token_queue(name):
            return heal.FAILED_STAT
        return await real(self, queue)

    monkeypatch.setattr(Session, "declare_passive_counts", unanswered)
    with pytest.raises(LockError, match="could not say who holds"):
        TokenAdmin(broker, name).repair(timeout=0.5)
    monkeypatch.undo()
    assert counts(broker, token_queue(name)) == (0, 1), "repair changed the queue"
    assert not held.lost.is_set()
    held.release(wait=True)
    assert TokenAdmin(broker, name).audit(timeout=5).ok
    TokenAdmin(broker, name).destroy()


def test_many_waiters_sample_less_often_each() -> None:
    """A name's waiters together take about SAMPLES_PER_SECOND samples a second, each at
    least one every MAX_INTERVAL seconds (well inside the gap that breaks a run)."""
    assert heal.sample_interval(0) == heal.SAMPLE_EVERY
    assert heal.sample_interval(8) == 8 / heal.SAMPLES_PER_SECOND
    assert heal.sample_interval(10_000) == heal.MAX_INTERVAL
    assert heal.MAX_INTERVAL * 1.2 < heal.MAX_GAP


class _Counts:
    """A session's passive declares, answered from a table (pure logic: the sample's
    reading of the broker's numbers); a queue not in it is missing."""

    def __init__(self, table: dict[str, tuple[int, int]]) -> None:
        self.table = table

    async def declare_passive_counts(self, queue: str) -> tuple[int, int]:
        from amqp_locks.errors import QueueNotFound

        if queue not in self.table:
            raise QueueNotFound(queue)
        return self.table[queue]


def test_a_count_without_our_own_consumer_is_not_evidence() -> None:
    """RabbitMQ's stand-in for no answer from a quorum queue's leader (0 ready, 0
    consumers) never counts as a queue that lost its tokens: we consume it ourselves."""
    q, w = "n.mutex", "n.mutex-waiting"

    def sample(table: dict[str, tuple[int, int]], held: int | None = None) -> Any:
        return asyncio.run(heal.visible_tokens(_Counts(table), q, w, held))  # type: ignore[arg-type]

    assert sample({q: heal.FAILED_STAT, w: (0, 1)}) is None
    assert sample({q: heal.FAILED_STAT}) is None
    assert sample({q: heal.FAILED_STAT}, held=2) is None
    assert sample({q: (0, 1), w: (0, 1)}) == (0, 0, 1)  # only us, registered: 0 of 1 seen
    assert sample({q: (0, 3), w: (0, 1)}) == (2, 2, 1)  # two holders
    assert sample({q: (1, 2)}, held=1) == (3, 1, 0)  # a writer gathering: 1 ready, 1 held


@pytest.mark.parametrize(
    ("writer", "proof", "free"),
    [
        ((1, 0), None, True),  # the turn is ready
        ((0, 2), None, False),  # a writer holds it (one unregistered consumer)
        ((0, 1), None, True),  # lost, one registered writer waiting for it
        ((0, 0), True, True),  # lost and nobody waits: its leader says empty
        ((0, 0), False, None),  # no answer from its leader: cannot judge
        (None, None, True),  # no writer queue
    ],
)
def test_a_readers_judge_of_the_turn(
    monkeypatch: pytest.MonkeyPatch,
    writer: tuple[int, int] | None,
    proof: bool | None,
    free: bool | None,
) -> None:
    t, w = "n.rwlock-writer", "n.rwlock-writer-waiting"
    table = {w: (0, 1)}  # one registered waiter on the turn
    if writer is not None:
        table[t] = writer
    asked: list[str] = []

    async def answers_empty(session: Any, queue: str) -> bool:
        asked.append(queue)
        assert proof is not None, "a basic.get for an answer that needs none"
        return proof

    monkeypatch.setattr(heal, "answers_empty", answers_empty)
    assert asyncio.run(heal.turn_is_free(_Counts(table), t, w)) is free  # type: ignore[arg-type]
    assert asked == ([t] if proof is not None else [])


def test_answers_empty_is_the_leaders_word(cluster_broker: Broker, name: str) -> None:
    """``answers_empty`` on a real broker: True for an empty quorum queue; False for a
    missing one and for one with a message ready, which it gives back."""
    empty_name, full_name = f"{name}-empty", f"{name}-full"
    make_partial(cluster_broker, empty_name, 1, 0)
    make_partial(cluster_broker, full_name, 1, 1)

    async def go() -> tuple[bool, bool, bool]:
        session = await cluster_broker.core.session()
        return (
            await heal.answers_empty(session, token_queue(f"{name}-missing")),
            await heal.answers_empty(session, token_queue(empty_name)),
            await heal.answers_empty(session, token_queue(full_name)),
        )

    assert cluster_broker.core.run(go()) == (False, True, False)
    waiting.wait_until(
        lambda: counts(cluster_broker, token_queue(full_name)) == (1, 0), 10, "the token back"
    )
