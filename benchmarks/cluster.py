"""The cluster scenarios (docs/cluster.md): cluster mode's cost, and node failure.

`python -m benchmarks.run cluster [--rabbitmq 4.3] [--quick] [--json PATH]` starts, one
after the other (2 cores), a private single node and a private 3-node cluster of one
RabbitMQ line (`amqp_locks_dev`), stops each afterwards, and measures on each:

- **library**, p50 (median over repetitions) of
  - an uncontended ``acquire`` (the lease is released, untimed, before the next sample) of
    a mutex, a persistent semaphore (4 slots) and a token semaphore (1 permit, quorum);
  - a **handoff**: a holder's ``release()`` to the waiter's ``acquire`` returning, two
    Brokers (own I/O threads) in this process, the waiter waiting ``SETTLE`` before it;
  in three setups: one node in single-node mode (the seeds' protocol), one node in cluster
  mode (``cluster=True``: the quorum-token protocol and the quorum guard, without
  replication), and the cluster in cluster mode (the Brokers prefer node 1, which leads the
  queues they declare);
- **raw aiormq floors** on the same node / cluster node 1: ``basic.consume`` -> delivery
  of a quorum-queue message returned by a reject just before (an uncontended acquire's
  broker part), and ``basic.reject`` -> delivery to another connection's consumer on a
  quorum queue (a handoff's), each with its ratio.

`python -m benchmarks.run cluster-failover [--trials N]` (``failover_table``; the
`amqplockscfail` cluster with `amqp_locks_dev.devcluster`, stopped afterwards unless it
was running): per trial and primitive, a holder connected to node 1 and a waiter connected
to node 2; node 1 (which also leads the lock's quorum queues) is killed with SIGKILL.
Measured from the kill: when the holder's lease is marked lost, and when the waiter's
acquire returns. Then the node is restarted (timed) and the fencing token of a grant
through the restarted node is checked against the others.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage

from amqp_locks import Broker, Lease, Mutex, PersistentSemaphore, SemaphoreAdmin, TokenSemaphore
from amqp_locks_dev import devbroker, devcluster

from .floors import _handoff_floor, _one_message_queue
from .stats import summarize_reps

#: The waiter's head start before each handoff (it must be waiting when the release goes).
SETTLE = 0.05
KINDS = ("mutex", "semaphore", "token")
NODE, CLUSTER = "amqplocksbn", "amqplocksbc"


def _lock(broker: Broker, kind: str, name: str) -> Any:
    if kind == "mutex":
        return Mutex(broker, name)
    if kind == "semaphore":
        return PersistentSemaphore(broker, name)
    return TokenSemaphore(broker, name)


def _set_up(broker: Broker, kind: str, name: str, slots: int) -> None:
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(slots)
    elif kind == "token":
        TokenSemaphore(broker, name, quorum=True).setup(1)


def acquire_reps(broker: Broker, kind: str, samples: int, reps: int) -> list[list[float]]:
    name = f"bc-{kind}-{uuid.uuid4().hex[:8]}"
    _set_up(broker, kind, name, 4)
    lock = _lock(broker, kind, name)
    out: list[list[float]] = []
    for rep in range(reps + 1):  # the first repetition warms up
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            lease = lock.acquire(timeout=30)
            times.append(time.perf_counter() - t0)
            assert lease is not None
            lease.release()
        if rep:
            out.append(times)
    return out


def _waiter(lock: Any, box: dict[str, Any], started: threading.Event) -> None:
    started.set()
    box["lease"] = lock.acquire(timeout=30)
    box["at"] = time.perf_counter()


def handoff_reps(
    pair: tuple[Broker, Broker], kind: str, samples: int, reps: int
) -> list[list[float]]:
    name = f"bh-{kind}-{uuid.uuid4().hex[:8]}"
    _set_up(pair[0], kind, name, 1)
    locks = [_lock(b, kind, name) for b in pair]
    lease = locks[0].acquire(timeout=30)
    assert lease is not None
    holder = 0
    out: list[list[float]] = []
    for rep in range(reps + 1):
        times = []
        for _ in range(samples):
            waiter = 1 - holder
            box: dict[str, Any] = {}
            started = threading.Event()
            t = threading.Thread(target=_waiter, args=(locks[waiter], box, started))
            t.start()
            started.wait()
            time.sleep(SETTLE)  # a benchmark's pacing, not a test's synchronisation
            t0 = time.perf_counter()
            lease.release()
            t.join()
            assert box["lease"] is not None
            times.append(box["at"] - t0)
            lease, holder = box["lease"], waiter
        if rep:
            out.append(times)
    lease.release()
    return out


async def _consume_floor(url: str, samples: int, reps: int) -> list[list[float]]:
    """Raw aiormq: ``basic.consume`` -> delivery of the one message of a quorum queue, then
    (untimed) cancel and ``basic.reject(requeue)``, as an uncontended token acquire and
    release do; the next consume may find the message still being returned."""
    conn = await aiormq.connect(url)
    try:
        setup, name = await _one_message_queue(conn, quorum=True)
        ch = await conn.channel()
        await ch.basic_qos(prefetch_count=1)
        out: list[list[float]] = []
        for rep in range(reps + 1):
            times = []
            for _ in range(samples):
                got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()

                async def on_message(msg: DeliveredMessage, got: Any = got) -> None:
                    if not got.done():
                        got.set_result(msg)

                t0 = time.perf_counter()
                ok = await ch.basic_consume(name, on_message, no_ack=False)
                msg = await got
                times.append(time.perf_counter() - t0)
                await ch.basic_cancel(str(ok.consumer_tag))
                assert msg.delivery_tag is not None
                await ch.basic_reject(msg.delivery_tag, requeue=True)
            if rep:
                out.append(times)
        await setup.queue_delete(name)
        return out
    finally:
        await conn.close()


def floors(url: str, samples: int, reps: int) -> dict[str, Any]:
    return {
        "consume_deliver_quorum": summarize_reps(asyncio.run(_consume_floor(url, samples, reps))),
        "reject_deliver_quorum": summarize_reps(
            asyncio.run(_handoff_floor(url, True, samples, reps))["reps"]
        ),
    }


def measure(urls: list[str], cluster: bool, samples: int, reps: int) -> dict[str, Any]:
    def broker() -> Broker:
        return Broker(urls if cluster else urls[0], cluster=cluster, heartbeat=10).connect()

    out: dict[str, Any] = {}
    b1, b2 = broker(), broker()
    try:
        for kind in KINDS:
            out[f"acquire_{kind}"] = summarize_reps(acquire_reps(b1, kind, samples, reps))
            out[f"handoff_{kind}"] = summarize_reps(
                handoff_reps((b1, b2), kind, max(10, samples // 4), reps)
            )
    finally:
        b1.close()
        b2.close()
    return out


def run(version: str, samples: int, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    results: dict[str, Any] = {"version": version, "samples": samples, "reps": reps}
    home = Path(os.environ.get("AMQP_LOCKS_HOME") or Path.home() / ".cache/amqp-locks")
    node_dir = home / "bench" / version / NODE
    log(f"single {version} node ...")
    info = devbroker.start(NODE, base_dir=node_dir, version=version)
    try:
        results["single"] = measure([info.url], False, samples, reps)
        results["single_cluster_mode"] = measure([info.url], True, samples, reps)
        results["single_floors"] = floors(info.url, samples, reps)
    finally:
        devbroker.stop(NODE, base_dir=node_dir, version=version)
    log(f"3-node {version} cluster ...")
    cdir = home / "bench" / version / CLUSTER
    cinfo = devcluster.start(CLUSTER, 3, cdir, version=version)
    try:
        results["cluster"] = measure(cinfo.urls, True, samples, reps)
        results["cluster_floors"] = floors(cinfo.urls[0], samples, reps)
    finally:
        devcluster.stop(CLUSTER, cdir, version=version)
    return results


def table(results: dict[str, Any]) -> str:
    """The markdown table docs/cluster.md quotes: p50 ms and ratio to the setup's floor."""
    rows = [
        "| p50 ms (ratio to the quorum floor) | one node, seed protocol | one node, cluster mode"
        " | 3-node cluster, cluster mode |",
        "|---|---|---|---|",
    ]

    def cell(setup: str, key: str, floor: str) -> str:
        p50 = results[setup][key]["p50_ms"]
        if setup == "single":  # other broker operations: docs/benchmarks.md has its floors
            return f"{p50:.2f}"
        base = results["cluster_floors" if setup == "cluster" else "single_floors"]
        return f"{p50:.2f} ({p50 / base[floor]['p50_ms']:.1f}x)"

    setups = ("single", "single_cluster_mode", "cluster")
    ops = (("acquire", "consume_deliver_quorum"), ("handoff", "reject_deliver_quorum"))
    for kind in KINDS:
        for op, floor in ops:
            cells = " | ".join(cell(s, f"{op}_{kind}", floor) for s in setups)
            rows.append(f"| {kind} {op} | {cells} |")
    for floor, what in (
        ("consume_deliver_quorum", "raw consume -> delivery, quorum queue"),
        ("reject_deliver_quorum", "raw reject -> delivery, quorum queue"),
    ):
        single = results["single_floors"][floor]["p50_ms"]
        cluster = results["cluster_floors"][floor]["p50_ms"]
        rows.append(f"| floor: {what} | | {single:.2f} | {cluster:.2f} |")
    return "\n".join(rows)


# -------------------------------------------------------------------- node failure

FAILOVER_CLUSTER = "amqplockscfail"


def _trial(info: devcluster.ClusterInfo, kind: str) -> tuple[float, float, float, bool]:
    def broker(first: int) -> Broker:
        return Broker(info.urls[first - 1 :] + info.urls[: first - 1], heartbeat=5).connect()

    name = f"b{uuid.uuid4().hex[:10]}"
    b1, b2, b3 = broker(1), broker(2), broker(1)
    try:
        if kind == "semaphore":
            SemaphoreAdmin(b1, name, quorum=True).create(1)
        elif kind == "token":
            TokenSemaphore(b1, name, quorum=True).setup(1)

        def acquire(b: Broker) -> Lease:
            lease = _lock(b, kind, name).acquire(timeout=30)
            assert lease is not None
            return lease

        held = acquire(b1)
        box: list[Lease] = []
        waiter = threading.Thread(target=lambda: box.append(acquire(b2)))
        waiter.start()
        time.sleep(1.0)  # let the waiter subscribe (a benchmark, not a test)
        killed = time.monotonic()
        devcluster.kill_node(FAILOVER_CLUSTER, 1)
        held.lost.wait(30)
        lost = time.monotonic() - killed
        waiter.join(60)
        regrant = time.monotonic() - killed
        new = box[0]
        new.release()
        t = time.monotonic()
        devcluster.start_node(FAILOVER_CLUSTER, 1)
        restart = time.monotonic() - t
        b3.close()
        b3 = broker(1)
        last = acquire(b3)
        monotonic = held.fencing_token < new.fencing_token < last.fencing_token
        last.release()
        return lost, regrant, restart, monotonic
    finally:
        for b in (b1, b2, b3):
            b.close()


def failover_table(trials: int) -> str:
    """The markdown table docs/cluster.md quotes, ``trials`` trials per primitive."""
    was_running = any(devcluster.status(FAILOVER_CLUSTER).values())
    info = devcluster.start(FAILOVER_CLUSTER, 3)
    lines = [
        "| primitive | holder told (ms, median [min-max]) | waiter on a surviving node "
        "granted (ms) | node restart (s) | tokens monotonic |",
        "|---|---|---|---|---|",
    ]

    def fmt(xs: list[float], digits: int = 0) -> str:
        return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"

    try:
        for kind in KINDS:
            rows = [_trial(info, kind) for _ in range(trials)]
            lost, regrant = [r[0] * 1000 for r in rows], [r[1] * 1000 for r in rows]
            ok = "yes" if all(r[3] for r in rows) else "NO"
            lines.append(
                f"| {kind} | {fmt(lost)} | {fmt(regrant)} | {fmt([r[2] for r in rows], 1)} | "
                f"{ok} ({len(rows)} trials) |"
            )
    finally:
        if not was_running:
            devcluster.stop(FAILOVER_CLUSTER)
    return "\n".join(lines)
