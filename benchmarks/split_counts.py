"""What a passive declare of a held lock's token queue answers across a split (tokens/heal.py
judges queues by these counts), measured on a private 3-node mesh:

    python -m benchmarks.split_counts [--version 4.3] [--seconds 30]

Starts a mesh of `version` nodes (amqp_locks_dev.mesh: root, network namespaces; the
development tooling starts private nodes, the library never does), holds a mutex through
node 1 (its token queue led by node 2), splits {1} | {2, 3}, and samples with raw aiormq
every 0.25 s through node 2 (the queue's majority side) and node 1 (cut off from it),
printing each change of (ready, consumers) with its time since the split. Two facts:

(a) through node 1, a count its node could not get from the queue's leader: RabbitMQ
    answers 0 ready, 0 consumers (``rabbit_quorum_queue:stat``; heal.FAILED_STAT);
(b) through node 2, whether the cut-off holder's consumer is still counted, and when its
    token is ready again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator

import aiormq

from amqp_locks import Broker, Mutex
from amqp_locks.names import quorum_mutex_name, token_queue
from amqp_locks_dev import mesh


async def _counts(url: str, queue: str) -> tuple[int, int] | str:
    """(ready, consumers) of `queue` through `url`, or why there was no answer; on a
    connection of its own, since the cut-off node closes what it had (3.10, 4.0)."""
    try:
        conn = await asyncio.wait_for(aiormq.connect(url), 5)
    except Exception as exc:  # reported as the sample
        return f"no connection: {type(exc).__name__}"
    try:
        ch = await conn.channel()
        ok = await asyncio.wait_for(ch.queue_declare(queue, passive=True), 5)
        return ok.message_count or 0, ok.consumer_count or 0
    except Exception as exc:  # reported as the sample
        return f"no answer: {type(exc).__name__}"
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), 2)


def _sample(urls: dict[str, str], queue: str, seconds: float, t0: float) -> Iterator[str]:
    last: dict[str, object] = {}
    while time.monotonic() - t0 < seconds:
        for side, url in urls.items():
            got = asyncio.run(_counts(url, queue))
            if got != last.get(side):
                last[side] = got
                yield f"{time.monotonic() - t0:6.2f} s  {side}: (ready, consumers) = {got}"
        time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.split_counts")
    parser.add_argument("--version", default="4.3")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    name = "split-counts"
    queue = token_queue(quorum_mutex_name(name))
    with mesh.mesh_cluster(version=args.version, size=3, net_ticktime=10) as mc:
        admin = Broker([mc.node_url(2)], cluster=True, heartbeat=5)
        holder = Broker([mc.node_url(1)], cluster=True, heartbeat=5)
        try:
            Mutex(admin, name).acquire(timeout=30).release()  # type: ignore[union-attr]
            Mutex(holder, name).acquire(timeout=30)
            urls = {"node 2 (majority)": mc.node_url(2), "node 1 (cut off)": mc.node_url(1)}
            print(f"RabbitMQ {mc.version}, queue {queue!r}, mutex held through node 1")
            for line in _sample(urls, queue, 0.1, time.monotonic()):
                print("before the split", line.split("s  ", 1)[1], flush=True)
            mc.split([1], [2, 3])
            for line in _sample(urls, queue, args.seconds, time.monotonic()):
                print(line, flush=True)
        finally:
            mc.heal()
            holder.close()
            admin.close()


if __name__ == "__main__":
    main()
