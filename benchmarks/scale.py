"""Many distinct live locks: acquire latency and broker memory against the number held.

Holder processes (one connection each, at most ``PER_CONNECTION`` leases: every lease
has a watch channel and a connection allows 2047) hold mutexes without fencing tokens,
acquired concurrently through the asyncio facade. At each size the client times
uncontended acquire + release of a fresh mutex (with its fencing token, as users get it),
and the broker reports its memory (``rabbitmqctl status``: total and by category;
``rabbitmqctl list_queues memory``: per queue), Erlang processes and file descriptors.

Separately, on top of the largest size: the memory of extra idle connections, and of
mutex fence queues (quorum queues: one Raft member each), so docs/scaling.md can add them
up for other shapes of load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from amqp_locks import Broker, Mutex
from amqp_locks.names import fence_queue, sentinel_queue, wakeup_queue
from amqp_locks_dev import devbroker

from .handoff import context
from .latency import Budget, _delete_queues, unique_name
from .stats import process_cpu, summarize_reps

Log = Callable[[str], None]
PER_CONNECTION = 1000
BATCH = 50  # acquires in flight per connection while placing holders


def _holder_main(url: str, conn: Connection) -> None:
    """Hold mutexes on one connection: ("hold", names) -> ("held", n, seconds); "exit"."""
    # Exiting drops the connection: every lease then logs that it was lost. Expected here.
    for noisy in ("aiormq", "amqp_locks", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    from amqp_locks import aio

    async def serve() -> None:
        broker = aio.Broker(url, connection_name="amqp-locks bench scale holder")
        leases: list[Any] = []
        loop = asyncio.get_running_loop()
        try:
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd[0] != "hold":
                    break
                t0 = time.monotonic()
                names = cmd[1]
                for i in range(0, len(names), BATCH):
                    got = await asyncio.gather(
                        *(
                            aio.Mutex(broker, n, fencing=False).acquire(timeout=60)
                            for n in names[i : i + BATCH]
                        )
                    )
                    if any(lease is None for lease in got):
                        raise RuntimeError("a scale mutex was not granted within 60 s")
                    leases.extend(got)
                conn.send(("held", len(leases), time.monotonic() - t0))
        except Exception as exc:
            conn.send(("error", repr(exc)[:300]))
        finally:
            await broker.close()

    asyncio.run(serve())


class _Holders:
    """Holder processes; ``grow(total)`` brings the locks held to ``total``."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self.ctx = context()
        self.procs: list[tuple[Any, Connection, int]] = []  # process, pipe, locks held
        self.names: list[str] = []

    def grow(self, total: int) -> float:
        t0 = time.monotonic()
        orders: list[tuple[int, list[str]]] = []
        while len(self.names) < total:
            if not self.procs or self.procs[-1][2] >= PER_CONNECTION:
                parent, child = self.ctx.Pipe()
                p = self.ctx.Process(target=_holder_main, args=(self.url, child), daemon=True)
                p.start()
                self.procs.append((p, parent, 0))
            idx = len(self.procs) - 1
            p, pipe, held = self.procs[idx]
            take = min(PER_CONNECTION - held, total - len(self.names))
            names = [f"{self.prefix}-{len(self.names) + i}" for i in range(take)]
            self.names += names
            self.procs[idx] = (p, pipe, held + take)
            orders.append((idx, names))
        for idx, names in orders:  # connections place their share concurrently
            self.procs[idx][1].send(("hold", names))
        for idx, _ in orders:
            pipe = self.procs[idx][1]
            if not pipe.poll(600):
                raise RuntimeError("scale holder did not answer within 600 s")
            msg = pipe.recv()
            if msg[0] != "held":
                raise RuntimeError(f"scale holder failed: {msg[1]}")
        return time.monotonic() - t0

    def close(self) -> None:
        for _, pipe, _ in self.procs:
            with contextlib.suppress(OSError):
                pipe.send(("exit",))
        for p, _, _ in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def _broker_state(node: devbroker.NodeInfo | None, beam: int | None) -> dict[str, Any]:
    """Memory by category, Erlang processes and descriptors, and every queue's memory."""
    if node is None:
        return {}
    st = json.loads(devbroker.rabbitmqctl(node, "status", "--formatter", "json", timeout=120))
    qs = json.loads(
        devbroker.rabbitmqctl(
            node, "list_queues", "name", "memory", "type", "--formatter", "json", timeout=300
        )
    )
    # Categories as rabbitmqctl names them; "total" is the Erlang VM's own count (the rss
    # and allocator reservations are kept beside it: they move in steps, not per lock).
    raw = st["memory"]
    skip = ("allocated_unused", "reserved_unallocated")
    mem = {k: v for k, v in raw.items() if isinstance(v, int) and k not in skip}
    totals = raw.get("total", {})
    mem["total"] = int(totals.get("erlang", sum(mem.values())))
    by_type: dict[str, dict[str, int]] = {}
    for q in qs:
        t = by_type.setdefault(q["type"], {"queues": 0, "memory": 0})
        t["queues"] += 1
        t["memory"] += int(q["memory"])
    rss = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{beam}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {
        "memory": mem,
        "queues": by_type,
        "erlang_processes": st["processes"]["used"],
        "erlang_process_limit": st["processes"]["limit"],
        "fds_used": st["file_descriptors"]["total_used"],
        "fd_limit": st["file_descriptors"]["total_limit"],
        "sockets_used": st["file_descriptors"]["sockets_used"],
        "beam_rss": rss,
        "rss_reported": totals.get("rss"),
        "beam_cpu_s": process_cpu(beam),
    }


def _latency(broker: Broker, name: str, budget: Budget) -> dict[str, Any]:
    mutex = Mutex(broker, name)
    for _ in range(budget.warmup):
        lease = mutex.acquire()
        assert lease is not None
        lease.release()
    reps: list[list[float]] = []
    for _ in range(budget.reps):
        rep: list[float] = []
        end = time.monotonic() + budget.seconds
        while len(rep) < budget.max_samples and (not rep or time.monotonic() < end):
            t0 = time.perf_counter()
            lease = mutex.acquire()
            rep.append(time.perf_counter() - t0)
            if lease is None:
                raise RuntimeError("uncontended acquire failed")
            lease.release()
        reps.append(rep)
    return summarize_reps(reps)


def _per(delta: float, count: int) -> float:
    return round(delta / count) if count else math.nan


def live_locks(
    url: str,
    node: devbroker.NodeInfo | None,
    beam: int | None,
    sizes: list[int],
    budget: Budget,
    extras: dict[str, int],
    log: Log,
) -> dict[str, Any]:
    """Acquire latency and broker state with ``sizes`` mutexes held (cumulatively)."""
    prefix = unique_name("live")
    holders = _Holders(url, prefix)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"per_connection": PER_CONNECTION, "rows": rows}
    probe = unique_name("live-probe")
    extra_names: list[str] = []
    with Broker(url, connection_name="amqp-locks bench scale client") as broker:
        try:
            out["baseline"] = _broker_state(node, beam)
            if node is not None:  # on a quiet broker: deltas of a small heap are readable
                out["extras"] = _extras(url, node, beam, extras, extra_names, log)
            for size in sizes:
                placed = holders.grow(size)
                row: dict[str, Any] = {"locks": size, "connections": len(holders.procs)}
                row["place_s"] = round(placed, 2)
                row["acquire"] = _latency(broker, probe, budget)
                row["broker"] = _broker_state(node, beam)
                rows.append(row)
                log(
                    f"  {size} live locks on {row['connections']} connections: acquire p50="
                    f"{row['acquire']['p50_ms']:.2f} ms p99={row['acquire']['p99_ms']:.2f} ms, "
                    f"broker {row['broker'].get('memory', {}).get('total', 0) / 2**20:.0f} MiB, "
                    f"placed in {placed:.1f} s"
                )
        finally:
            holders.close()
            cleanup = [probe, fence_queue(probe)]
            cleanup += [f(probe, "mutex") for f in (sentinel_queue, wakeup_queue)]
            for n in holders.names:
                cleanup += [sentinel_queue(n, "mutex"), wakeup_queue(n, "mutex")]
            for n in extra_names:
                cleanup += [n, fence_queue(n), sentinel_queue(n, "mutex"), wakeup_queue(n, "mutex")]
            t0 = time.monotonic()
            _delete_queues(broker, cleanup)
            log(f"  removed {len(cleanup)} leftover queues in {time.monotonic() - t0:.1f} s")
    out["slopes"] = _slopes(rows)
    return out


def _extras(
    url: str,
    node: devbroker.NodeInfo,
    beam: int | None,
    extras: dict[str, int],
    names: list[str],
    log: Log,
) -> dict[str, Any]:
    """Memory of idle connections and of fence (quorum) queues, on top of what is held."""
    res: dict[str, Any] = {}
    before = _broker_state(node, beam)
    brokers = [
        Broker(url, connection_name=f"amqp-locks bench idle {i}")
        for i in range(extras["connections"])
    ]
    try:
        for b in brokers:
            b.connect()
        after = _broker_state(node, beam)
        delta = {k: after["memory"][k] - before["memory"].get(k, 0) for k in after["memory"]}
        res["connections"] = {
            "count": len(brokers),
            "bytes_each": _per(delta["total"], len(brokers)),
            # Erlang's `binary` here is the sockets' user-level buffers (sized from the
            # kernel's socket buffers); the rest is the connection's processes.
            "binary_bytes_each": _per(delta.get("binary", 0), len(brokers)),
            "rss_bytes_each": _per(
                (after["beam_rss"] or 0) - (before["beam_rss"] or 0), len(brokers)
            ),
            "erlang_processes_each": round(
                (after["erlang_processes"] - before["erlang_processes"]) / len(brokers), 1
            ),
        }
    finally:
        for b in brokers:
            b.close()
    n = extras["fenced"]
    before = _broker_state(node, beam)
    t0 = time.monotonic()
    with Broker(url) as b:
        for i in range(n):
            name = unique_name(f"fence{i}")
            names.append(name)
            lease = Mutex(b, name).acquire()
            assert lease is not None
            lease.release()
    took = time.monotonic() - t0
    after = _broker_state(node, beam)
    qq = after["queues"].get("quorum", {"queues": 0, "memory": 0})
    qq0 = before["queues"].get("quorum", {"queues": 0, "memory": 0})
    fdelta = {k: after["memory"][k] - before["memory"].get(k, 0) for k in after["memory"]}
    quorum = sum(v for k, v in fdelta.items() if k.startswith("quorum"))
    res["fence_queues"] = {
        "count": n,
        "quorum_bytes_each": _per(quorum, n),  # quorum_queue_procs + quorum_ets
        "bytes_each_total": _per(after["memory"]["total"] - before["memory"]["total"], n),
        "bytes_each_queue": _per(qq["memory"] - qq0["memory"], qq["queues"] - qq0["queues"]),
        "erlang_processes_each": round(
            (after["erlang_processes"] - before["erlang_processes"]) / n, 1
        ),
        "first_acquire_ms": round(1000 * took / n, 1),
    }
    log(f"  extras: {res}")
    return res


def _slopes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per held lock, between the smallest and the largest size measured."""
    if len(rows) < 2 or not rows[0]["broker"]:
        return {}
    a, b = rows[0], rows[-1]
    n = b["locks"] - a["locks"]
    ma, mb = a["broker"]["memory"], b["broker"]["memory"]
    cats = {k: _per(mb[k] - ma.get(k, 0), n) for k in mb if k != "total"}
    qa, qb = a["broker"]["queues"], b["broker"]["queues"]
    return {
        "locks": n,
        "bytes_total": _per(mb["total"] - ma["total"], n),
        "bytes_rss": _per((b["broker"]["beam_rss"] or 0) - (a["broker"]["beam_rss"] or 0), n),
        "bytes_by_category": {k: v for k, v in sorted(cats.items(), key=lambda kv: -kv[1]) if v},
        "queues_each": round(
            sum(q["queues"] for q in qb.values()) / n - sum(q["queues"] for q in qa.values()) / n,
            2,
        ),
        "queue_bytes_each": _per(
            sum(q["memory"] for q in qb.values()) - sum(q["memory"] for q in qa.values()), n
        ),
        "erlang_processes_each": round(
            (b["broker"]["erlang_processes"] - a["broker"]["erlang_processes"]) / n, 2
        ),
        "fds_each": round((b["broker"]["fds_used"] - a["broker"]["fds_used"]) / n, 4),
    }
