"""Node failure in a private 3-node cluster: how fast each primitive recovers.

`python -m benchmarks.cluster_failover [--trials N]` (starts the `amqplockscfail` cluster
with `amqp_locks_dev.devcluster`, stops it afterwards). Per trial and primitive: a holder
connected to node 1 and a waiter connected to node 2; node 1 (which also leads the lock's
quorum queues) is killed with SIGKILL. Measured from the kill: when the holder's lease is
marked lost, and when the waiter's acquire returns. Then the node is restarted (timed) and
the fencing token of a grant through the restarted node is checked against the others.
Standalone (not part of `benchmarks.run`): it needs a cluster, not the single dev node.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable

from amqp_locks import (
    Broker,
    Lease,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
    TokenSemaphore,
)
from amqp_locks_dev import devcluster

CLUSTER = "amqplockscfail"


def _broker(info: devcluster.ClusterInfo, first: int) -> Broker:
    urls = info.urls[first - 1 :] + info.urls[: first - 1]
    return Broker(urls, heartbeat=5).connect()


def _trial(
    info: devcluster.ClusterInfo, kind: str
) -> tuple[float, float, float, bool]:
    name = f"b{uuid.uuid4().hex[:10]}"
    b1, b2, b3 = _broker(info, 1), _broker(info, 2), _broker(info, 1)
    try:
        acquire: Callable[[Broker], Lease | None]
        if kind == "mutex":
            acquire = lambda b: Mutex(b, name).acquire(timeout=30)  # noqa: E731
        elif kind == "semaphore":
            SemaphoreAdmin(b1, name, quorum=True).create(1)
            acquire = lambda b: PersistentSemaphore(b, name).acquire(timeout=30)  # noqa: E731
        else:
            TokenSemaphore(b1, name, quorum=True).setup(1)
            acquire = lambda b: TokenSemaphore(b, name).acquire(timeout=30)  # noqa: E731
        held = acquire(b1)
        assert held is not None
        box: list[Lease | None] = []
        waiter = threading.Thread(target=lambda: box.append(acquire(b2)))
        waiter.start()
        time.sleep(1.0)  # let the waiter subscribe (a benchmark, not a test)
        killed = time.monotonic()
        devcluster.kill_node(CLUSTER, 1)
        held.lost.wait(30)
        lost = time.monotonic() - killed
        waiter.join(60)
        regrant = time.monotonic() - killed
        new = box[0]
        assert new is not None
        new.release()
        t = time.monotonic()
        devcluster.start_node(CLUSTER, 1)
        restart = time.monotonic() - t
        b3.close()
        b3 = _broker(info, 1)
        last = acquire(b3)
        assert last is not None
        monotonic = held.fencing_token < new.fencing_token < last.fencing_token
        last.release()
        return lost, regrant, restart, monotonic
    finally:
        for b in (b1, b2, b3):
            b.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    was_running = any(devcluster.status(CLUSTER).values())
    info = devcluster.start(CLUSTER, 3)
    try:
        print("| primitive | holder told (ms, median [min-max]) | waiter on a surviving node "
              "granted (ms) | node restart (s) | tokens monotonic |")
        print("|---|---|---|---|---|")
        for kind in ("mutex", "semaphore", "token"):
            rows = [_trial(info, kind) for _ in range(args.trials)]
            lost = [r[0] * 1000 for r in rows]
            regrant = [r[1] * 1000 for r in rows]
            restart = [r[2] for r in rows]

            def fmt(xs: list[float], digits: int = 0) -> str:
                return (f"{statistics.median(xs):.{digits}f} "
                        f"[{min(xs):.{digits}f}-{max(xs):.{digits}f}]")

            ok = all(r[3] for r in rows)
            print(f"| {kind} | {fmt(lost)} | {fmt(regrant)} | {fmt(restart, 1)} | "
                  f"{'yes' if ok else 'NO'} ({len(rows)} trials) |", flush=True)
    finally:
        if not was_running:
            devcluster.stop(CLUSTER)


if __name__ == "__main__":
    main()
