"""The cluster-mode quorum guard's rules (transport/quorum_guard.py), with a fake clock.

The guard's wire behaviour is tested against a real cluster in tests/cluster; here only
the arithmetic that decides when a connection must give up its locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from pamqp.commands import Basic
from yarl import URL

from amqp_locks import Broker, ConfigurationError
from amqp_locks.transport.quorum_guard import ClusterTiming, QuorumGuard, _Pipe, probe_queue


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _guard(timing: ClusterTiming, clock: Clock) -> tuple[QuorumGuard, list[str]]:
    dropped: list[str] = []
    session: Any = SimpleNamespace(
        url=URL("amqp://guest:guest@127.0.0.1:5673/"),
        alive=True,
        connection_name="t",
        leases=[],
    )

    async def connect() -> Any:  # the arithmetic below never opens the probe link
        raise AssertionError("no probe link in these tests")

    return QuorumGuard(session, timing, dropped.append, connect, clock=clock), dropped


def test_defaults_follow_the_lock_delay_not_net_ticktime() -> None:
    """Issue 29: a client not told the nodes' net_ticktime must still be safe, so the
    bound follows the lock delay the library sets, whatever net_ticktime says."""
    assert ClusterTiming.of(None, None) == ClusterTiming(None, 5.0, 10.0)
    assert ClusterTiming.of(60, None) == ClusterTiming(60.0, 5.0, 10.0)
    assert ClusterTiming.of(None, None, 4) == ClusterTiming(None, 2.0, 4.0)
    assert ClusterTiming.of(None, None).interval == 1.0
    assert ClusterTiming.of(None, None, 60).interval == 2.0  # capped
    assert ClusterTiming.of(None, None).lock_delay_ms == 10_000
    assert ClusterTiming.of(None, None).min_delay_ms == 6_000


@pytest.mark.parametrize(
    ("delay", "bound"), [(10, 9.1), (10, 0), (10, -1), (4, 3.5), (1, None), (0, None)]
)
def test_a_bound_the_lock_delay_could_beat_is_refused(delay: float, bound: float | None) -> None:
    with pytest.raises(ConfigurationError, match="lock_delay"):
        ClusterTiming.of(None, bound, delay)


@pytest.mark.parametrize("tick", [0, -5])
def test_a_nonsense_net_ticktime_is_refused(tick: float) -> None:
    with pytest.raises(ConfigurationError, match="net_ticktime"):
        ClusterTiming.of(tick, None)


def test_lines_without_the_lock_delay_rest_on_net_ticktime() -> None:
    """3.10-4.2 re-grant 0.75 x net_ticktime after a silent cut: the bound must stay below
    it (refused at connect), and the WARNING says what safety rests on."""
    timing = ClusterTiming.of(None, None)
    assert timing.check_line((4, 3)) is None
    note = timing.check_line((4, 0))
    assert note is not None and "net_ticktime >= 8.0 s" in note and "4.3" in note
    assert "cut it hears of" in note
    with pytest.raises(ConfigurationError, match=r"0.75 x net_ticktime - 1 = 2 s"):
        ClusterTiming.of(4, None).check_line((3, 10))
    assert ClusterTiming.of(4, None).check_line((4, 3)) is None  # the delay orders it


def test_broker_refuses_a_bad_bound_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="quorum_timeout"):
        Broker("amqp://guest:guest@127.0.0.1:1/", quorum_timeout=9.5)
    b = Broker("amqp://guest:guest@127.0.0.1:1/", net_ticktime=10, quorum_timeout=6.5)
    assert (b.net_ticktime, b.quorum_timeout, b.lock_delay) == (10.0, 6.5, 10.0)
    b = Broker("amqp://guest:guest@127.0.0.1:1/", lock_delay=30)
    assert (b.net_ticktime, b.quorum_timeout, b.lock_delay) == (60.0, 15.0, 30.0)


def test_no_confirm_yet_counts_from_the_connection() -> None:
    clock = Clock()
    guard, _ = _guard(ClusterTiming(10, 5, 10), clock)
    clock.now += 5.0
    assert guard.expired(clock.now) is None
    clock.now += 0.01
    reason = guard.expired(clock.now)
    assert reason is not None and "quorum_timeout 5 s" in reason


def test_the_newest_confirmed_send_time_is_the_proof() -> None:
    clock = Clock()
    guard, _ = _guard(ClusterTiming(10, 5, 10), clock)
    guard.confirm(103.0)
    guard.confirm(101.0)  # an older probe confirmed late proves less
    assert guard.proof == 103.0
    assert guard.expired(108.0) is None
    assert guard.expired(108.1) is not None
    # a confirm proves the moment the probe was *sent*, not when the confirm came
    guard.confirm(104.0)
    assert guard.expired(108.9) is None and guard.expired(109.1) is not None


def _hold(queue: str, acquired_at: float) -> Any:
    return SimpleNamespace(
        released=False,
        lost_reason=None,
        acquired_at=acquired_at,
        quorum_queues=lambda: (queue,),
    )


def test_each_held_lock_needs_its_own_proof() -> None:
    """Issue 29: the node's probe queue answering is not enough. In a partial partition
    (or with a lock queue's majority elsewhere on 5 nodes) the node commits to the probe
    queue while the lock queue's leader is cut off from it: the lock's own check must be
    answered within quorum_timeout too."""
    clock = Clock()
    guard, _ = _guard(ClusterTiming(10, 5, 10), clock)
    a, b = _hold("a.semaphore", 101.0), _hold("b.semaphore", 102.0)
    guard.session.leases.extend([a, b])
    assert guard.held() == {"a.semaphore": 101.0, "b.semaphore": 102.0}
    guard.lock_proofs["b.semaphore"] = 104.0
    guard.confirm(105.0)  # the node's probe keeps confirming
    assert guard.expired(106.0) is None
    reason = guard.expired(106.1)  # a: granted at 101, never checked since
    assert reason is not None and "'a.semaphore'" in reason and "lock_delay" in reason
    guard.lock_proofs["a.semaphore"] = 106.0
    assert guard.expired(109.0) is None
    reason = guard.expired(109.2)  # b: last answered check sent at 104
    assert reason is not None and "'b.semaphore'" in reason
    b.released = True  # a released lock needs no proof
    assert guard.expired(109.2) is None and guard.held() == {"a.semaphore": 101.0}


def test_a_drop_says_whether_checks_went_unanswered_or_none_was_sent() -> None:
    """The reason tells a cut (checks sent, none answered) from a client that could not
    send (no probe link, a held-up loop), and how late the newest check went: the two
    call for different fixes."""
    clock = Clock()
    guard, _ = _guard(ClusterTiming(10, 5, 10), clock)
    guard.session.leases.append(_hold("a.semaphore", 100.0))
    reason = guard.expired(105.1)
    assert reason is not None and "no check was sent since its last proof" in reason
    guard.sending("a.semaphore", 102.5)
    guard.sending("a.semaphore", 103.6)
    reason = guard.expired(105.1)
    assert reason is not None
    assert "2 check(s) sent since its last proof, the newest 1.5 s ago" in reason
    assert "1.1 s after it was due" in reason  # granted at 100: due at 102.5
    assert "woke up" not in reason
    guard._late.append((99.0, 2.0))  # before the bound: not this drop's story
    guard._late.append((104.0, 0.8))  # the run loop starved (a loaded machine)
    reason = guard.expired(105.1)
    assert reason is not None and "its loop woke up to 0.8 s late" in reason
    guard.answered("a.semaphore", 103.6, None)  # an answer is a proof: the count starts again
    assert guard.expired(105.1) is None
    reason = guard.expired(108.8)
    assert reason is not None and "no check was sent since its last proof" in reason


def test_held_locks_that_answer_prove_the_node_while_the_probes_stall() -> None:
    """The probe queue's leader died (its node was killed): probes go unconfirmed until a
    new leader is elected, which took over 5 s in CI on a loaded 4.3.6 cluster. A holder
    whose locks' own leaders keep answering is not dropped for it; one holding nothing
    has no other proof."""
    clock = Clock()
    guard, _ = _guard(ClusterTiming(10, 5, 10), clock)
    guard.confirm(100.0)  # the last probe confirmed before the leader died
    a = _hold("a.semaphore", 99.0)
    guard.session.leases.append(a)
    guard.lock_proofs["a.semaphore"] = 104.0
    assert guard.expired(108.0) is None  # probes stale for 8 s, the lock proven at 104
    reason = guard.expired(109.1)  # and once the lock's own proof is too old, it is told
    assert reason is not None and "'a.semaphore'" in reason
    a.released = True  # nothing held: only the probes prove the node
    reason = guard.expired(105.1)
    assert reason is not None and "no quorum-queue confirm" in reason


def test_probe_queue_names_the_node() -> None:
    assert probe_queue("10.0.0.2", 5672) == "amqp-locks.quorum-guard.10.0.0.2:5672"
    # A host too long for a readable name is escaped (names.py): short, and still its own.
    assert len(probe_queue("h" * 400, 1)) <= 255
    assert probe_queue("h" * 400, 1) != probe_queue("h" * 401, 1)


def test_a_deleted_probe_queue_proves_nothing_and_is_declared_again(amqp_url: str) -> None:
    """An unroutable publish is confirmed by any node, quorum or not: a guard whose probe
    queue was deleted must not count those confirms, and must declare the queue again."""
    guarded = Broker(amqp_url, cluster=True, net_ticktime=10, quorum_timeout=5)
    other = Broker(amqp_url)
    try:
        core = guarded.core
        guard = core.run(core.session()).guard
        assert guard is not None
        queue = guard._queue
        wait_for(lambda: guard.confirmed >= 1, 10, "a first confirmed probe")
        other.core.run(_delete(other, queue))
        wait_for(lambda: guard.returned >= 1, 10, "a probe returned unroutable")
        confirmed = guard.confirmed
        wait_for(lambda: other.core.run(_exists(other, queue)), 10, "the queue declared again")
        wait_for(lambda: guard.confirmed > confirmed, 10, "confirms on the new queue")
        assert core.run(core.session()).alive
    finally:
        guarded.close()
        other.core.run(_delete(other, queue))
        other.close()


async def _delete(broker: Broker, queue: str) -> None:
    await (await broker.core.session()).delete(queue)


async def _exists(broker: Broker, queue: str) -> bool:
    return await (await broker.core.session()).exists_passive(queue)


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def test_held_locks_are_checked_on_their_own_queues(amqp_url: str, name: str) -> None:
    """The per-lock check on a real broker: a held mutex's queue answers with no token
    to take (its only one is ours); a semaphore with a permit to spare has it taken by a
    check and given back at once, so another client still gets it."""
    from amqp_locks import Mutex, TokenSemaphore
    from amqp_locks.names import quorum_mutex_name, token_queue

    with Broker(amqp_url, cluster=True) as guarded, Broker(amqp_url, cluster=True) as other:
        core = guarded.core
        guard = core.run(core.session()).guard
        assert guard is not None
        mutex_queue = token_queue(quorum_mutex_name(name))
        with Mutex(guarded, name).acquire(timeout=10):
            wait_for(lambda: mutex_queue in guard.lock_proofs, 10, "the mutex checked")
            checked = guard.checked
            wait_for(lambda: guard.checked >= checked + 2, 10, "two more checks")
            assert guard.taken == 0
        wait_for(lambda: mutex_queue not in guard.lock_proofs, 10, "the released mutex forgotten")

        sem = TokenSemaphore(guarded, f"{name}-t")
        sem.setup(2)
        with sem.acquire(timeout=10):
            wait_for(lambda: guard.taken >= 1, 10, "a check that took the spare permit")
            for _ in range(5):  # the spare permit stays available to others
                permit = TokenSemaphore(other, f"{name}-t").acquire(timeout=5)
                assert permit is not None
                permit.release(wait=True)
            assert core.run(core.session()).alive
        sem.destroy()


LOCKS = 300  # held through one connection behind the proxy
RTT = 0.010  # added round trip (half each way)


def test_many_held_locks_behind_a_slow_link_stay_held_and_a_cut_is_told(
    amqp_url: str, name: str
) -> None:
    """Issue 37: checks one at a time on one channel, each dated from when it was queued,
    dropped a healthy connection holding 250 locks at 10 ms of added round trip. Pipelined,
    every held lock is proven again and again with none lost; a real cut (the proxy goes
    silent both ways) is still told within quorum_timeout plus one step."""
    from amqp_locks import Mutex

    from .faultproxy import FaultProxy

    host, port = amqp_url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with FaultProxy(host, int(port), amqp=True) as proxy:
        broker = Broker(proxy.url(), cluster=True)
        try:
            leases = [
                Mutex(broker, f"{name}-{i}", fencing=False).acquire(timeout=30)
                for i in range(LOCKS)
            ]
            assert None not in leases
            core = broker.core
            guard = core.run(core.session()).guard
            assert guard is not None
            period = core.timing.check_period
            proxy.delay(RTT / 2)
            slowed = time.monotonic()
            for _ in range(2):  # every lock proven twice by checks sent after the delay
                since = time.monotonic()
                wait_for(
                    lambda since=since: (
                        len(guard.lock_proofs) == LOCKS and min(guard.lock_proofs.values()) > since
                    ),
                    4 * period,
                    "every held lock checked",
                )
            assert not [lease for lease in leases if lease.lost.is_set()]
            assert guard.checked >= 2 * LOCKS and guard.most_in_flight > 1, "not pipelined"
            print(
                f"\n{LOCKS} locks at {RTT * 1000:g} ms added: {guard.checked} checks in "
                f"{time.monotonic() - slowed:.1f} s, slowest answer {guard.slowest:.2f} s, "
                f"{guard.most_in_flight} in flight at most"
            )

            proxy.blackhole()
            cut = time.monotonic()
            bound = core.timing.quorum_timeout + guard._step
            assert leases[0].lost.wait(bound + SLACK), "the cut was not told in time"
            told = time.monotonic() - cut
            assert all(lease.lost.wait(1) for lease in leases)
            print(f"cut told after {told:.2f} s ({leases[0].lost_reason})")
        finally:
            proxy.passthrough()
            broker.close()


SLACK = 1.5  # scheduling on a loaded 2-core machine


def test_pipelined_gets_are_answered_in_order(amqp_url: str, name: str) -> None:
    """The guard writes many ``basic.get`` frames at once and matches replies by order
    (aiormq_compat.route_gets): an empty queue answers None, one with a message its
    delivery tag (content read off the channel), each in the order sent."""
    import aiormq

    from amqp_locks.transport.aiormq_compat import route_gets, send_together

    async def run() -> list[int | None]:
        conn = await aiormq.connect(amqp_url)
        try:
            ch = await conn.channel()
            empty, full = f"{name}-empty", f"{name}-full"
            for queue in (empty, full):
                await ch.queue_declare(queue, auto_delete=True)
            await ch.basic_publish(b"x" * 10, routing_key=full)
            gets = await conn.channel()
            replies: list[int | None] = []
            done = asyncio.Event()

            def on_reply(tag: int | None) -> None:
                replies.append(tag)
                if len(replies) == 3:
                    done.set()

            route_gets(gets, on_reply)
            frames = [Basic.Get(queue=q, no_ack=True) for q in (empty, full, empty)]
            await send_together(gets, frames)
            await asyncio.wait_for(done.wait(), 10)
            for queue in (empty, full):
                await ch.queue_delete(queue)
            return replies
        finally:
            await conn.close()

    replies = asyncio.run(run())
    assert replies[0] is None and isinstance(replies[1], int) and replies[2] is None


def test_an_overdue_check_is_sent_again_on_a_channel_that_is_not_stalled() -> None:
    """A lock queue's leader killed with a check in flight: that check (and every later
    one on its channel) may wait for the new leader for ever. Once it is half a check
    period overdue the queue is due again, and the stalled channel takes no more."""
    clock = Clock()
    timing = ClusterTiming(10, 5, 10)  # check period 2.5 s, overdue after 1.25 s
    guard, _ = _guard(timing, clock)
    guard.session.leases.append(_hold("a.semaphore", 90.0))
    held = guard.held()
    assert guard.due(100.0, held) == ["a.semaphore"]
    guard._in_flight["a.semaphore"] = 100.0  # sent, no answer yet
    assert guard.due(100.0, held) == [] and guard.due(101.2, held) == []
    assert guard.due(101.25, held) == ["a.semaphore"]  # overdue: sent again
    pipe: Any = SimpleNamespace(fifo=[("a.semaphore", 100.0)])
    assert _Pipe.stalled(pipe, 101.25 - 1.25) and not _Pipe.stalled(pipe, 99.9)
    guard._in_flight["a.semaphore"] = 101.25  # the new check; the old answering late
    guard.answered("a.semaphore", 100.0, None)  # still proves from its own send time
    assert guard.lock_proofs["a.semaphore"] == 100.0
    assert guard._in_flight == {"a.semaphore": 101.25}  # the newer one still counts
