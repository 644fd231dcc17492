"""The cluster scenarios of docs/cluster.md, each on private nodes of one RabbitMQ line.

``cluster``: p50s of a mutex, a persistent semaphore (4 slots) and a token semaphore (1
permit, quorum), uncontended acquire and handoff (two Brokers in this process, the waiter
waiting ``SETTLE`` first), on one node in single-node mode, the same node in cluster mode
and a 3-node cluster (node 1 leads the queues), beside raw aiormq quorum floors of the
same setup. ``cluster-failover``: node 1 of ``amqplockscfail`` killed under a holder (a
waiter on node 2): holder told, waiter granted, node restarted, fencing tokens checked.
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

from aiormq.abc import DeliveredMessage

from amqp_locks import Broker, Lease, Mutex, PersistentSemaphore, SemaphoreAdmin, TokenSemaphore
from amqp_locks_dev import devbroker, devcluster

from .floors import _connections, _one_message_queue, _reps, handoff_floor
from .stats import Budget, summarize_reps, timed

SETTLE = 0.05  # the waiter's head start before each handoff (it must be waiting)
KINDS = ("mutex", "semaphore", "token")
NODE, CLUSTER, FAILOVER_CLUSTER = "amqplocksbn", "amqplocksbc", "amqplockscfail"
LOCKS = {"mutex": Mutex, "semaphore": PersistentSemaphore, "token": TokenSemaphore}


def _set_up(broker: Broker, kind: str, slots: int, quorum: bool = False) -> str:
    name = f"b{kind[0]}-{uuid.uuid4().hex[:10]}"
    if kind == "semaphore":
        SemaphoreAdmin(broker, name, quorum=quorum or None).create(slots)
    elif kind == "token":  # one permit: the figures are one holder's
        TokenSemaphore(broker, name, quorum=True).setup(1)
    return name


def _acquire(lock: Any) -> Lease:
    lease = lock.acquire(timeout=30)
    assert lease is not None
    return lease


def acquire_reps(broker: Broker, kind: str, samples: int, reps: int) -> list[list[float]]:
    lock = LOCKS[kind](broker, _set_up(broker, kind, 4))

    def sample() -> float:
        t0 = time.perf_counter()
        lease = _acquire(lock)
        dt = time.perf_counter() - t0
        lease.release()
        return dt

    return timed(sample, Budget(reps, samples, warmup=samples))  # a first repetition warms up


def handoff_reps(
    pair: tuple[Broker, Broker], kind: str, samples: int, reps: int
) -> list[list[float]]:
    name = _set_up(pair[0], kind, 1)
    locks = [LOCKS[kind](b, name) for b in pair]
    held = [_acquire(locks[0]), 0]  # the lease and its holder

    def sample() -> float:
        box: list[Any] = []
        waiter = threading.Thread(
            target=lambda: box.append((_acquire(locks[1 - held[1]]), time.perf_counter()))
        )
        waiter.start()
        time.sleep(SETTLE)  # a benchmark's pacing, not a test's synchronisation
        t0 = time.perf_counter()
        held[0].release()
        waiter.join()
        held[:] = [box[0][0], 1 - held[1]]
        return box[0][1] - t0

    try:
        return timed(sample, Budget(reps, samples, warmup=samples))
    finally:
        held[0].release()


async def _consume_floor(url: str, samples: int, reps: int) -> list[list[float]]:
    """Raw aiormq: ``basic.consume`` -> delivery of the one message of a quorum queue, then
    (untimed) cancel and ``basic.reject(requeue)``, as an uncontended token acquire and
    release do; the next consume may find the message still being returned."""
    async with _connections(url, 1, "consume") as (conn,):
        setup, name = await _one_message_queue(conn, quorum=True)
        ch = await conn.channel()
        await ch.basic_qos(prefetch_count=1)

        async def sample() -> float:
            got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()

            async def on_message(msg: DeliveredMessage) -> None:
                if not got.done():
                    got.set_result(msg)

            t0 = time.perf_counter()
            ok = await ch.basic_consume(name, on_message, no_ack=False)
            msg = await got
            dt = time.perf_counter() - t0
            await ch.basic_cancel(str(ok.consumer_tag))
            await ch.basic_reject(msg.delivery_tag or 0, requeue=True)
            return dt

        try:
            return await _reps(sample, samples, reps, samples)
        finally:
            await setup.queue_delete(name)


def floors(url: str, samples: int, reps: int) -> dict[str, Any]:
    return {
        "consume_deliver_quorum": summarize_reps(asyncio.run(_consume_floor(url, samples, reps))),
        "reject_deliver_quorum": summarize_reps(
            asyncio.run(handoff_floor(url, True, samples, reps))
        ),
    }


def measure(urls: list[str], cluster: bool, samples: int, reps: int) -> dict[str, Any]:
    pair = [
        Broker(urls if cluster else urls[0], cluster=cluster, heartbeat=10).connect()
        for _ in range(2)
    ]
    try:
        out = {
            f"acquire_{k}": summarize_reps(acquire_reps(pair[0], k, samples, reps)) for k in KINDS
        }
        for kind in KINDS:
            out[f"handoff_{kind}"] = summarize_reps(
                handoff_reps((pair[0], pair[1]), kind, max(10, samples // 4), reps)
            )
        return out
    finally:
        for b in pair:
            b.close()


def run(version: str, samples: int, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    results: dict[str, Any] = {"version": version, "samples": samples, "reps": reps}
    home = (
        Path(os.environ.get("AMQP_LOCKS_HOME") or Path.home() / ".cache/amqp-locks")
        / "bench"
        / version
    )
    log(f"single {version} node ...")
    info = devbroker.start(NODE, base_dir=home / NODE, version=version)
    try:
        results["single"] = measure([info.url], False, samples, reps)
        results["single_cluster_mode"] = measure([info.url], True, samples, reps)
        results["single_floors"] = floors(info.url, samples, reps)
    finally:
        devbroker.stop(NODE, base_dir=home / NODE, version=version)
    log(f"3-node {version} cluster ...")
    cinfo = devcluster.start(CLUSTER, 3, home / CLUSTER, version=version)
    try:
        results["cluster"] = measure(cinfo.urls, True, samples, reps)
        results["cluster_floors"] = floors(cinfo.urls[0], samples, reps)
    finally:
        devcluster.stop(CLUSTER, home / CLUSTER, version=version)
    return results


def table(results: dict[str, Any]) -> str:
    """The markdown table docs/cluster.md quotes: p50 ms and ratio to the setup's floor."""
    rows = [
        "| p50 ms (ratio to the quorum floor) | one node, seed protocol | one node, cluster mode"
        " | 3-node cluster, cluster mode |",
        "|---|---|---|---|",
    ]
    floors = {"single_cluster_mode": results["single_floors"], "cluster": results["cluster_floors"]}
    ops = {"acquire": "consume_deliver_quorum", "handoff": "reject_deliver_quorum"}
    for kind in KINDS:
        for op, floor in ops.items():
            cells = [f"{results['single'][f'{op}_{kind}']['p50_ms']:.2f}"]  # other floors apply
            for setup, base in floors.items():
                p50 = results[setup][f"{op}_{kind}"]["p50_ms"]
                cells.append(f"{p50:.2f} ({p50 / base[floor]['p50_ms']:.1f}x)")
            rows.append(f"| {kind} {op} | {' | '.join(cells)} |")
    for floor, what in zip(ops.values(), ("consume", "reject"), strict=True):
        single, cluster = (f"{base[floor]['p50_ms']:.2f}" for base in floors.values())
        rows.append(f"| floor: raw {what} -> delivery, quorum queue | | {single} | {cluster} |")
    return "\n".join(rows)


def _trial(info: devcluster.ClusterInfo, kind: str) -> tuple[float, float, float, bool]:
    def broker(first: int) -> Broker:
        return Broker(info.urls[first - 1 :] + info.urls[: first - 1], heartbeat=5).connect()

    b1, b2, b3 = broker(1), broker(2), broker(1)
    try:
        name = _set_up(b1, kind, 1, quorum=True)
        held = _acquire(LOCKS[kind](b1, name))
        box: list[Lease] = []
        waiter = threading.Thread(target=lambda: box.append(_acquire(LOCKS[kind](b2, name))))
        waiter.start()
        time.sleep(1.0)  # let the waiter subscribe (a benchmark, not a test)
        killed = time.monotonic()
        devcluster.kill_node(FAILOVER_CLUSTER, 1)
        held.lost.wait(30)
        lost = time.monotonic() - killed
        waiter.join(60)
        regrant = time.monotonic() - killed
        box[0].release()
        t = time.monotonic()
        devcluster.start_node(FAILOVER_CLUSTER, 1)
        restart = time.monotonic() - t
        b3.close()
        b3 = broker(1)
        last = _acquire(LOCKS[kind](b3, name))
        last.release()
        return (
            lost,
            regrant,
            restart,
            held.fencing_token < box[0].fencing_token < last.fencing_token,
        )
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
            restart = fmt([r[2] for r in rows], 1)
            lines.append(
                f"| {kind} | {fmt(lost)} | {fmt(regrant)} | {restart} | {ok} ({len(rows)} trials) |"
            )
    finally:
        if not was_running:
            devcluster.stop(FAILOVER_CLUSTER)
    return "\n".join(lines)
