"""Reference floors: what one round trip, and each broker operation a lock is made of,
costs before any lock logic runs.

- loopback TCP: a 16-byte ping to an echo server in another process on 127.0.0.1; the
  kernel + Python socket floor no broker protocol can beat.
- broker: ``Broker.round_trip()`` (a passive exchange declare), i.e. the caller thread ->
  private I/O thread -> aiormq -> RabbitMQ -> back.
- raw aiormq (no library code, one asyncio loop in this process), the floors the issue's
  targets are ratios to:

  - ``basic.get`` of a ready message on an open channel (classic and quorum queue), the
    message returned with ``basic.reject(requeue)`` (untimed) between samples: the floor
    of an uncontended token acquire;
  - ``basic.reject(requeue)`` on connection A -> delivery to a prefetch-1 consumer on
    connection B (classic and quorum), timed from just before the reject to B's delivery
    callback; A cancelled its consumer first (untimed, as a token release does) and
    consumes again afterwards, so the roles swap every sample: the floor of a token handoff;
  - exclusive ``queue.declare`` on an open channel, and its ``queue.delete`` timed
    separately: the floor of a mutex / persistent-semaphore acquire and handoff.

- the steps of an acquire (``primitives``), through the library's session API.
- sequence floors (:data:`SEQUENCES`): raw aiormq doing, step for step, the broker
  operations one of ours is made of, shown beside the targets' ratios as information (a
  target whose own floor is below its sequence floor cannot be met by client code).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

import aiormq
from aiormq.abc import ChannelFrame, DeliveredMessage
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from amqp_locks import Broker, SemaphoreAdmin
from amqp_locks.fencing import take_token
from amqp_locks.names import holder_queue, slot_queue
from amqp_locks.semaphore.client import HOLDER_ARGS

from .latency import unique_name
from .stats import summarize_reps

PING = b"amqp-locks-bench"  # 16 bytes, about the size of a small AMQP method frame


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("echo peer closed")
        buf += chunk
    return buf


def _echo_server(port_pipe: Connection) -> None:
    """Accept one client and echo fixed-size pings until it closes (runs in a child)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_pipe.send(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    data = _recv_exact(conn, len(PING))
                except ConnectionError:
                    return
                conn.sendall(data)


def loopback_rtt(samples: int, reps: int) -> list[list[float]]:
    """Round trips (seconds) to an echo server in a separate process, ``reps`` times."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_server, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("echo server did not start")
        port = parent.recv()
        out: list[list[float]] = []
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(200):  # warm-up: page in, settle the scheduler
                sock.sendall(PING)
                _recv_exact(sock, len(PING))
            for _ in range(reps):
                rep: list[float] = []
                for _ in range(samples):
                    t0 = time.perf_counter()
                    sock.sendall(PING)
                    _recv_exact(sock, len(PING))
                    rep.append(time.perf_counter() - t0)
                out.append(rep)
        return out
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def broker_rtt(url: str, samples: int, reps: int) -> list[list[float]]:
    """``Broker.round_trip()`` latencies (seconds) on a fresh connection, ``reps`` times."""
    with Broker(url) as broker:
        broker.connect()
        for _ in range(100):
            broker.round_trip()
        out: list[list[float]] = []
        for _ in range(reps):
            rep: list[float] = []
            for _ in range(samples):
                t0 = time.perf_counter()
                broker.round_trip()
                rep.append(time.perf_counter() - t0)
            out.append(rep)
        return out


# ------------------------------------------------------------------ raw aiormq floors

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
    "mutex_handoff": "a mutex handoff's broker steps after 50 ms idle: `queue.delete` N, "
    "then a mandatory notice -> waiter on another connection: exclusive declare N, "
    "then `basic.consume` N and quorum fence `basic.get` + reject",
}
#: The sequence floors: raw aiormq doing, step for step, the broker operations one of our
#: operations is made of (the other floors are the single operation the targets name).
SEQUENCES = ("token_cycle", "token_handoff_tx", "mutex_handoff")


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
    args: dict[str, Any] = {"x-queue-type": "quorum"}
    if version >= (4, 0):
        args["x-delivery-limit"] = -1
    return args


async def _connect(url: str, what: str) -> aiormq.abc.AbstractConnection:
    return await aiormq.connect(url, client_properties={"connection_name": f"bench floor {what}"})


async def _one_message_queue(
    conn: aiormq.abc.AbstractConnection, quorum: bool
) -> tuple[aiormq.abc.AbstractChannel, str]:
    """A fresh durable queue holding one message (durable: 4.x refuses transient ones)."""
    ch = await conn.channel(publisher_confirms=True)
    name = f"bench-floor-{'qq' if quorum else 'cq'}-{uuid.uuid4().hex[:8]}"
    args = queue_arguments(server_version(conn.server_properties), quorum)
    await ch.queue_declare(name, durable=True, arguments=args)
    await ch.basic_publish(b"token", routing_key=name)
    return ch, name


def _timed_reps(
    sample: Callable[[], Awaitable[float | None]], samples: int, reps: int, warmup: int
) -> Callable[[], Awaitable[tuple[list[list[float]], int]]]:
    """Coroutine factory: ``warmup`` untimed samples, then ``reps`` x ``samples``; a sample
    that returns None (e.g. ``basic.get-empty``) is counted as a miss and taken again."""

    async def run() -> tuple[list[list[float]], int]:
        misses = 0
        for _ in range(warmup):
            await sample()
        out: list[list[float]] = []
        for _ in range(reps):
            rep: list[float] = []
            while len(rep) < samples:
                dt = await sample()
                if dt is None:
                    misses += 1
                    if misses > 10 * samples * reps:
                        raise RuntimeError("the floor queue keeps coming back empty")
                    await asyncio.sleep(0.001)
                    continue
                rep.append(dt)
            out.append(rep)
        return out, misses

    return run


async def _get_floor(url: str, quorum: bool, samples: int, reps: int) -> dict[str, Any]:
    conn = await _connect(url, "basic.get")
    try:
        ch, name = await _one_message_queue(conn, quorum)

        async def sample() -> float | None:
            t0 = time.perf_counter()
            msg = await ch.basic_get(name, no_ack=False)
            dt = time.perf_counter() - t0
            if isinstance(msg.delivery, spec.Basic.GetEmpty) or msg.delivery_tag is None:
                return None  # the previous reject has not requeued it yet
            await ch.basic_reject(msg.delivery_tag, requeue=True)
            return dt

        try:
            out, misses = await _timed_reps(sample, samples, reps, min(50, samples))()
        finally:
            await ch.queue_delete(name)
        return {"reps": out, "misses": misses}
    finally:
        await conn.close()


class _Side:
    """One connection of the reject -> deliver floor: a prefetch-1 consumer."""

    def __init__(self, ch: aiormq.abc.AbstractChannel, queue: str) -> None:
        self.ch, self.queue = ch, queue
        self.tag: str | None = None
        self.delivery: int | None = None
        self.at = 0.0
        self.got: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def consume(self) -> None:
        self.got = asyncio.get_running_loop().create_future()

        async def on_message(msg: DeliveredMessage) -> None:
            self.at = time.perf_counter()
            self.delivery = msg.delivery_tag
            if not self.got.done():
                self.got.set_result(None)

        ok = await self.ch.basic_consume(self.queue, on_message, no_ack=False)
        self.tag = ok.consumer_tag

    async def hand_over(self) -> float:
        """Cancel (untimed), then reject the held message; returns the time just before."""
        assert self.tag is not None and self.delivery is not None
        await self.ch.basic_cancel(self.tag)
        t0 = time.perf_counter()
        await self.ch.basic_reject(self.delivery, requeue=True)
        return t0

    async def hand_over_in_tx(self) -> tuple[float, asyncio.Task[Any]]:
        """A fenced token release's broker steps: cancel (nowait), ack and publish the
        message again in one write, then `tx.commit` (its reply awaited in the returned
        task, untimed); returns the time just before the write."""
        assert self.tag is not None and self.delivery is not None
        chan: Any = self.ch
        chan.consumers.pop(self.tag, None)  # nowait: no cancel-ok will come
        frames = [
            spec.Basic.Cancel(consumer_tag=self.tag, nowait=True),
            spec.Basic.Ack(delivery_tag=self.delivery),
            spec.Basic.Publish(exchange="", routing_key=self.queue),
            ContentHeader(body_size=len(b"token"), properties=spec.Basic.Properties()),
            ContentBody(b"token"),
        ]
        t0 = time.perf_counter()
        await write_together(self.ch, frames)
        return t0, asyncio.ensure_future(self.ch.tx_commit())


async def write_together(ch: aiormq.abc.AbstractChannel, frames: list[Any]) -> None:
    """Raw aiormq: queue methods that expect no reply as one write on `ch` (what the
    library's ``send_together`` does, written here so the floors use no library code)."""
    chan: Any = ch
    async with chan.lock:
        await chan.write_queue.put(ChannelFrame.marshall(channel_number=chan.number, frames=frames))


async def _handoff_floor(
    url: str, quorum: bool, samples: int, reps: int, tx: bool = False
) -> dict[str, Any]:
    ca = await _connect(url, "reject A")
    cb = await _connect(url, "reject B")
    try:
        setup, name = await _one_message_queue(ca, quorum)
        sides = []
        for conn in (ca, cb):
            ch = await conn.channel(publisher_confirms=not tx)
            await ch.basic_qos(prefetch_count=1)
            if tx:
                await ch.tx_select()
            sides.append(_Side(ch, name))
        holder, waiter = sides
        await holder.consume()
        await asyncio.wait_for(holder.got, 10)
        await waiter.consume()

        async def sample() -> float:
            nonlocal holder, waiter
            commit = None
            if tx:
                t0, commit = await holder.hand_over_in_tx()
            else:
                t0 = await holder.hand_over()
            await asyncio.wait_for(waiter.got, 10)
            dt = waiter.at - t0
            if commit is not None:
                await commit
            await holder.consume()  # the releaser waits next
            holder, waiter = waiter, holder
            return dt

        try:
            out, _ = await _timed_reps(sample, samples, reps, min(20, samples))()
        finally:
            await setup.queue_delete(name)
        return {"reps": out}
    finally:
        await cb.close()
        await ca.close()


async def _declare_floor(url: str, samples: int, reps: int) -> dict[str, Any]:
    conn = await _connect(url, "exclusive declare")
    try:
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

        warmup = min(20, samples)
        out, _ = await _timed_reps(sample, samples, reps, warmup)()
        dels = deletes[warmup:]
        return {
            "reps": out,
            "delete_reps": [dels[i * samples : (i + 1) * samples] for i in range(reps)],
        }
    finally:
        await conn.close()


async def _token_cycle_floor(url: str, samples: int, reps: int) -> dict[str, Any]:
    """Consume -> delivery of a token whose last release (cancel, ack, re-publish, commit on
    the other channel) was sent but not yet committed: what an acquire right after a
    release waits for, with no library code in between."""
    conn = await _connect(url, "token cycle")
    try:
        setup, name = await _one_message_queue(conn, quorum=False)
        chans = []
        for _ in range(2):
            ch = await conn.channel(publisher_confirms=False)
            await ch.basic_qos(prefetch_count=1)
            await ch.tx_select()
            chans.append(ch)
        committing: list[asyncio.Task[Any]] = []
        turn = 0

        async def give_back(ch: aiormq.abc.AbstractChannel, tag: str, delivery: int) -> None:
            await ch.basic_cancel(tag, nowait=True)
            await ch.basic_ack(delivery)
            await ch.basic_publish(b"token", routing_key=name)
            await ch.tx_commit()

        async def sample() -> float:
            nonlocal turn
            ch = chans[turn % 2]
            turn += 1
            got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()

            async def on_message(msg: DeliveredMessage) -> None:
                if not got.done():
                    got.set_result(msg)

            t0 = time.perf_counter()
            ok = await ch.basic_consume(name, on_message, no_ack=False)
            msg = await got
            dt = time.perf_counter() - t0
            if committing:  # the channel we release on next must have finished its commit
                await committing.pop()
            assert msg.delivery_tag is not None
            committing.append(
                asyncio.ensure_future(give_back(ch, str(ok.consumer_tag), msg.delivery_tag))
            )
            return dt

        try:
            out, _ = await _timed_reps(sample, samples, reps, min(50, samples))()
        finally:
            if committing:
                await committing.pop()
            await setup.queue_delete(name)
        return {"reps": out}
    finally:
        await conn.close()


MUTEX_SETTLE = 0.05  # seconds the holder holds before each handoff (the benchmark's settle)


async def _mutex_handoff_floor(url: str, samples: int, reps: int) -> dict[str, Any]:
    """The broker steps of a mutex handoff, raw: the holder deletes N and, on delete-ok,
    publishes a mandatory notice; the waiter, on the notice, declares N exclusive, then
    consumes N and takes the fence (quorum get + reject) at once. Timed from the delete
    to the waiter's last reply."""
    ca, cb = await _connect(url, "mutex A"), await _connect(url, "mutex B")
    try:
        tag = uuid.uuid4().hex[:8]
        lock, wakeups = f"bench-floor-m-{tag}", f"bench-floor-m-{tag}-wakeups"
        fence_ch, fence = await _one_message_queue(cb, quorum=True)
        a_ch = await ca.channel()
        b_ch, b_watch, b_wake = [await cb.channel() for _ in range(3)]
        await b_watch.basic_qos(prefetch_count=1)
        await b_wake.basic_qos(prefetch_count=1)
        await b_wake.queue_declare(wakeups, durable=True, arguments={"x-expires": 600_000})
        notices: asyncio.Queue[int] = asyncio.Queue()

        async def on_notice(msg: DeliveredMessage) -> None:
            assert msg.delivery_tag is not None
            notices.put_nowait(msg.delivery_tag)

        await b_wake.basic_consume(wakeups, on_notice, no_ack=False)

        async def sample() -> float:
            await a_ch.queue_declare(lock, exclusive=True)
            await asyncio.sleep(MUTEX_SETTLE)
            t0 = time.perf_counter()
            await a_ch.queue_delete(lock)
            await a_ch.basic_publish(b"0", routing_key=wakeups, mandatory=True)
            notice = await notices.get()
            await b_ch.queue_declare(lock, exclusive=True)

            async def take_fence() -> None:
                msg = await b_ch.basic_get(fence, no_ack=False)
                assert msg.delivery_tag is not None
                await b_ch.basic_reject(msg.delivery_tag, requeue=True)

            ok, _ = await asyncio.gather(
                b_watch.basic_consume(lock, lambda _m: asyncio.sleep(0), no_ack=True),
                take_fence(),
            )
            dt = time.perf_counter() - t0
            await b_wake.basic_ack(notice)
            await b_watch.basic_cancel(str(ok.consumer_tag))
            await b_ch.queue_delete(lock)
            return dt

        try:
            out, _ = await _timed_reps(sample, samples, reps, min(5, samples))()
        finally:
            await fence_ch.queue_delete(fence)
            await b_wake.queue_delete(wakeups)
        return {"reps": out}
    finally:
        await cb.close()
        await ca.close()


def raw_floors(url: str, samples: int, reps: int) -> dict[str, dict[str, Any]]:
    """Every raw-aiormq floor: label -> {"reps": [[seconds]], ...} (see :data:`RAW`)."""
    out: dict[str, dict[str, Any]] = {}
    for quorum, kind in ((False, "classic"), (True, "quorum")):
        out[f"get_{kind}"] = asyncio.run(_get_floor(url, quorum, samples, reps))
        out[f"reject_deliver_{kind}"] = asyncio.run(_handoff_floor(url, quorum, samples, reps))
    declare = asyncio.run(_declare_floor(url, samples, reps))
    out["exclusive_declare"] = {"reps": declare["reps"]}
    out["exclusive_delete"] = {"reps": declare["delete_reps"]}
    out["token_cycle"] = asyncio.run(_token_cycle_floor(url, samples, reps))
    out["token_handoff_tx"] = asyncio.run(_handoff_floor(url, False, samples, reps, tx=True))
    # Each handoff sample holds for MUTEX_SETTLE: a tenth of the samples keeps it short.
    out["mutex_handoff"] = asyncio.run(_mutex_handoff_floor(url, max(10, samples // 10), reps))
    return out


# ------------------------------------------------------------- steps of an acquire

Step = Callable[[], Awaitable[None]]


def primitives(url: str, samples: int, reps: int, rtt_ms: float) -> dict[str, Any]:
    """The AMQP steps an acquire is made of, timed one by one through the library's internal
    session API (the same calls the client makes), to explain where its time goes: an
    uncontended semaphore acquire is one window of 16 probes (`A[1..8]`, `B[1..8]`), the
    exclusive declare of `B[k]` overlapped with opening the lease's watch channel, two
    consumes overlapped with taking a fencing token from the quorum fence queue; a release
    deletes `B[k]`. p50/p99 of each step; ``declare``/``delete`` alternate on one queue."""
    out: dict[str, Any] = {}
    with Broker(url) as broker:
        core = broker._core
        name = unique_name("prim")
        admin = SemaphoreAdmin(broker, name)
        admin.create(8)
        window = [slot_queue(name, k) for k in range(1, 9)]
        window += [holder_queue(name, k) for k in range(1, 9)]
        scratch = f"{name}-scratch"

        async def probe16() -> None:
            await (await core.session()).probe(window)

        async def probe1() -> None:
            await (await core.session()).probe(window[:1])

        async def declare() -> None:
            await (await core.session()).declare(scratch, exclusive=True, arguments=HOLDER_ARGS)

        async def delete() -> None:
            await (await core.session()).delete(scratch)

        async def channel() -> None:
            ch = await (await core.session()).open_channel()
            await ch.close()

        async def token() -> None:
            await take_token(await core.session(), name)

        # (label, untimed step before, timed step, untimed step after)
        steps: list[tuple[str, Step | None, Step, Step | None]] = [
            ("probe: 1 queue", None, probe1, None),
            ("probe: window of 16 queues", None, probe16, None),
            ("open + close a channel (publisher confirms)", None, channel, None),
            ("declare an exclusive queue", None, declare, delete),
            ("delete that queue", declare, delete, None),
            ("fencing token (basic.get + reject on the quorum queue)", None, token, None),
        ]
        try:
            for label, before, step, after in steps:
                reps_out: list[list[float]] = []
                for rep in range(reps + 1):  # the first repetition is a warm-up
                    rep_s: list[float] = []
                    for _ in range(samples):
                        if before is not None:
                            core.run(before())
                        t0 = time.perf_counter()
                        core.run(step())
                        rep_s.append(time.perf_counter() - t0)
                        if after is not None:
                            core.run(after())
                    if rep:
                        reps_out.append(rep_s)
                s = summarize_reps(reps_out)
                s["p50_x_rtt"] = round(s["p50_ms"] / rtt_ms, 1)
                out[label] = s
        finally:
            admin.destroy(purge_fence=True)
    return out
