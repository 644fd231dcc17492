"""First use of a cluster-mode mutex on a fresh name (tokens/fresh.py) against a warm acquire
and a raw quorum-queue declaration, p50s over one connected Broker per target.

    python -m benchmarks.first_use [--samples N] TARGET...

A TARGET is ``label=url[,url...]`` (several URLs: a cluster, cluster mode in any case).
Each sample of "first use" takes a never-used name (its queue is made by the acquire, and
today its fence queue too); "fence existing" the same with the name's fence made before;
"warm" takes one name again and again (release waited for); "declare" is one
``queue.declare`` of a fresh quorum queue with the lock queues' arguments (deleted after,
untimed); "setup+acquire" is the earlier release's first use, ``TokenAdmin.setup(1)`` under
the administration mutex then an acquire, for comparison. The read-write lock's rows are
its write and read halves on a fresh name (a writer makes both queues, each by one
test-and-set write; a reader the readers queue) and on one name again and again.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

from amqp_locks import Broker, Mutex, ReadWriteLock, TokenSemaphore
from amqp_locks.fencing import ensure_fence
from amqp_locks.names import quorum_mutex_name
from amqp_locks.tokens.arguments import token_arguments


def timed(lock: Any) -> float:
    """How long one acquire of `lock` took (s); the release is waited for, untimed."""
    t0 = time.perf_counter()
    lease = lock.acquire(timeout=30)
    dt = time.perf_counter() - t0
    assert lease is not None
    lease.release(wait=True)
    return dt


def measure(urls: list[str], samples: int) -> dict[str, float]:
    with Broker(urls, cluster=True, heartbeat=10.0) as broker:
        broker.connect()
        core = broker.core

        def first_use() -> float:
            return timed(Mutex(broker, f"bf-{uuid.uuid4().hex[:12]}"))

        def first_use_fenced() -> float:
            """A fresh name whose fence exists already (a name used before, or fences
            shared by all names): the test-and-set write is the only declaration."""
            name = f"bg-{uuid.uuid4().hex[:12]}"

            async def fence() -> None:
                await ensure_fence(await core.session(), quorum_mutex_name(name))

            core.run(fence())
            return timed(Mutex(broker, name))

        warm_mutex = Mutex(broker, f"bw-{uuid.uuid4().hex[:12]}")

        def warm() -> float:
            return timed(warm_mutex)

        def declare() -> float:
            queue = f"bd-{uuid.uuid4().hex[:12]}"

            async def go() -> float:
                session = await core.session()
                args = token_arguments(session, True)
                t0 = time.perf_counter()
                await session.call(
                    queue, lambda ch: ch.queue_declare(queue, durable=True, arguments=args)
                )
                dt = time.perf_counter() - t0
                await session.delete(queue)
                return dt

            return float(core.run(go()))

        def setup_acquire() -> float:
            name = f"bs-{uuid.uuid4().hex[:12]}"
            sem = TokenSemaphore(broker, name, quorum=True)
            t0 = time.perf_counter()
            sem.setup(1)
            lease = sem.acquire(timeout=30)
            dt = time.perf_counter() - t0
            assert lease is not None
            lease.release(wait=True)
            sem.destroy()
            return dt

        def rwlock(shared: bool, name: str | None = None) -> float:
            rw = ReadWriteLock(broker, name or f"br-{uuid.uuid4().hex[:12]}")
            return timed(rw.read_lock if shared else rw.write_lock)

        warm_rw = f"bv-{uuid.uuid4().hex[:12]}"
        kinds = {
            "rwlock write first use": lambda: rwlock(False),
            "rwlock write warm": lambda: rwlock(False, warm_rw),
            "rwlock read first use": lambda: rwlock(True),
            "rwlock read warm": lambda: rwlock(True, warm_rw),
            "first use": first_use,
            "first use, fence exists": first_use_fenced,
            "warm": warm,
            "declare": declare,
            "setup+acquire": setup_acquire,
        }
        for fn in kinds.values():  # warm-up
            fn()
        # Interleaved, so that every kind sees the same broker load.
        got: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(samples):
            for kind, fn in kinds.items():
                got[kind].append(fn())
        return {k: statistics.median(v) * 1000 for k, v in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("targets", nargs="+", help="label=url[,url...]")
    args = parser.parse_args()
    for target in args.targets:
        label, _, urls = target.partition("=")
        r = measure(urls.split(","), args.samples)
        budget = 2 * (r["warm"] + r["declare"])
        print(
            f"{label}: first use p50 {r['first use']:.1f} ms (fence existing: "
            f"{r['first use, fence exists']:.1f} ms), warm p50 {r['warm']:.1f} ms, "
            f"raw quorum declare p50 {r['declare']:.1f} ms "
            f"(budget 2 x (warm + declare) = {budget:.1f} ms); "
            f"earlier release's setup+acquire p50 {r['setup+acquire']:.1f} ms"
        )
        print(
            f"{label}: read-write lock, write first use p50 {r['rwlock write first use']:.1f}"
            f" ms, warm {r['rwlock write warm']:.1f} ms (budget 2 x (warm + 2 declares) = "
            f"{2 * (r['rwlock write warm'] + 2 * r['declare']):.1f} ms); read first use "
            f"{r['rwlock read first use']:.1f} ms, warm {r['rwlock read warm']:.1f} ms "
            f"(budget 2 x (warm + declare) = {2 * (r['rwlock read warm'] + r['declare']):.1f} ms)"
        )


if __name__ == "__main__":
    main()
