"""The AMQP steps an acquire is made of, timed one by one, to explain where its time goes.

An uncontended semaphore acquire is: one window of 16 probes (`A[1..8]`, `B[1..8]`), the
exclusive declare of `B[k]` overlapped with opening the lease's watch channel, two consumes
overlapped with taking a fencing token from the quorum fence queue. A release deletes `B[k]`.
These use the library's internal session API (the same calls the client makes).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from amqp_locks import Broker, SemaphoreAdmin
from amqp_locks.fencing import take_token
from amqp_locks.names import holder_queue, slot_queue
from amqp_locks.semaphore.client import HOLDER_ARGS

from .latency import unique_name
from .stats import summarize_reps

Step = Callable[[], Awaitable[None]]


def primitives(url: str, samples: int, reps: int, rtt_ms: float) -> dict[str, Any]:
    """p50/p99 of each step; ``declare``/``delete`` alternate on one exclusive queue."""
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
