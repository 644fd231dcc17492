"""The two profilers behind docs/benchmarks.md's explanations (each prints p50s; the
report's sections on them give the measured split and the date). Without ``--url`` they run
on the private benchmark node (started and stopped like the report's).

``python -m benchmarks.run profile-acquire [-n SAMPLES]``: where an uncontended token
acquire's time goes, the same grant taken several ways:

1. ``Broker.round_trip()``: the caller -> I/O thread hop and one broker round trip.
2. ``TokenSemaphore.acquire()`` from the caller's thread (what users see).
3. The acquire coroutine timed *inside* the I/O loop (no thread hop).
4. Raw aiormq on the same pooled channel, inside the loop: ``basic.consume`` until the
   token arrives (what the acquire does on the wire), and ``basic.get``.
5. The floor of the benchmark report (`benchmarks.floors`): ``basic.get`` on a connection
   of its own, in an event loop of its own, no library code.

Each sample waits 3 ms after the release, so the previous release's commit has put the
token back (`release()` does not wait for it).

``python -m benchmarks.run profile-handoff [-n SAMPLES] [--settle S]``: where a token
handoff's time goes. Two processes take turns on one permit exactly as
``benchmarks.handoff`` does (the waiter has been blocked in ``acquire()`` for ``--settle``
seconds when the holder calls ``release()``), with CLOCK_MONOTONIC stamps taken inside the
library on both sides:

- holder: ``release()`` called (t0) -> its I/O loop writes cancel + reject/ack+publish
  (``send_together``) -> ``release()`` returns to the caller;
- waiter: its I/O loop gets the token (``on_token``) -> the acquire coroutine returns on
  the loop -> ``acquire()`` returns in the caller's thread.

Beside it, the same handoff in raw aiormq, one single-threaded asyncio process per side
(no library code, no I/O thread), with the same settle: the command arrives on a pipe,
the holder rejects the message at once, the waiter's delivery callback is the end. That
is the reject -> deliver floor of ``benchmarks.floors`` taken across processes after an
idle pause, the way the benchmark's handoff is taken.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec

from amqp_locks import Broker, TokenSemaphore
from amqp_locks.names import token_queue
from amqp_locks.tokens import acquire_permit

from .floors import _get_floor, _one_message_queue, write_together

# ------------------------------------------------------------------------- acquire

GAP = 0.003


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def _loop(core: Any, coro: Callable[[], Awaitable[float]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(core.run(coro()))
        time.sleep(GAP)
    return out


def acquire(url: str, n: int) -> dict[str, float]:
    """The p50 (ms) of an uncontended token grant taken five ways."""
    with Broker(url) as broker:
        broker.connect()
        core = broker._core
        sem = TokenSemaphore(broker, "profile-" + uuid.uuid4().hex[:8])
        sem.setup(1)
        queue = token_queue(sem.name)
        try:
            hop = []
            for _ in range(n):
                t = time.perf_counter()
                broker.round_trip()
                hop.append(time.perf_counter() - t)
            outside = []
            for _ in range(n):
                t = time.perf_counter()
                lease = sem.acquire()
                outside.append(time.perf_counter() - t)
                assert lease is not None
                lease.release()
                time.sleep(GAP)

            async def inside() -> float:
                t = time.perf_counter()
                state = await acquire_permit(
                    core, sem.name, priority=0, blocking=True, timeout=None
                )
                dt = time.perf_counter() - t
                assert state is not None
                await state.release()
                return dt

            async def raw(get: bool) -> float:
                session = await core.session()
                ch = await session.holder_channel(transactional=True)
                got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()

                async def on(m: DeliveredMessage) -> None:
                    if not got.done():
                        got.set_result(m)

                t = time.perf_counter()
                if get:
                    m = await ch.basic_get(queue, no_ack=False)
                else:
                    ok = await ch.basic_consume(queue, on, no_ack=False)
                    m = await got
                dt = time.perf_counter() - t
                if not get:
                    await ch.basic_cancel(str(ok.consumer_tag))
                tag = getattr(m.delivery, "delivery_tag", None)
                assert isinstance(tag, int)
                await ch.basic_reject(tag, requeue=True)
                await ch.tx_commit()
                session.return_holder_channel(ch, transactional=True)
                return dt

            floor = asyncio.run(_get_floor(url, False, n, 1))["reps"][0]
            return {
                "floor: raw aiormq basic.get, own connection and loop": _median_ms(floor),
                "round_trip (thread hop + RTT)": _median_ms(hop),
                "acquire, caller's thread": _median_ms(outside),
                "acquire, inside the I/O loop": _median_ms(_loop(core, inside, n)),
                "raw basic.consume -> token, inside the loop": _median_ms(
                    _loop(core, lambda: raw(False), n)
                ),
                "raw basic.get, inside the loop (floor)": _median_ms(
                    _loop(core, lambda: raw(True), n)
                ),
            }
        finally:
            sem.destroy()


# ------------------------------------------------------------------------- handoff

STAGES = (
    ("holder: release() called -> its coroutine runs on the I/O loop", "h_called", "h_loop"),
    ("holder: coroutine runs -> write sent", "h_loop", "h_write"),
    ("broker: write sent -> waiter's loop has the token", "h_write", "w_token"),
    ("waiter: token -> acquire coroutine done", "w_token", "w_done"),
    ("waiter: coroutine done -> acquire() returns", "w_done", "w_returned"),
)


def _instrument(stamps: dict[str, float]) -> None:
    """Wrap the library's steps so each records when it ran (this process only)."""
    from amqp_locks.tokens import client, permit

    release = permit.PermitState.release

    async def stamped_release(self: Any) -> None:
        stamps["h_loop"] = time.monotonic()
        await release(self)

    send_together = vars(permit)["send_together"]

    async def stamped_send(ch: Any, frames: Any) -> None:
        stamps["h_write"] = time.monotonic()
        await send_together(ch, frames)

    on_token = client._Waiter.on_token

    async def stamped_token(self: Any, message: Any) -> None:
        stamps.setdefault("w_token", time.monotonic())
        await on_token(self, message)

    acquire_permit = client.acquire_permit

    async def stamped_acquire(*args: Any, **kwargs: Any) -> Any:
        state = await acquire_permit(*args, **kwargs)
        stamps["w_done"] = time.monotonic()
        return state

    patches: list[tuple[Any, str, Any]] = [
        (permit.PermitState, "release", stamped_release),
        (permit, "send_together", stamped_send),
        (client._Waiter, "on_token", stamped_token),
        (client, "acquire_permit", stamped_acquire),
    ]
    for owner, attr, stamped in patches:
        setattr(owner, attr, stamped)


def _ours(url: str, name: str, fencing: bool, pipe: Connection) -> None:
    stamps: dict[str, float] = {}
    _instrument(stamps)
    with Broker(url) as broker:
        sem = TokenSemaphore(broker, name, fencing=fencing)
        lease = None
        pipe.send("ready")
        while (cmd := pipe.recv()) != "exit":
            stamps.clear()
            if cmd == "acquire":
                pipe.send("acquiring")
                lease = sem.acquire(timeout=60)
                stamps["w_returned"] = time.monotonic()
            elif cmd == "release" and lease is not None:
                stamps["h_called"] = time.monotonic()
                lease.release()
                stamps["h_returned"] = time.monotonic()
                lease = None
            pipe.send(dict(stamps))


async def _raw_side(url: str, queue: str, together: bool, pipe: Connection) -> None:
    conn = await aiormq.connect(url)
    ch = await conn.channel()
    await ch.basic_qos(prefetch_count=1)
    loop = asyncio.get_running_loop()
    held: list[int] = []
    stamps: dict[str, float] = {}
    consumer: list[str] = []

    async def on_message(msg: Any) -> None:
        stamps.setdefault("w_token", time.monotonic())
        held.append(msg.delivery_tag)
        pipe.send(dict(stamps))  # the acquire is done: its stamps

    commands: asyncio.Queue[str] = asyncio.Queue()
    loop.add_reader(pipe.fileno(), lambda: commands.put_nowait(pipe.recv()))
    pipe.send("ready")
    while (cmd := await commands.get()) != "exit":
        stamps.clear()
        if cmd == "acquire":
            pipe.send("acquiring")
            ok = await ch.basic_consume(queue, on_message, no_ack=False)
            consumer[:] = [str(ok.consumer_tag)]
        elif cmd == "release" and together:  # cancel (nowait) + reject in one write
            stamps["h_called"] = stamps["h_write"] = time.monotonic()
            chan: Any = ch
            chan.consumers.pop(consumer[0], None)  # nowait: no cancel-ok will come
            frames = [
                spec.Basic.Cancel(consumer_tag=consumer[0], nowait=True),
                spec.Basic.Reject(delivery_tag=held.pop(), requeue=True),
            ]
            await write_together(ch, frames)
            pipe.send(dict(stamps))
        elif cmd == "release":  # cancel (awaited, untimed), then reject
            await ch.basic_cancel(consumer[0])
            stamps["h_called"] = stamps["h_write"] = time.monotonic()
            await ch.basic_reject(held.pop(), requeue=True)
            pipe.send(dict(stamps))
    await conn.close()


def _raw(url: str, queue: str, together: bool, pipe: Connection) -> None:
    asyncio.run(_raw_side(url, queue, together, pipe))


def _run(
    ctx: Any, target: Any, args: tuple[Any, ...], n: int, settle: float
) -> list[dict[str, float]]:
    """Two workers of `target`; n timed handoffs between them; the merged stamps."""
    pipes, procs = [], []
    for _ in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(*args, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        for pipe in pipes:
            assert pipe.recv() == "ready"
        holder, waiter = pipes
        holder.send("acquire")
        assert holder.recv() == "acquiring"
        holder.recv()  # its stamps: it holds the permit
        out = []
        for i in range(n + 10):
            waiter.send("acquire")
            assert waiter.recv() == "acquiring"
            time.sleep(settle)  # the waiter is blocked in acquire() by now
            holder.send("release")
            h = holder.recv()
            w = waiter.recv()
            if i >= 10:
                out.append({**h, **w})
            holder, waiter = waiter, holder
        return out
    finally:
        for pipe in pipes:
            pipe.send("exit")
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _p50(rows: list[dict[str, float]], a: str, b: str) -> float | None:
    xs = [r[b] - r[a] for r in rows if a in r and b in r]
    return statistics.median(xs) * 1000 if xs else None


def handoff(url: str, n: int, settle: float) -> dict[str, dict[str, float | None]]:
    """Per variant (ours with and without fencing, raw aiormq twice): p50 ms per stage."""
    ctx = mp.get_context("spawn")
    results: dict[str, dict[str, float | None]] = {}
    with Broker(url) as broker:
        for fencing in (True, False):
            sem = TokenSemaphore(broker, "profile-" + uuid.uuid4().hex[:8])
            sem.setup(1)
            try:
                rows = _run(ctx, _ours, (url, sem.name, fencing), n, settle)
            finally:
                sem.destroy()
            label = "amqp-locks, fencing on" if fencing else "amqp-locks, fencing=False"
            results[label] = {what: _p50(rows, a, b) for what, a, b in STAGES}
            results[label]["total: release() called -> acquire() returns"] = _p50(
                rows, "h_called", "w_returned"
            )
            results[label]["(holder: release() called -> returns)"] = _p50(
                rows, "h_called", "h_returned"
            )

    async def make_queue() -> str:
        conn = await aiormq.connect(url)
        _, queue = await _one_message_queue(conn, quorum=False)
        await conn.close()
        return queue

    async def drop_queue(queue: str) -> None:
        conn = await aiormq.connect(url)
        ch = await conn.channel()
        await ch.queue_delete(queue)
        await conn.close()

    for together, label in (
        (False, "raw aiormq, one thread per process: cancel-ok awaited, then reject (timed)"),
        (True, "raw aiormq, one thread per process: cancel (nowait) + reject in one write"),
    ):
        queue = asyncio.run(make_queue())
        try:
            rows = _run(ctx, _raw, (url, queue, together), n, settle)
        finally:
            asyncio.run(drop_queue(queue))
        results[label] = {
            "broker: write sent -> waiter's loop has the token": _p50(rows, "h_write", "w_token"),
        }
    return results
