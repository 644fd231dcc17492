"""The ``cluster`` scenario of docs/cluster.md on private nodes of one RabbitMQ line: p50s
of a mutex, a persistent semaphore (4 slots) and a token semaphore (1 permit, quorum),
uncontended acquire and handoff (two Brokers in this process, the waiter waiting
``SETTLE`` first), on one node in single-node mode, the same node in cluster mode and a
3-node cluster (node 1 leads the queues), beside raw aiormq quorum floors of the same setup.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amqp_locks import Broker, Lease, Mutex, PersistentSemaphore, SemaphoreAdmin, TokenSemaphore
from amqp_locks_dev import devbroker, devcluster

from .floors import handoff_floor, take_floor
from .stats import Budget, summarize_reps, timed

SETTLE = 0.05  # the waiter's head start before each handoff (it must be waiting)
KINDS = ("mutex", "semaphore", "token")
NODE, CLUSTER = "amqplocksbn", "amqplocksbc"
LOCKS = {"mutex": Mutex, "semaphore": PersistentSemaphore, "token": TokenSemaphore}


def _set_up(broker: Broker, kind: str, slots: int) -> str:
    name = f"b{kind[0]}-{uuid.uuid4().hex[:10]}"
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(slots)
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


def handoff_reps(pair: list[Broker], kind: str, samples: int, reps: int) -> list[list[float]]:
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


def floors(url: str, samples: int, reps: int) -> dict[str, Any]:
    consume = take_floor(url, True, samples, reps, get=False)
    get = take_floor(url, True, samples, reps)
    reject = handoff_floor(url, True, samples, reps)
    return {
        "consume_deliver_quorum": summarize_reps(asyncio.run(consume)),
        "get_quorum": summarize_reps(asyncio.run(get)),
        "reject_deliver_quorum": summarize_reps(asyncio.run(reject)),
    }


#: Issue 37's targets on a 3-node cluster: (our figure, its floor, at most this ratio).
CLUSTER_TARGETS = (
    ("acquire_mutex", "get_quorum", 1.5),
    ("handoff_mutex", "reject_deliver_quorum", 2.0),
)


def _p50_with_reps(s: dict[str, Any]) -> str:
    """A p50 and, in brackets, the lowest and highest of its repetitions' p50s."""
    reps = s.get("p50_reps_ms") or [s["p50_ms"]]
    return f"{s['p50_ms']:.2f} ({min(reps):.2f}-{max(reps):.2f})"


def target_table(results: dict[str, Any]) -> str:
    """Issue 37's cluster targets: p50 (range over the repetitions) against the floor's."""
    rows = [
        "| 3-node cluster (p50 ms, reps low-high) | ours | floor | floor ms | ours / floor"
        " | target | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    for ours_key, floor_key, target in CLUSTER_TARGETS:
        if floor_key not in results["cluster_floors"]:
            continue  # a results file from before the floor was measured
        ours, floor = results["cluster"][ours_key], results["cluster_floors"][floor_key]
        ratio = ours["p50_ms"] / floor["p50_ms"]
        met = "met" if ratio <= target else "**not met**"
        rows.append(
            f"| {ours_key.replace('_', ' ')} | {_p50_with_reps(ours)} | {floor_key}"
            f" | {_p50_with_reps(floor)} | {ratio:.1f}x | <= {target:g}x | {met} |"
        )
    return "\n".join(rows)


def measure(urls: list[str], cluster: bool, samples: int, reps: int) -> dict[str, Any]:
    url: str | list[str] = urls if cluster else urls[0]
    pair = [Broker(url, cluster=cluster, heartbeat=10).connect() for _ in range(2)]
    try:
        out = {f"acquire_{k}": acquire_reps(pair[0], k, samples, reps) for k in KINDS}
        for kind in KINDS:
            out[f"handoff_{kind}"] = handoff_reps(pair, kind, max(10, samples // 4), reps)
        return {key: summarize_reps(xs) for key, xs in out.items()}
    finally:
        for b in pair:
            b.close()


def run(version: str, samples: int, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    results: dict[str, Any] = {"version": version, "samples": samples, "reps": reps}
    home = Path(os.environ.get("AMQP_LOCKS_HOME") or Path.home() / ".cache/amqp-locks")
    home = home / "bench" / version
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
