"""The two profilers behind docs/benchmarks.md's sections on where an uncontended token
acquire's and a token handoff's time goes (each prints p50s; those sections say how).

``profile-acquire``: one grant taken five ways, 3 ms apart (a release does not wait for its
commit). ``profile-handoff``: ``handoff.py``'s handoff with CLOCK_MONOTONIC stamps inside
the library on both sides (:data:`STAGES`), beside the same handoff in raw aiormq, one
single-threaded asyncio process per side.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import aiormq
from pamqp import commands as spec

from amqp_locks import Broker, TokenSemaphore
from amqp_locks.names import token_queue
from amqp_locks.tokens import acquire_permit

from .floors import one_message_queue, take, take_floor, write_together
from .stats import clocked, fresh_lock

GAP = 0.003


def _p50(sample: Callable[[], float], n: int, gap: float = GAP) -> float:
    """The p50 (ms) of ``n`` samples, ``gap`` s apart."""
    out = []
    for _ in range(n):
        out.append(sample())
        time.sleep(gap)
    return statistics.median(out) * 1000


def acquire(url: str, n: int) -> dict[str, float]:
    """The p50 (ms) of an uncontended token grant taken five ways."""
    with fresh_lock(url, "token", tag="profile") as name, Broker(url) as broker:
        core = broker.connect().core
        sem, queue = TokenSemaphore(broker, name), token_queue(name)

        def outside() -> float:
            t = time.perf_counter()
            lease = sem.acquire()
            dt = time.perf_counter() - t
            assert lease is not None
            lease.release()
            return dt

        async def inside() -> float:
            t = time.perf_counter()
            state = await acquire_permit(core, sem.name, priority=0, blocking=True, timeout=None)
            dt = time.perf_counter() - t
            assert state is not None
            await state.release()
            return dt

        async def raw(get: bool) -> float | None:
            session = await core.session()
            ch = await session.holder_channel(transactional=True)
            dt = await take(ch, queue, get)
            await ch.tx_commit()
            session.return_holder_channel(ch, transactional=True)
            return dt

        hop, caller = _p50(clocked(broker.round_trip), n, 0), _p50(outside, n)
        floor = statistics.median(asyncio.run(take_floor(url, False, n, 1))[0]) * 1000
        return {
            "floor: raw aiormq basic.get, own connection and loop": floor,
            "round_trip (thread hop + RTT)": hop,
            "acquire, caller's thread": caller,
            "acquire, inside the I/O loop": _p50(lambda: core.run(inside()), n),
            "raw basic.consume -> token, inside the loop": _p50(lambda: core.run(raw(False)), n),
            "raw basic.get, inside the loop (floor)": _p50(lambda: core.run(raw(True)), n),
        }


STAGES = (
    ("holder: release() called -> its coroutine runs on the I/O loop", "h_called", "h_loop"),
    ("holder: coroutine runs -> write sent", "h_loop", "h_write"),
    ("broker: write sent -> waiter's loop has the token", "h_write", "w_token"),
    ("waiter: token -> acquire coroutine done", "w_token", "w_done"),
    ("waiter: coroutine done -> acquire() returns", "w_done", "w_returned"),
    ("total: release() called -> acquire() returns", "h_called", "w_returned"),
    ("(holder: release() called -> returns)", "h_called", "h_returned"),
)


def _instrument(stamps: dict[str, float]) -> None:
    """Wrap the library's steps so each records when it ran (this process only)."""
    from amqp_locks.tokens import client, permit

    def stamped(owner: Any, attr: str, key: str, after: bool = False, first: bool = False) -> None:
        original = getattr(owner, attr)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not after and not (first and key in stamps):
                stamps[key] = time.monotonic()
            result = await original(*args, **kwargs)
            if after:
                stamps[key] = time.monotonic()
            return result

        setattr(owner, attr, wrapper)

    stamped(permit.PermitState, "release", "h_loop")
    stamped(permit, "send_together", "h_write")
    stamped(client._Waiter, "on_token", "w_token", first=True)
    stamped(client, "acquire_permit", "w_done", after=True)


def _ours(url: str, name: str, fencing: bool, pipe: Any) -> None:
    stamps: dict[str, float] = {}
    _instrument(stamps)
    with Broker(url) as broker:
        sem, lease = TokenSemaphore(broker, name, fencing=fencing), None
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


async def _raw_side(url: str, queue: str, together: bool, pipe: Any) -> None:
    conn = await aiormq.connect(url)
    ch = await conn.channel()
    await ch.basic_qos(prefetch_count=1)
    held: list[int] = []
    stamps: dict[str, float] = {}
    consumer = ""

    async def on_message(msg: Any) -> None:
        stamps.setdefault("w_token", time.monotonic())
        held.append(msg.delivery_tag)
        pipe.send(dict(stamps))  # the acquire is done: its stamps

    commands: asyncio.Queue[str] = asyncio.Queue()
    asyncio.get_running_loop().add_reader(pipe.fileno(), lambda: commands.put_nowait(pipe.recv()))
    pipe.send("ready")
    while (cmd := await commands.get()) != "exit":
        stamps.clear()
        if cmd == "acquire":
            pipe.send("acquiring")
            consumer = str((await ch.basic_consume(queue, on_message, no_ack=False)).consumer_tag)
        elif together:  # release: cancel (nowait) + reject in one write
            stamps["h_called"] = stamps["h_write"] = time.monotonic()
            chan: Any = ch
            chan.consumers.pop(consumer, None)  # nowait: no cancel-ok will come
            cancel = spec.Basic.Cancel(consumer_tag=consumer, nowait=True)
            await write_together(
                ch, [cancel, spec.Basic.Reject(delivery_tag=held.pop(), requeue=True)]
            )
            pipe.send(dict(stamps))
        else:  # release: cancel (awaited, untimed), then reject
            await ch.basic_cancel(consumer)
            stamps["h_called"] = stamps["h_write"] = time.monotonic()
            await ch.basic_reject(held.pop(), requeue=True)
            pipe.send(dict(stamps))
    await conn.close()


def _raw(url: str, queue: str, together: bool, pipe: Any) -> None:
    asyncio.run(_raw_side(url, queue, together, pipe))


def _run(target: Any, args: tuple[Any, ...], n: int, settle: float) -> list[dict[str, float]]:
    """Two workers of `target`; n timed handoffs between them (after 10 untimed); the
    stamps of each, both sides merged."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(2):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=target, args=(*args, child), daemon=True))
        procs[-1].start()
        pipes.append(parent)
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
            h, w = holder.recv(), waiter.recv()
            out += [{**h, **w}] if i >= 10 else []
            holder, waiter = waiter, holder
        return out
    finally:
        for pipe in pipes:
            pipe.send("exit")
        for p in procs:
            p.join(10)
            p.kill()


def _stage_p50(rows: list[dict[str, float]], a: str, b: str) -> float | None:
    xs = [r[b] - r[a] for r in rows if a in r and b in r]
    return statistics.median(xs) * 1000 if xs else None


def handoff(url: str, n: int, settle: float) -> dict[str, dict[str, float | None]]:
    """Per variant (ours with and without fencing, raw aiormq twice): p50 ms per stage."""
    results: dict[str, dict[str, float | None]] = {}
    for fencing in (True, False):
        with fresh_lock(url, "token", tag="profile") as name:
            rows = _run(_ours, (url, name, fencing), n, settle)
        label = "amqp-locks, fencing on" if fencing else "amqp-locks, fencing=False"
        results[label] = {what: _stage_p50(rows, a, b) for what, a, b in STAGES}

    async def raw(together: bool) -> list[dict[str, float]]:
        async with one_message_queue(url, 1, False, "profile") as (_, _, name):
            return await asyncio.to_thread(_run, _raw, (url, name, together), n, settle)

    for together, label in (
        (False, "raw aiormq, one thread per process: cancel-ok awaited, then reject (timed)"),
        (True, "raw aiormq, one thread per process: cancel (nowait) + reject in one write"),
    ):
        rows = asyncio.run(raw(together))
        results[label] = {STAGES[2][0]: _stage_p50(rows, "h_write", "w_token")}
    return results
