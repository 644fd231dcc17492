"""Reference floors: what one round trip, and each broker operation a lock is made of,
costs before any lock logic runs: loopback TCP to an echo process; ``Broker.round_trip()``;
raw aiormq in one asyncio loop, no library code (:data:`RAW`: the floors the targets are
ratios to, and the sequence floors, the broker steps one of ours is made of); and the AMQP
steps of an acquire through the library's session API (``primitives``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import aiormq
from aiormq.abc import AbstractChannel, AbstractConnection, ChannelFrame, DeliveredMessage
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from amqp_locks import Broker, SemaphoreAdmin
from amqp_locks.fencing import take_token
from amqp_locks.names import holder_queue, slot_queue
from amqp_locks.semaphore.client import HOLDER_ARGS

from .stats import Budget, clocked, summarize_reps, timed, unique_name

PING = b"amqp-locks-bench"  # 16 bytes, about the size of a small AMQP method frame
#: Floor labels (keys of ``results["floors"]``) measured with raw aiormq.
RAW = {
    "get_classic": "`basic.get` of a ready message, classic queue",
    "get_quorum": "`basic.get` of a ready message, quorum queue",
    "reject_deliver_classic": "`basic.reject(requeue)` -> prefetch-1 consumer on another "
    "connection, classic queue",
    "reject_deliver_quorum": "`basic.reject(requeue)` -> prefetch-1 consumer on another "
    "connection, quorum queue",
    "exclusive_declare": "exclusive `queue.declare` on an open channel",
    "exclusive_delete": "`queue.delete` of that exclusive queue",
    "token_handoff_tx": "a fenced token release's broker steps: cancel + ack + re-publish, "
    "`tx.commit` -> delivery to a prefetch-1 consumer on another connection, classic queue",
    "token_cycle": "a token acquire as a loop makes it: `basic.consume` (prefetch 1) on a "
    "second channel while the last release's `tx.commit` is in flight on the first",
    "token_handoff_plain": "a `fencing=False` token release's broker steps: cancel (nowait) "
    "+ reject(requeue) in one write -> delivery to a prefetch-1 consumer on another "
    "connection, classic queue",
    "mutex_acquire": "an uncontended mutex acquire's broker steps, back to back: exclusive "
    "declare N, then at once `basic.consume` N and the fence's two mandatory probes + "
    "quorum `basic.get` (+ reject); released by cancel + `queue.delete`, untimed",
    "semaphore_acquire": "an uncontended C=1 persistent-semaphore acquire's broker steps, "
    "back to back: mandatory probes of A[1] and B[1], exclusive declare B[1], then at once "
    "`basic.consume` A[1] and B[1] and the fence's probes + quorum `basic.get` (+ reject)",
    "mutex_handoff": "a mutex handoff's broker steps after 50 ms idle: `queue.delete` N "
    "(no-wait) and a mandatory notice behind it -> waiter on another connection: "
    "exclusive declare N, "
    "then `basic.consume` N and quorum fence `basic.get` + reject",
}
MUTEX_SETTLE = 0.05  # seconds the holder holds before each mutex handoff (as the report's)


def _echo_server(srv: socket.socket) -> None:
    """Accept one client and echo fixed-size pings until it closes (runs in a child)."""
    conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while len(data := conn.recv(len(PING), socket.MSG_WAITALL)) == len(PING):
            conn.sendall(data)


def loopback_rtt(samples: int, reps: int) -> list[list[float]]:
    """Round trips (seconds) to an echo server in a separate process."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        proc = mp.get_context("spawn").Process(target=_echo_server, args=(srv,), daemon=True)
        proc.start()
        try:
            with socket.create_connection(srv.getsockname(), timeout=10) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

                def ping() -> None:
                    sock.sendall(PING)
                    if len(sock.recv(len(PING), socket.MSG_WAITALL)) != len(PING):
                        raise ConnectionError("echo peer closed")

                # 200 warm-up pings: page in, settle the scheduler.
                return timed(clocked(ping), Budget(reps, samples, warmup=200))
        finally:
            proc.join(5)
            proc.kill()


def broker_rtt(url: str, samples: int, reps: int) -> list[list[float]]:
    """``Broker.round_trip()`` latencies (seconds) on a fresh connection."""
    with Broker(url) as broker:
        return timed(clocked(broker.connect().round_trip), Budget(reps, samples, warmup=100))


# ------------------------------------------------------------------ raw aiormq floors


def server_version(props: dict[str, Any]) -> tuple[int, int]:
    """(major, minor) of the broker from its ``server_properties`` (0, 0 if unknown)."""
    raw = props.get("version", "")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def queue_arguments(version: tuple[int, int], quorum: bool) -> dict[str, Any]:
    """A token-like queue's arguments: quorum queues never drop a message for being
    returned too often (4.x defaults ``delivery-limit`` to 20)."""
    if not quorum:
        return {}
    return {"x-queue-type": "quorum", **({"x-delivery-limit": -1} if version >= (4, 0) else {})}


@contextlib.asynccontextmanager
async def connections(url: str, n: int, what: str) -> AsyncIterator[list[AbstractConnection]]:
    props = {"connection_name": f"bench floor {what}"}
    conns = [await aiormq.connect(url, client_properties=props) for _ in range(n)]
    try:
        yield conns
    finally:
        for conn in reversed(conns):
            await conn.close()


@contextlib.asynccontextmanager
async def one_message_queue(
    url: str, n: int, quorum: bool, what: str
) -> AsyncIterator[tuple[list[AbstractConnection], AbstractChannel, str]]:
    """``n`` connections and a fresh durable queue holding one message, declared on a
    channel of the first (durable: 4.x refuses transient ones); deleted afterwards."""
    async with connections(url, n, what) as conns:
        ch = await conns[0].channel(publisher_confirms=True)
        name = f"bench-floor-{'qq' if quorum else 'cq'}-{uuid.uuid4().hex[:8]}"
        args = queue_arguments(server_version(conns[0].server_properties), quorum)
        await ch.queue_declare(name, durable=True, arguments=args)
        await ch.basic_publish(b"token", routing_key=name)
        try:
            yield conns, ch, name
        finally:
            await ch.queue_delete(name)


async def consume(ch: AbstractChannel, queue: str) -> tuple[str, asyncio.Future[Any]]:
    """``basic.consume`` on ``queue``: the consumer tag and the first delivery's future,
    set to (``perf_counter()`` on arrival, the message)."""
    got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def on_message(msg: DeliveredMessage) -> None:
        if not got.done():
            got.set_result((time.perf_counter(), msg))

    ok = await ch.basic_consume(queue, on_message, no_ack=False)
    return str(ok.consumer_tag), got


async def repeat(
    sample: Callable[[], Awaitable[float | None]], samples: int, reps: int, warmup: int
) -> list[list[float]]:
    """``warmup`` untimed samples, then ``reps`` x ``samples``; None (a miss) is taken again."""
    for _ in range(warmup):
        await sample()
    out: list[list[float]] = []
    for _ in range(reps):
        out.append([])
        while len(out[-1]) < samples:
            if (dt := await sample()) is not None:
                out[-1].append(dt)
    return out


async def take(ch: AbstractChannel, queue: str, get: bool) -> float | None:
    """Seconds to take ``queue``'s message by ``basic.get`` (None if it is not back yet) or
    ``basic.consume`` -> delivery; then, untimed, cancel the consumer and
    ``basic.reject(requeue)``, as an uncontended token acquire and release do."""
    t0 = time.perf_counter()
    if get:
        msg = await ch.basic_get(queue, no_ack=False)
    else:
        tag, got = await consume(ch, queue)
        _, msg = await got
    dt = time.perf_counter() - t0
    if msg.delivery_tag is None:  # basic.get-empty: the last reject has not requeued it yet
        await asyncio.sleep(0.001)
        return None
    if not get:
        await ch.basic_cancel(tag)
    await ch.basic_reject(msg.delivery_tag, requeue=True)
    return dt


async def take_floor(
    url: str, quorum: bool, samples: int, reps: int, get: bool = True
) -> list[list[float]]:
    """:func:`take` back to back: ``basic.get`` on the declaring channel, or consume on a
    prefetch-1 channel (the next consume may find the message still being returned)."""
    what = "basic.get" if get else "consume"
    async with one_message_queue(url, 1, quorum, what) as ((conn,), setup, name):
        ch = setup if get else await conn.channel()
        if not get:
            await ch.basic_qos(prefetch_count=1)
        warmup = min(50, samples) if get else samples
        return await repeat(lambda: take(ch, name, get), samples, reps, warmup)


async def write_together(ch: AbstractChannel, frames: list[Any]) -> None:
    """Raw aiormq: methods that expect no reply as one write on `ch` (what the library's
    ``send_together`` does, written here so the floors use no library code)."""
    chan: Any = ch
    async with chan.lock:
        await chan.write_queue.put(ChannelFrame.marshall(channel_number=chan.number, frames=frames))


#: How a handoff floor's releaser gives the message back (:func:`_hand_over`).
HandOver = Literal["reject", "together", "tx"]


async def _hand_over(
    ch: AbstractChannel, queue: str, tag: str, delivery: int, how: HandOver
) -> tuple[float, Awaitable[Any] | None]:
    """Give the held message back; returns the time just before the timed write.
    ``reject``: cancel (untimed, its reply awaited), then reject. ``together``: a
    ``fencing=False`` token release, cancel (nowait) and reject in one write. ``tx``: a
    fenced token release, cancel (nowait), ack and publish again in one write, then
    ``tx.commit`` (its reply awaited in the returned task, untimed)."""
    if how == "reject":
        await ch.basic_cancel(tag)
        t0 = time.perf_counter()
        await ch.basic_reject(delivery, requeue=True)
        return t0, None
    chan: Any = ch
    chan.consumers.pop(tag, None)  # nowait: no cancel-ok will come
    frames: list[Any] = [spec.Basic.Cancel(consumer_tag=tag, nowait=True)]
    if how == "together":
        frames.append(spec.Basic.Reject(delivery_tag=delivery, requeue=True))
    else:
        frames += [
            spec.Basic.Ack(delivery_tag=delivery),
            spec.Basic.Publish(exchange="", routing_key=queue),
            ContentHeader(body_size=len(b"token"), properties=spec.Basic.Properties()),
            ContentBody(b"token"),
        ]
    t0 = time.perf_counter()
    await write_together(ch, frames)
    return t0, (asyncio.ensure_future(ch.tx_commit()) if how == "tx" else None)


async def handoff_floor(
    url: str, quorum: bool, samples: int, reps: int, how: HandOver = "reject"
) -> list[list[float]]:
    """:data:`RAW`'s ``reject_deliver_*`` (`how`: ``together``, ``token_handoff_plain``;
    ``tx``, ``token_handoff_tx``); the roles swap."""
    async with one_message_queue(url, 2, quorum, f"handoff {how}") as (conns, _, name):
        chans = []
        for conn in conns:
            chans.append(ch := await conn.channel(publisher_confirms=how == "reject"))
            await ch.basic_qos(prefetch_count=1)
            if how == "tx":
                await ch.tx_select()
        held = await consume(chans[0], name)
        await asyncio.wait_for(held[1], 10)
        waiting = await consume(chans[1], name)

        async def sample() -> float:
            nonlocal held, waiting
            tag, got = held
            delivery = got.result()[1].delivery_tag or 0
            t0, commit = await _hand_over(chans[0], name, tag, delivery, how)
            at, _ = await asyncio.wait_for(waiting[1], 10)
            if commit is not None:
                await commit
            held, waiting = waiting, await consume(chans[0], name)  # the releaser waits next
            chans.reverse()
            return at - t0

        return await repeat(sample, samples, reps, min(20, samples))


async def _declare_floor(url: str, samples: int, reps: int) -> dict[str, list[list[float]]]:
    """Exclusive ``queue.declare`` and, timed separately, its ``queue.delete``."""
    async with connections(url, 1, "exclusive declare") as (conn,):
        ch = await conn.channel()
        name = f"bench-floor-x-{uuid.uuid4().hex[:8]}"
        deletes: list[float] = []

        async def sample() -> float:
            t0 = time.perf_counter()
            await ch.queue_declare(name, exclusive=True)
            t1 = time.perf_counter()
            await ch.queue_delete(name)
            deletes.append(time.perf_counter() - t1)
            return t1 - t0

        out = await repeat(sample, samples, reps, min(20, samples))
        dels = deletes[-samples * reps :]
        split = [dels[i * samples : (i + 1) * samples] for i in range(reps)]
        return {"exclusive_declare": out, "exclusive_delete": split}


async def _token_cycle_floor(url: str, samples: int, reps: int) -> list[list[float]]:
    """:data:`RAW`'s ``token_cycle``: what an acquire right after a release waits for."""
    async with one_message_queue(url, 1, False, "token cycle") as ((conn,), _, name):
        chans = []
        for _ in range(2):
            chans.append(ch := await conn.channel(publisher_confirms=False))
            await ch.basic_qos(prefetch_count=1)
            await ch.tx_select()
        committing: list[asyncio.Task[Any]] = []

        async def give_back(ch: AbstractChannel, tag: str, delivery: int) -> None:
            await ch.basic_cancel(tag, nowait=True)
            await ch.basic_ack(delivery)
            await ch.basic_publish(b"token", routing_key=name)
            await ch.tx_commit()

        async def sample() -> float:
            chans.reverse()
            t0 = time.perf_counter()
            tag, got = await consume(chans[0], name)
            _, msg = await got
            dt = time.perf_counter() - t0
            if committing:  # the channel we release on next must have finished its commit
                await committing.pop()
            give = give_back(chans[0], tag, msg.delivery_tag or 0)
            committing.append(asyncio.ensure_future(give))
            return dt

        try:
            return await repeat(sample, samples, reps, min(50, samples))
        finally:
            if committing:
                await committing.pop()


async def _let_go(
    watch: AbstractChannel, consumers: list[str], ch: AbstractChannel, lock: str
) -> None:
    """A raw grant's release, untimed: cancel its watch consumers, delete its queue."""
    for tag in consumers:
        await watch.basic_cancel(tag)
    await ch.queue_delete(lock)


async def _mutex_handoff_floor(url: str, samples: int, reps: int) -> list[list[float]]:
    """:data:`RAW`'s ``mutex_handoff``, from the delete to the waiter's last reply."""
    async with one_message_queue(url, 2, True, "mutex") as ((cb, ca), _, fence):
        tag = uuid.uuid4().hex[:8]
        lock, wakeups = f"bench-floor-m-{tag}", f"bench-floor-m-{tag}-wakeups"
        a_ch = await ca.channel()
        b_ch, b_watch, b_wake = [await cb.channel() for _ in range(3)]
        await b_watch.basic_qos(prefetch_count=1)
        await b_wake.basic_qos(prefetch_count=1)
        await b_wake.queue_declare(wakeups, durable=True, arguments={"x-expires": 600_000})
        notices: asyncio.Queue[int] = asyncio.Queue()

        async def on_notice(msg: DeliveredMessage) -> None:
            notices.put_nowait(msg.delivery_tag or 0)

        await b_wake.basic_consume(wakeups, on_notice, no_ack=False)

        async def take_fence() -> None:
            msg = await b_ch.basic_get(fence, no_ack=False)
            await b_ch.basic_reject(msg.delivery_tag or 0, requeue=True)

        async def sample() -> float:
            await a_ch.queue_declare(lock, exclusive=True)
            await asyncio.sleep(MUTEX_SETTLE)
            t0 = time.perf_counter()
            await a_ch.queue_delete(lock, nowait=True)  # the notice follows it on the channel
            await a_ch.basic_publish(b"0", routing_key=wakeups, mandatory=True)
            notice = await notices.get()
            await b_ch.queue_declare(lock, exclusive=True)
            ok, _ = await asyncio.gather(
                b_watch.basic_consume(lock, lambda _m: asyncio.sleep(0), no_ack=True), take_fence()
            )
            dt = time.perf_counter() - t0
            await b_wake.basic_ack(notice)
            await _let_go(b_watch, [str(ok.consumer_tag)], b_ch, lock)
            return dt

        try:
            return await repeat(sample, samples, reps, min(5, samples))
        finally:
            await b_wake.queue_delete(wakeups)


async def _probe(ch: AbstractChannel, queues: list[str]) -> list[bool]:
    """Mandatory publishes to `queues` on a confirm channel: which exist (a return says
    not), all written before the first answer is awaited."""
    sent = [
        asyncio.ensure_future(ch.basic_publish(PING, routing_key=q, mandatory=True)) for q in queues
    ]
    answers = await asyncio.gather(*sent, return_exceptions=True)
    for a in answers:
        if isinstance(a, BaseException) and not isinstance(a, aiormq.exceptions.PublishError):
            raise a
    return [not isinstance(a, aiormq.exceptions.PublishError) for a in answers]


async def _acquire_floor(url: str, samples: int, reps: int, semaphore: bool) -> list[list[float]]:
    """:data:`RAW`'s ``mutex_acquire`` / ``semaphore_acquire``: the held queue's steps as
    the library's grant makes them (queue_lease.grant), with raw aiormq on one connection."""
    what = "semaphore acquire" if semaphore else "mutex acquire"
    async with one_message_queue(url, 1, True, what) as ((conn,), _, fence):
        tag = uuid.uuid4().hex[:8]
        lock, slot = f"bench-floor-a-{tag}", f"bench-floor-a-{tag}-A"
        main, watch = await conn.channel(), await conn.channel()
        probes, fence_ch = [await conn.channel(publisher_confirms=True) for _ in range(2)]
        await watch.basic_qos(prefetch_count=1)
        if semaphore:
            await main.queue_declare(slot, durable=True, arguments={"x-max-length": 0})
        absent = [f"bench-floor-a-{tag}-gen{i}" for i in (1, 2)]

        async def take_fence() -> None:
            found = asyncio.ensure_future(_probe(fence_ch, absent))
            await asyncio.sleep(0)  # the probes are written before the get
            msg = await fence_ch.basic_get(fence, no_ack=False)
            await found
            await fence_ch.basic_reject(msg.delivery_tag or 0, requeue=True)

        async def sample() -> float:
            t0 = time.perf_counter()
            if semaphore:
                await _probe(probes, [slot, lock])
            await main.queue_declare(lock, exclusive=True)
            watched = [slot, lock] if semaphore else [lock]
            oks = await asyncio.gather(
                *(watch.basic_consume(q, lambda _m: asyncio.sleep(0)) for q in watched),
                take_fence(),
            )
            dt = time.perf_counter() - t0
            await _let_go(watch, [str(ok.consumer_tag) for ok in oks[:-1]], main, lock)
            return dt

        try:
            return await repeat(sample, samples, reps, min(20, samples))
        finally:
            if semaphore:
                await main.queue_delete(slot)


def raw_floors(url: str, samples: int, reps: int) -> dict[str, dict[str, Any]]:
    """Every raw-aiormq floor (:data:`RAW`): its summary and label."""
    out: dict[str, Any] = {}
    for quorum, kind in ((False, "classic"), (True, "quorum")):
        out[f"get_{kind}"] = asyncio.run(take_floor(url, quorum, samples, reps))
        out[f"reject_deliver_{kind}"] = asyncio.run(handoff_floor(url, quorum, samples, reps))
    out.update(asyncio.run(_declare_floor(url, samples, reps)))
    out["token_cycle"] = asyncio.run(_token_cycle_floor(url, samples, reps))
    out["token_handoff_tx"] = asyncio.run(handoff_floor(url, False, samples, reps, how="tx"))
    plain = handoff_floor(url, False, samples, reps, how="together")
    out["token_handoff_plain"] = asyncio.run(plain)
    out["mutex_acquire"] = asyncio.run(_acquire_floor(url, samples, reps, semaphore=False))
    out["semaphore_acquire"] = asyncio.run(_acquire_floor(url, samples, reps, semaphore=True))
    # Each mutex handoff sample holds for MUTEX_SETTLE: a tenth of the samples keeps it short.
    out["mutex_handoff"] = asyncio.run(_mutex_handoff_floor(url, max(10, samples // 10), reps))
    return {key: {**summarize_reps(out[key]), "label": label} for key, label in RAW.items()}


def primitives(url: str, samples: int, reps: int) -> dict[str, Any]:
    """The AMQP steps an uncontended semaphore acquire is made of (docs/benchmarks.md),
    timed one by one through the library's internal session API."""
    with Broker(url) as broker:
        core, name = broker.core, unique_name("prim")
        admin = SemaphoreAdmin(broker, name)
        admin.create(8)
        window = [f(name, k) for f in (slot_queue, holder_queue) for k in range(1, 9)]
        scratch = f"{name}-scratch"

        async def channel(s: Any) -> None:
            await (await s.open_channel()).close()

        async def declare(s: Any) -> None:
            await s.declare(scratch, exclusive=True, arguments=HOLDER_ARGS)

        async def delete(s: Any) -> None:
            await s.delete(scratch)

        # label: (timed step, untimed step before, untimed step after), each (session) -> coro
        steps: dict[str, tuple[Any, ...]] = {
            "probe: 1 queue": (lambda s: s.probe(window[:1]),),
            "probe: window of 16 queues": (lambda s: s.probe(window),),
            "open + close a channel (publisher confirms)": (channel,),
            "declare an exclusive queue": (declare, None, delete),
            "delete that queue": (delete, declare),
            "fencing token (basic.get + reject on the quorum queue)": (
                lambda s: take_token(s, name),
            ),
        }

        def run(step: Callable[[Any], Awaitable[Any]]) -> float:
            """``step(session)`` on the I/O loop, called from this thread: its seconds."""

            async def go() -> None:
                await step(await core.session())

            t0 = time.perf_counter()
            core.run(go())
            return time.perf_counter() - t0

        def sample(step: Any, before: Any = None, after: Any = None) -> float:
            if before is not None:
                run(before)
            dt = run(step)
            if after is not None:
                run(after)
            return dt

        try:  # a first repetition warms up
            budget = Budget(reps, samples, warmup=samples)
            return {
                label: summarize_reps(timed(lambda s=s: sample(*s), budget))
                for label, s in steps.items()
            }
        finally:
            admin.destroy(purge_fence=True)
