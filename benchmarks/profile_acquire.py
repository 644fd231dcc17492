"""Where an uncontended token acquire's time goes: the same grant taken four ways.

    python -m benchmarks.profile_acquire [--url URL] [-n SAMPLES]

1. ``Broker.round_trip()``: the caller -> I/O thread hop and one broker round trip.
2. ``TokenSemaphore.acquire()`` from the caller's thread (what users see).
3. The acquire coroutine timed *inside* the I/O loop (no thread hop).
4. Raw aiormq on the same pooled channel, inside the loop: ``basic.consume`` until the
   token arrives (what the acquire does on the wire), and ``basic.get``.
5. The floor of the benchmark report (`benchmarks.floors`): ``basic.get`` on a connection
   of its own, in an event loop of its own, no library code.

Each sample waits 3 ms after the release, so the previous release's commit has put the
token back (`release()` does not wait for it). Without ``--url`` it starts the private
benchmark node (`amqp_locks_dev.devbroker`, like `benchmarks.run`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiormq.abc import DeliveredMessage

from amqp_locks import Broker, TokenSemaphore
from amqp_locks.names import token_queue
from amqp_locks.tokens import acquire_permit

from .floors import raw_floors

GAP = 0.003


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def _loop(core: Any, coro: Callable[[], Awaitable[float]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(core.run(coro()))
        time.sleep(GAP)
    return out


def profile(url: str, n: int) -> dict[str, float]:
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

            floor = raw_floors(url, n, 1)["get_classic"]["reps"][0]
            return {
                "floor: raw aiormq basic.get, own connection and loop": _p50(floor),
                "round_trip (thread hop + RTT)": _p50(hop),
                "acquire, caller's thread": _p50(outside),
                "acquire, inside the I/O loop": _p50(_loop(core, inside, n)),
                "raw basic.consume -> token, inside the loop": _p50(
                    _loop(core, lambda: raw(False), n)
                ),
                "raw basic.get, inside the loop (floor)": _p50(_loop(core, lambda: raw(True), n)),
            }
        finally:
            sem.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url")
    ap.add_argument("-n", type=int, default=1000)
    args = ap.parse_args()
    url = args.url
    if url is None:
        from amqp_locks_dev import devbroker

        url = devbroker.start(name="amqplocksbench").url
    for what, ms in profile(url, args.n).items():
        print(f"{ms:7.3f} ms p50  {what}")


if __name__ == "__main__":
    main()
