"""A connection lost at any step of an acquire: the acquire waits on a new connection and
is granted; aiormq's own errors never reach the caller.

For each kind, the AMQP operations one acquire makes on an idle, set-up lock are counted;
then, on a fresh connection each time, the connection is ended (its socket aborted, as a
broker's close or the loss watchdog's drop does) just before the n-th of them, for every n.
The crash-point tests (test_crash_points.py) cut a creator through a proxy and look at what
the *next* client gets; here the cut client's own answer is the subject. CI of 2026-12-02
saw a write lock's grant end in aiormq's raw ``AMQPConnectionError`` (its fence take).
The same again for a name's first use, whose making the acquire does itself: a cut there
reached a read-write lock's caller as ``ConnectionLost`` until 2026-12-03.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiormq.channel
import pytest

import amqp_locks.transport.channel_ops
import amqp_locks.transport.queue_ops
from amqp_locks import Broker, ReleaseUnconfirmed, prepare_fences
from amqp_locks.held import HeldState
from amqp_locks.lease import Lease
from amqp_locks_dev import devbroker

from .cluster.locks import lock_of, set_up

#: The channel operations counted and cut before (basic.qos is left out: the watchdog's
#: pings and the background channel spares make it at times of their own).
OPS = (
    "basic_ack",
    "basic_cancel",
    "basic_consume",
    "basic_get",
    "basic_publish",
    "basic_reject",
    "queue_declare",
    "queue_delete",
    "tx_commit",
    "tx_select",
)
KINDS = ("mutex", "semaphore", "token", "read", "write")


class _Cutter:
    """Counts the operations above while an acquire runs; ends the connection before the
    n-th (or each of several). An operation the acquire left to the background (a
    consumer's cancel after the fence take) that comes once the acquire returned is
    neither counted nor cut: it would end a granted lease's connection, which is a lost
    lease, not a lost acquire."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.cut_at: frozenset[int] = frozenset()
        self.broker: Broker | None = None
        self.fired = 0
        self.task: asyncio.Task[Any] | None = None

    def acquire(
        self,
        broker: Broker,
        lock: Any,
        blocking: bool,
        timeout: float | None,
        cut_at: int | tuple[int, ...] | None,
    ) -> Lease | None:
        """`lock.acquire(blocking, timeout)`, counted (and cut before operation `cut_at`,
        or before each of them); `fired` tells how many cuts were made."""
        cuts = frozenset([cut_at] if isinstance(cut_at, int) else cut_at or ())
        with self.lock:
            self.broker, self.cut_at, self.count, self.fired = broker, cuts, 0, 0

        async def counted() -> HeldState | None:
            self.task = asyncio.current_task()
            state: HeldState | None = await lock.acquire_on_loop(blocking, timeout)
            return state

        try:
            state = broker.core.run(counted())
        finally:
            self.task = None
        return None if state is None else Lease(state)

    def before(self) -> None:
        """On the I/O loop, before each operation: the acquire's task, while it runs."""
        task = self.task
        if task is None or task.done():
            return
        with self.lock:
            self.count += 1
            if self.count not in self.cut_at or self.broker is None:
                return
            self.fired += 1
            session = self.broker.core._session
        if session is not None and session.alive:
            session._abort()


def _cut_first(c: _Cutter, real: Callable[..., Any]) -> Callable[..., Any]:
    async def cut_first(*args: Any, **kwargs: Any) -> Any:
        c.before()
        return await real(*args, **kwargs)

    return cut_first


@pytest.fixture
def cutter(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Cutter]:
    c = _Cutter()
    for op in OPS:
        real = getattr(aiormq.channel.Channel, op)
        monkeypatch.setattr(aiormq.channel.Channel, op, _cut_first(c, real))
    yield c


#: The frames the library writes itself (transport/aiormq_compat.py), where it writes
#: them: a test-and-set creation's declare with its publishes (one write), and a held
#: token's hand-on (its cancel, reject or ack and publish, sent together).
RAW_WRITES = (
    (amqp_locks.transport.queue_ops, "write_confirmed"),
    (amqp_locks.transport.channel_ops, "send_together"),
)


@pytest.fixture
def raw_cutter(cutter: _Cutter, monkeypatch: pytest.MonkeyPatch) -> _Cutter:
    """`cutter`, also counting (and cutting before) those writes."""
    for module, attr in RAW_WRITES:
        monkeypatch.setattr(module, attr, _cut_first(cutter, getattr(module, attr)))
    return cutter


Lock = Callable[[Broker, int], Any]


def _count_steps(
    cutter: _Cutter, broker: Callable[[], Broker], lock: Lock, blocking: bool, timeout: float | None
) -> int:
    """The operations one acquire of ``lock(b, 0)`` makes on a fresh connection, uncut."""
    with contextlib.closing(broker()) as b:
        b.core.run(b.core.session())
        lease = cutter.acquire(b, lock(b, 0), blocking, timeout, None)
        steps = cutter.count
        assert lease is not None
        lease.release(wait=True)
    assert steps >= 2, f"{steps} counted operations"
    return steps


def _release(lease: Lease, lock: Any) -> None:
    """Give a granted lease back. On RabbitMQ 4.2+ a release's wake-up notice can meet the
    name's wake-up queue in the instant of its delete (here: the cut connection's
    subscription ending), and the broker closes the releasing connection (506
    "failed to deliver message: {not_found, ...}"; docs/protocol.md, known and not
    removed). A mutex's or persistent semaphore's release is confirmed all the same (its
    notice follows the delete: tests/test_release_notice_race.py); another kind's is
    unconfirmed, and the lock must be free again all the same, granted to the next
    acquire as soon as the broker has seen that connection end."""
    try:
        lease.release(wait=True)
    except ReleaseUnconfirmed as exc:
        assert devbroker.default_version() == "4.3" and "failed to deliver" in str(exc), exc
        again = lock.acquire(timeout=30)
        assert again is not None, f"not granted again after {exc}"
        again.release(wait=True)


def _cut_each_step(
    cutter: _Cutter,
    broker: Callable[[], Broker],
    lock: Lock,
    steps: int,
    *,
    blocking: bool = True,
    timeout: float | None = 30,
    twice: bool = False,
) -> set[int]:
    """For n = 1..`steps`, on a fresh connection each time: ``lock(b, n)``'s acquire with
    the connection ended before its n-th operation (`twice`: and before the next, the
    first on the new connection), granted on a new connection. Returns the n so cut.

    Paths differ (a lock name has its own fence shard; a later acquire can skip a lookup
    the first one made; the connection's background work may fall in the count): a cut
    past a run's path does not fire, and that run's count is its whole path. Every step
    of the shortest path seen must have been cut (twice: a first cut within the path
    always has a second, the retry's first step)."""
    cut, paths = set(), [steps]
    for n in range(1, steps + 1):
        with contextlib.closing(broker()) as b:
            first = b.core.run(b.core.session())
            lease = cutter.acquire(b, lock(b, n), blocking, timeout, (n, n + 1) if twice else n)
            if lease is None and not blocking:
                # The retry may come before the broker saw the cut connection end, which
                # then still held what it was being granted: "busy" is the truth then.
                # It must not last: the lock is granted once the broker has seen it.
                lease = lock(b, n).acquire(timeout=10)
            assert lease is not None, f"cut before operation {n} of {steps}: not granted"
            _release(lease, lock(b, n))
            if not cutter.fired:
                paths.append(cutter.count)
            elif cutter.fired == (2 if twice else 1):
                cut.add(n)
                assert b.core._session is not first  # granted on a new connection
    shortest = min(paths)
    assert set(range(1, shortest + 1)) <= cut, f"cut before {sorted(cut)}, paths {paths}"
    return cut


def _prepared(
    amqp_url: str, cluster: bool, kind: str, name: str, *, fresh_names: bool = False
) -> tuple[Callable[[], Broker], Lock]:
    """A test's two factories: a broker (heartbeat 5 s) and its lock of ``kind``, with the
    fence shards made. The lock is set up beforehand, or with ``fresh_names`` each cut ``n``
    gets a name never used (``NAME-n``), so the acquire makes it."""

    def broker() -> Broker:
        return Broker(amqp_url, cluster=cluster, heartbeat=5.0)

    def lock(b: Broker, n: int) -> Any:
        return lock_of(b, kind, f"{name}-{n}" if fresh_names else name)

    with contextlib.closing(broker()) as admin:
        prepare_fences(admin)
        if not fresh_names:
            set_up(admin, kind, name)
    return broker, lock


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster-mode"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_connection_lost_at_any_step_of_an_acquire_is_waited_through(
    kind: str, cluster: bool, blocking: bool, amqp_url: str, name: str, raw_cutter: _Cutter
) -> None:
    """A non-blocking acquire asks again once on a new connection: granted, or None while
    the broker has not yet seen the cut connection end (then a blocking acquire is granted
    within 10 s: nothing was left held)."""
    timeout = 30 if blocking else None
    broker, lock = _prepared(amqp_url, cluster, kind, name)
    steps = _count_steps(raw_cutter, broker, lock, blocking, timeout)
    cut = _cut_each_step(raw_cutter, broker, lock, steps, blocking=blocking, timeout=timeout)
    # Counted on 4.3.6 and 3.10.8 (the same on both), blocking and non-blocking: mutex 20
    # and 12 steps (single, cluster mode), semaphore 22 and 2-3, token 2-3, read 13-14
    # and 11, write 14-16 and 13; the library's own writes (RAW_WRITES) included.
    mode = "cluster" if cluster else "single"
    print(f"\n{kind} ({mode}, {'' if blocking else 'non-'}blocking): {steps} steps, {len(cut)} cut")


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster-mode"])
@pytest.mark.parametrize("kind", ["mutex", "read", "write"])
def test_a_connection_lost_at_any_step_of_a_first_use_is_waited_through(
    kind: str, cluster: bool, amqp_url: str, name: str, raw_cutter: _Cutter
) -> None:
    """The same for a lock made by the acquire itself (a name never used, each cut on a
    name of its own): the connection ended before any step of the making (a read-write
    lock's queues made by test-and-sets; cluster mode's token queue) or of the wait after
    it. Before the fix a read-write lock's making ran outside the acquire's retry, so a
    connection lost there reached the caller as ``ConnectionLost``."""
    broker, lock = _prepared(amqp_url, cluster, kind, name, fresh_names=True)
    steps = _count_steps(raw_cutter, broker, lock, True, 30)
    cut = _cut_each_step(raw_cutter, broker, lock, steps)
    mode = "cluster" if cluster else "single"
    print(f"\n{kind} ({mode}): first use of {steps} steps, {len(cut)} cut")


#: One kind per retry loop: waiting.acquire_loop (a mutex on one node; the persistent
#: semaphore's is the same loop), tokens/client.py (cluster mode), rwlock/lock.py.
ONE_PER_LOOP = [
    pytest.param("mutex", False, id="mutex-single"),
    pytest.param("mutex", True, id="mutex-cluster-mode"),
    pytest.param("write", False, id="write-single"),
]


@pytest.mark.parametrize(("kind", "cluster"), ONE_PER_LOOP)
def test_a_connection_lost_twice_in_a_row_is_waited_through_by_a_blocking_acquire(
    kind: str, cluster: bool, amqp_url: str, name: str, raw_cutter: _Cutter
) -> None:
    """A blocking acquire with time left waits through any number of lost connections:
    cut before step n and again before the first step on the new connection (a node
    restarting, a failover whose next node drops the new connection too). Only a
    non-blocking acquire gives up after asking once more. Before the fix a single-node
    mutex's or persistent semaphore's first attempt asked once more and raised the second
    loss (``ConnectionLost``) whatever time was left."""
    broker, lock = _prepared(amqp_url, cluster, kind, name)
    steps = _count_steps(raw_cutter, broker, lock, True, 30)
    cut = _cut_each_step(raw_cutter, broker, lock, steps, twice=True)
    mode = "cluster" if cluster else "single"
    print(f"\n{kind} ({mode}): {steps} steps, {len(cut)} cut twice")
