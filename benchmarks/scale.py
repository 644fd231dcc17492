"""Many distinct live locks: acquire latency and broker memory against the number held
(mutexes without fencing tokens in holder processes, ``PER_CONNECTION`` per connection),
and first, on the quiet broker, the memory of idle connections and of fence queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amqp_locks import Broker, Mutex
from amqp_locks.names import sentinel_queue, wakeup_queue
from amqp_locks_dev import devbroker

from .compare import cycles
from .peers.kinds import make
from .peers.worker import context, quiet
from .stats import Budget, brief, delete_queues, leftovers, unique_name

PER_CONNECTION = 1000
BATCH = 50  # acquires in flight per connection while placing holders


def _holder_main(url: str, conn: Any) -> None:
    """Hold mutexes on one connection: ("hold", names) -> ("held", n); "exit"."""
    quiet()  # exiting drops the connection: every lease then logs that it was lost
    from amqp_locks import aio

    async def serve() -> None:
        broker = aio.Broker(url, connection_name="amqp-locks bench scale holder")
        held = []
        loop = asyncio.get_running_loop()
        try:
            while (cmd := await loop.run_in_executor(None, conn.recv))[0] == "hold":
                for i in range(0, len(cmd[1]), BATCH):
                    batch = cmd[1][i : i + BATCH]
                    mutexes = [aio.Mutex(broker, n, fencing=False) for n in batch]
                    held += await asyncio.gather(*(m.acquire(timeout=60) for m in mutexes))
                    if None in held:
                        raise RuntimeError("a scale mutex was not granted within 60 s")
                conn.send(("held", len(held)))
        except Exception as exc:
            conn.send(("error", repr(exc)[:300]))
        finally:
            await broker.close()

    asyncio.run(serve())


class _Holders:
    """Holder processes; ``grow(total)`` brings the locks held to ``total``."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url, self.prefix, self.ctx = url, prefix, context()
        self.procs: list[tuple[Any, Any]] = []  # (process, pipe), PER_CONNECTION locks each
        self.names: list[str] = []

    def grow(self, total: int) -> float:
        t0 = time.monotonic()
        orders: dict[int, list[str]] = {}
        for i in range(len(self.names), total):
            self.names.append(f"{self.prefix}-{i}")
            orders.setdefault(i // PER_CONNECTION, []).append(self.names[-1])
        while len(self.procs) < len(self.names) / PER_CONNECTION:
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=_holder_main, args=(self.url, child), daemon=True)
            p.start()
            self.procs.append((p, parent))
        for idx, names in orders.items():  # connections place their share concurrently
            self.procs[idx][1].send(("hold", names))
        for idx in orders:
            pipe = self.procs[idx][1]
            msg = pipe.recv() if pipe.poll(600) else ("error", "no answer within 600 s")
            if msg[0] != "held":
                raise RuntimeError(f"scale holder failed: {msg[1]}")
        return time.monotonic() - t0

    def close(self) -> None:
        for _, pipe in self.procs:
            with contextlib.suppress(OSError):
                pipe.send(("exit",))
        for p, _ in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def _broker_state(node: devbroker.NodeInfo | None, beam: int | None) -> dict[str, Any]:
    """Memory by category, Erlang processes and descriptors, and every queue's memory."""
    if node is None:
        return {}

    def ctl(*args: str) -> Any:
        return json.loads(devbroker.rabbitmqctl(node, *args, "--formatter", "json", timeout=300))

    st, queues = ctl("status"), ctl("list_queues", "name", "memory", "type")
    # Categories as rabbitmqctl names them; "total" is the Erlang VM's own count (the rss
    # and allocator reservations are kept beside it: they move in steps, not per lock).
    raw, skip = st["memory"], ("allocated_unused", "reserved_unallocated")
    mem = {k: v for k, v in raw.items() if isinstance(v, int) and k not in skip}
    mem["total"] = int(raw.get("total", {}).get("erlang", sum(mem.values())))
    by_type: dict[str, dict[str, int]] = {}
    for q in queues:
        t = by_type.setdefault(q["type"], {"queues": 0, "memory": 0})
        t["queues"] += 1
        t["memory"] += int(q["memory"])
    rss = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path(f"/proc/{beam}/status").read_text().splitlines()
        rss = int(next(x for x in lines if x.startswith("VmRSS:")).split()[1]) * 1024
    return {
        "memory": mem,
        "queues": by_type,
        "erlang_processes": st["processes"]["used"],
        "fds_used": st["file_descriptors"]["total_used"],
        "beam_rss": rss,
    }


def _per(delta: float, count: int, digits: int | None = None) -> float:
    return round(delta / count, digits) if count else float("nan")


def _delta(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
    """Per object added between two broker states: memory by category, processes, queues."""
    q0, q1 = (
        [sum(x[k] for x in s["queues"].values()) for k in ("queues", "memory")]
        for s in (before, after)
    )
    return {
        "memory": {k: _per(v - before["memory"].get(k, 0), n) for k, v in after["memory"].items()},
        "rss": _per((after["beam_rss"] or 0) - (before["beam_rss"] or 0), n),
        "procs": (after["erlang_processes"] - before["erlang_processes"]) / n,
        "queues": _per(q1[0] - q0[0], n, 2),
        "queue_bytes": _per(q1[1] - q0[1], n),
    }


def live_locks(
    url: str,
    node: devbroker.NodeInfo | None,
    beam: int | None,
    sizes: list[int],
    budget: Budget,
    extras: dict[str, int],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Acquire latency and broker state with ``sizes`` mutexes held (cumulatively)."""
    holders = _Holders(url, unique_name("live"))
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"per_connection": PER_CONNECTION, "rows": rows}
    probe, extra = unique_name("live-probe"), []
    lock = make("mutex", probe, 1, {"amqp": url})
    try:
        if node is not None:  # on a quiet broker: deltas of a small heap are readable
            out["extras"] = _extras(url, node, beam, extras, extra)
            log(f"  extras: {out['extras']}")
        for size in sizes:
            row: dict[str, Any] = {"locks": size, "place_s": round(holders.grow(size), 2)}
            row["connections"] = len(holders.procs)
            row["acquire"] = cycles(lock.acquire, lock.release, budget)["acquire"]
            rows.append({**row, "broker": _broker_state(node, beam)})
            mib = rows[-1]["broker"].get("memory", {}).get("total", 0) / 2**20
            log(f"  {size} live locks: acquire {brief(row['acquire'])}, broker {mib:.0f} MiB")
    finally:
        lock.close()
        holders.close()
        cleanup = leftovers(probe) + [q for n in extra for q in leftovers(n)]
        cleanup += [f(n, "mutex") for n in holders.names for f in (sentinel_queue, wakeup_queue)]
        t0 = time.monotonic()
        delete_queues(url, cleanup)
        log(f"  removed {len(cleanup)} leftover queues in {time.monotonic() - t0:.1f} s")
    if len(rows) > 1 and rows[0]["broker"]:
        n = rows[-1]["locks"] - rows[0]["locks"]
        d = _delta(rows[0]["broker"], rows[-1]["broker"], n)
        cats = sorted(
            ((k, v) for k, v in d["memory"].items() if v and k != "total"), key=lambda kv: -kv[1]
        )
        out["slopes"] = {  # per held lock, between the smallest and the largest size measured
            "locks": n,
            "bytes_total": d["memory"]["total"],
            "bytes_rss": d["rss"],
            "bytes_by_category": dict(cats),
            "queues_each": d["queues"],
            "queue_bytes_each": d["queue_bytes"],
            "erlang_processes_each": round(d["procs"], 2),
        }
    return out


def _extras(
    url: str, node: devbroker.NodeInfo, beam: int | None, extras: dict[str, int], names: list[str]
) -> dict[str, Any]:
    """Memory of idle connections and of fence (quorum) queues, on top of what is held."""
    n = extras["connections"]
    before = _broker_state(node, beam)
    brokers = [Broker(url, connection_name=f"amqp-locks bench idle {i}") for i in range(n)]
    try:
        for b in brokers:
            b.connect()
        d = _delta(before, _broker_state(node, beam), n)
    finally:
        for b in brokers:
            b.close()
    connections = {  # Erlang's `binary` here: the sockets' user-level buffers
        "count": n,
        "bytes_each": d["memory"]["total"],
        "binary_bytes_each": d["memory"].get("binary", 0),
        "rss_bytes_each": d["rss"],
        "erlang_processes_each": round(d["procs"], 1),
    }
    n = extras["fenced"]
    before, t0 = _broker_state(node, beam), time.monotonic()
    with Broker(url) as b:
        for i in range(n):
            names.append(unique_name(f"fence{i}"))
            lease = Mutex(b, names[-1]).acquire()
            assert lease is not None
            lease.release()
    took, after = time.monotonic() - t0, _broker_state(node, beam)
    d = _delta(before, after, n)
    qa, qb = (s["queues"].get("quorum", {"queues": 0, "memory": 0}) for s in (before, after))
    quorum = sum(
        v - before["memory"].get(k, 0) for k, v in after["memory"].items() if k.startswith("quorum")
    )
    return {
        "connections": connections,
        "fence_queues": {
            "count": n,
            "quorum_bytes_each": _per(quorum, n),
            "bytes_each_total": d["memory"]["total"],
            "bytes_each_queue": _per(qb["memory"] - qa["memory"], qb["queues"] - qa["queues"]),
            "erlang_processes_each": round(d["procs"], 1),
            "first_acquire_ms": round(1000 * took / n, 1),
        },
    }
