"""What one acquire + release sends to the broker, method by method (docs/protocol.md,
"Methods per grant"): counted on the wire of a real broker after a warm-up, so the hot
path keeps its channels (no open, close, confirm.select or qos per grant) and never sends
a request that fails (a 404 costs the broker a channel and two error lines in its log)."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiormq.abc
import pytest
from pamqp import base, commands

from amqp_locks import (
    Broker,
    Lease,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
    TokenSemaphore,
)
from amqp_locks.transport.session import Session

from .conftest import settle

CYCLES = 10


class Wire:
    """Counts the AMQP methods this process sends while `recording` (the loss
    watchdog's pings, a `basic.qos` with prefetch 0, are not the lock's), and keeps
    every method sent or received in the order the I/O thread met them (`events`:
    direction, method, the queue or routing key it names)."""

    def __init__(self) -> None:
        self.sent: collections.Counter[str] = collections.Counter()
        self.events: list[tuple[str, str, str]] = []
        self.recording = False

    def seen(self, frames: Any) -> None:
        if not self.recording:
            return
        for frame in frames:
            if not isinstance(frame, base.Frame):
                continue  # content headers and bodies go with their publish
            if isinstance(frame, commands.Basic.Qos) and frame.prefetch_count == 0:
                continue
            self.sent[frame.name] += 1
            self.events.append(("sent", frame.name, _target(frame)))

    def received(self, frame: Any) -> None:
        if self.recording and isinstance(frame, base.Frame):
            self.events.append(("received", frame.name, _target(frame)))

    def per_cycle(self, cycles: int) -> dict[str, float]:
        return {name: n / cycles for name, n in sorted(self.sent.items())}


def _target(frame: Any) -> str:
    return str(getattr(frame, "queue", "") or getattr(frame, "routing_key", "") or "")


class _Receipts(logging.Filter):
    """aiormq logs every frame it reads (at DEBUG, the frame as the first argument): the
    one place a received frame can be seen without patching the reader. First among the
    logger's filters, before the one that routes aiormq's records to ours as text."""

    def __init__(self, wire: Wire) -> None:
        super().__init__()
        self.wire = wire

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and str(record.msg).startswith("Received frame"):
            self.wire.received(record.args[0])
            return False  # counted, not logged
        return True


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wire]:
    w = Wire()
    marshall = aiormq.abc.ChannelFrame.marshall.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, channel_number: int, frames: Any, drain_future: Any = None) -> Any:
        w.seen(frames)
        return marshall(cls, channel_number, frames, drain_future)

    monkeypatch.setattr(aiormq.abc.ChannelFrame, "marshall", classmethod(counting))
    reader = logging.getLogger("aiormq.connection")
    receipts, level = _Receipts(w), reader.level
    reader.filters.insert(0, receipts)
    reader.setLevel(logging.DEBUG)
    try:
        yield w
    finally:
        reader.removeFilter(receipts)
        reader.setLevel(level)


def _session(broker: Broker) -> Session:
    return broker.core.run(broker.core.session())


def cycles(broker: Broker, acquire: Callable[[], Lease | None], wire: Wire) -> dict[str, float]:
    """Methods sent per acquire + release, each release settled before the next acquire
    (a token's release commits in the background: without it, the next acquire would
    sometimes take a new holder channel while the last one is still committing)."""
    for _ in range(3):  # warm-up: holder queue, sentinel queue, fence, spare channels
        lease = acquire()
        assert lease is not None
        lease.release()
        settle(broker)
    wire.recording = True
    for _ in range(CYCLES):
        lease = acquire()
        assert lease is not None
        lease.release()
        settle(broker)
    wire.recording = False
    return wire.per_cycle(CYCLES)


def test_mutex_grant_sends_only_the_lock_s_own_methods(
    broker: Broker, name: str, wire: Wire
) -> None:
    sent = cycles(broker, Mutex(broker, name).acquire, wire)
    assert sent == {
        "Queue.Declare": 1,  # the exclusive queue N: the lock itself
        "Basic.Consume": 2,  # watch N; hold the sentinel
        "Basic.Get": 1,  # the fencing token ...
        "Basic.Reject": 1,  # ... and its return (+1)
        # the probes of the next fence generation and of this one's tombstone (written
        # with the get: one round trip); the sentinel; the wake-up notice
        "Basic.Publish": 4,
        "Queue.Delete": 1,  # the release
        "Basic.Cancel": 1,  # the sentinel consumer (the delete ended the watch)
        "Basic.Ack": 1,  # the sentinel
    }


def test_semaphore_grant_sends_only_the_lock_s_own_methods(
    broker: Broker, name: str, wire: Wire
) -> None:
    SemaphoreAdmin(broker, name).create(1)
    sent = cycles(broker, PersistentSemaphore(broker, name).acquire, wire)
    assert sent == {
        # probes of the quorum-slots marker (semaphore/burial.py), A[1], B[1], the next
        # fence generation, this one's tombstone; sentinel; the wake-up notice
        "Basic.Publish": 7,
        "Queue.Declare": 1,  # B[1] exclusive
        "Basic.Consume": 3,  # watch A[1] and B[1]; hold the sentinel
        "Basic.Get": 1,
        "Basic.Reject": 1,
        "Queue.Delete": 1,
        "Basic.Cancel": 2,  # the A[1] watch and the sentinel consumer
        "Basic.Ack": 2,  # the sentinel; whatever the A[1] watch holds (tag 0, multiple)
    }


def test_token_grant_sends_only_the_lock_s_own_methods(
    broker: Broker, name: str, wire: Wire
) -> None:
    sem = TokenSemaphore(broker, name)
    sem.setup(1)
    try:
        sent = cycles(broker, sem.acquire, wire)
    finally:
        sem.destroy()
    assert sent == {
        "Basic.Consume": 1,  # the wait: the broker pushes the token
        "Basic.Cancel": 1,  # the release, in one transaction:
        "Basic.Ack": 1,
        "Basic.Publish": 1,  # the token again, its counter + 1
        "Tx.Commit": 1,
    }


def test_token_grant_without_fencing_needs_no_transaction(
    broker: Broker, name: str, wire: Wire
) -> None:
    """Without fencing the release returns the token as it came: a reject on a plain
    channel, with no re-publish and no commit for the broker to process."""
    TokenSemaphore(broker, name).setup(1)
    try:
        sent = cycles(broker, TokenSemaphore(broker, name, fencing=False).acquire, wire)
    finally:
        TokenSemaphore(broker, name).destroy()
    assert sent == {"Basic.Consume": 1, "Basic.Cancel": 1, "Basic.Reject": 1}


def test_a_watch_channel_with_a_parked_probe_is_cleaned_and_reused(
    broker: Broker, amqp_url: str, name: str, wire: Wire
) -> None:
    """A searcher's probe parks on the holder's A[1] consumer; the release cancels that
    consumer and acks the probe, so the channel goes back to the pool clean and the
    broker keeps it open (an ack it refused would close it)."""
    SemaphoreAdmin(broker, name).create(1)
    sem = PersistentSemaphore(broker, name)
    lease = sem.acquire()
    assert lease is not None
    with Broker(amqp_url) as other:
        assert PersistentSemaphore(other, name).acquire(blocking=False) is None
    state: Any = lease._state
    deadline = time.monotonic() + 10
    while not state._parked:  # the probe's delivery reaches the holder's I/O thread
        assert time.monotonic() < deadline, "the searcher's probe never reached the holder"
        time.sleep(0.005)
    watch = state.watch_channel
    wire.recording = True
    lease.release()
    settle(broker)
    wire.recording = False
    assert wire.sent["Basic.Ack"] >= 2  # the sentinel and the parked probe
    session = _session(broker)
    assert watch in session._ready

    async def round_trip_on_each() -> list[bool]:
        for ch in session._ready:
            await ch.basic_qos(prefetch_count=1)
        return [ch.is_closed for ch in session._ready]

    assert not any(broker.core.run(round_trip_on_each()))
    again = sem.acquire(timeout=10)
    assert again is not None and again.number == 1
    SemaphoreAdmin(broker, name).remove_slots(1)
    assert again.lost.wait(10), "a lease on a recycled channel must still learn it lost"
    again.release()


@pytest.mark.parametrize("held_back", ["consume", "sentinel"])
def test_a_release_that_overtakes_its_sentinel_sends_the_same_methods(
    broker: Broker, name: str, wire: Wire, monkeypatch: pytest.MonkeyPatch, held_back: str
) -> None:
    """The sentinel is held in the background (queue_lease.hold_sentinel), so a quick
    release can come before its consume was answered or before the sentinel came back to
    us. Either way the release cleans the sentinel's channel as every release does (a
    cancel and an ack: the channel goes back to the pool, no close), where it once closed
    the channel (seen once in a full run on 4.0.5: Channel.Close 0.1 per grant here)."""
    from amqp_locks import queue_lease
    from amqp_locks.names import sentinel_queue

    normal = cycles(broker, Mutex(broker, name).acquire, wire)
    wire.sent.clear()
    gate = threading.Event()
    sentinels = sentinel_queue(name, "mutex")
    if held_back == "consume":
        real_consume = queue_lease.consume_at

        async def late_consume(ch: Any, queue: str, *args: Any, **kwargs: Any) -> str:
            if queue == sentinels:
                await asyncio.to_thread(gate.wait, 10)
            return await real_consume(ch, queue, *args, **kwargs)

        monkeypatch.setattr(queue_lease, "consume_at", late_consume)
    else:
        real_publish = queue_lease._publish_quietly

        async def late_publish(ch: Any, queue: str, body: bytes) -> None:
            await asyncio.to_thread(gate.wait, 10)
            await real_publish(ch, queue, body)

        monkeypatch.setattr(queue_lease, "_publish_quietly", late_publish)
    wire.recording = True
    lease = Mutex(broker, name).acquire(timeout=10)
    assert lease is not None
    lease.release()
    gate.set()
    settle(broker)
    wire.recording = False
    assert wire.per_cycle(1) == normal
    wire.sent.clear()  # the next grants (the gate open) hold as usual
    assert cycles(broker, Mutex(broker, name).acquire, wire) == normal


def test_the_broker_accepts_an_ack_of_everything_when_nothing_is_outstanding(
    broker: Broker,
) -> None:
    """The watch channel's clean-up acks "everything outstanding" (tag 0, `multiple`)
    whenever a probe may be parked; with nothing outstanding the channel must survive."""

    async def ack_nothing() -> bool:
        session = await broker.core.session()
        ch = await session.ready_channel()
        await ch.basic_ack(0, multiple=True)
        await ch.basic_qos(prefetch_count=1)  # a round trip: the ack was handled before it
        closed = ch.is_closed
        if not closed:
            await ch.close()
        return closed

    assert broker.core.run(ack_nothing()) is False


async def _take_once(broker: Broker, name: str) -> int:
    from amqp_locks.fencing import take_token

    return await take_token(await broker.core.session(), name)


def test_the_attempt_a_notice_starts_opens_no_channel(
    broker: Broker, amqp_url: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter's refused attempts cost it channels (a 405 closes the declare's channel)
    and leave its lease channel unused. The spares are replaced in the background while
    it waits, so the attempt its wake-up notice starts awaits no `channel.open`: every
    channel opened from the release on is opened by a background task."""
    opened_by: list[tuple[str, bool]] = []  # (what, in a background task of the session)
    open_channel, open_ready = Session.open_channel, Session._open_ready

    watched: list[Session] = []  # the waiter's session only (the holder's has its own)

    def recorded(kind: str, opener: Any) -> Any:
        async def wrapper(self: Session) -> Any:
            if self in watched:
                opened_by.append((kind, asyncio.current_task() in self._tasks))
            return await opener(self)

        return wrapper

    holder = Mutex(broker, name).acquire()
    assert holder is not None
    with Broker(amqp_url) as other:
        mutex = Mutex(other, name)
        assert mutex.acquire(blocking=False) is None  # refused once before waiting
        got: dict[str, Lease | None] = {}
        # The waiter's budget runs from here, through the set-up below (a loaded machine
        # may take a while), so it is generous; the wait after the release is join's.
        waiter = threading.Thread(target=lambda: got.update(lease=mutex.acquire(timeout=240)))
        waiter.start()
        session = _session(other)
        deadline = time.monotonic() + 10
        while not any(w.ready for w in session.waiters):  # refused again, now subscribed
            assert time.monotonic() < deadline, "the waiter never subscribed"
            time.sleep(0.005)
        # A connection's first take on a fence shard consumes on a channel of its own
        # (fencing.py: a lost shard then times out alone); the woken attempt is judged
        # with its shard known, as every later attempt on this connection is.
        other.core.run(_take_once(other, name))
        settle(other)  # the spares are back
        watched.append(session)
        monkeypatch.setattr(Session, "open_channel", recorded("call", open_channel))
        monkeypatch.setattr(Session, "_open_ready", recorded("ready", open_ready))
        holder.release()
        waiter.join(60)
        lease = got.get("lease")
        assert lease is not None, "the waiter did not get the mutex after the release"
        monkeypatch.undo()
        lease.release()
    # On 4.0.5 the woken attempt is sometimes refused once more (the broker answers the
    # delete before every connection sees the queue gone); a refusal costs channels and
    # starts a background refill, and the retry after it may open one itself. Judged is
    # the woken attempt: the opens before the first refill.
    first = next((i for i, (_, background) in enumerate(opened_by) if background), None)
    on_the_way = [kind for kind, background in opened_by[:first] if not background]
    assert on_the_way == [], f"the woken attempt waited for channel opens: {opened_by}"


def test_a_renewing_take_defers_the_retirement(
    broker: Broker, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take that renews its shard leaves the old generation's retirement to a task that
    sleeps RETIRE_AFTER, marked deferred (`Session.close` cancels those without waiting),
    and `settle` returns while it is pending (CI, stop 50: a renewal inside the test above
    held its `settle` 10 s and more, until the waiter's budget was gone)."""
    from amqp_locks import fencing

    monkeypatch.setattr(fencing, "RENEW_AFTER", 0)  # this take renews its shard
    broker.core.run(_take_once(broker, name))
    session = _session(broker)
    settle(broker)
    assert session.deferred, "no retirement was deferred"
    assert session.deferred <= session._tasks
    assert not any(t.done() for t in session.deferred)


def test_cluster_mode_fenced_grant_opens_no_channel(amqp_url: str, name: str, wire: Wire) -> None:
    """Issue 37: a warm fenced grant in cluster mode takes its fencing token on a pooled
    prefetch-1 channel: the probes of the next generation and this one's tombstone and a
    consume, written at once and answered by the delivery (one round trip after the lock's
    own delivery), no channel opened, closed or set up per grant."""
    with Broker(amqp_url, cluster=True) as broker:
        sent = cycles(broker, Mutex(broker, name).acquire, wire)
    for setup in ("Channel.Open", "Channel.Close", "Confirm.Select", "Basic.Qos"):
        assert setup not in sent, sent
    # the fence: one consume and its cancel; its message returned once (the lock's own
    # token is the other consume and the other reject)
    assert sent["Basic.Consume"] == 2 and sent["Basic.Cancel"] == 2, sent
    assert sent["Basic.Reject"] == 2, sent
    # One round trip for the fence: each grant's consume on its fence generation is sent
    # before the broker has answered any of that grant's probes (a probe of a missing
    # queue is answered by a basic.return naming it).
    fence = "amqp-locks-fence-"
    consumes = [
        i
        for i, (way, method, target) in enumerate(wire.events)
        if way == "sent" and method == "Basic.Consume" and target.startswith(fence)
    ]
    assert len(consumes) == CYCLES, wire.events
    for i in consumes:
        probes = [
            j
            for j in range(i)
            if wire.events[j][:2] == ("sent", "Basic.Publish")
            and wire.events[j][2].startswith(fence)
        ]
        assert probes, f"no probe before the fence consume at {i}: {wire.events}"
        between = wire.events[probes[-2] : i]  # this grant's two probes up to its consume
        answered = [e for e in between if e[0] == "received" and e[2].startswith(fence)]
        assert answered == [], f"the consume waited for the probes' answers: {between}"
