"""The quorum guard at scale (issue 37): one process holds N locks in cluster mode behind a
proxy adding a round trip, for a while; count the leases falsely lost and what the
guard's checks cost the broker.

    python -m benchmarks.guard_scale --locks 2000 --rtt-ms 10 --hold 600 [--url URL]
        [--lock-delay SECONDS]

``--lock-delay`` is the Brokers' ``lock_delay`` (default 10 s); the guard's bound is half
of it and a held lock is checked every quarter, so the broker's checks per held lock per
second are ``4 / lock_delay`` (0.4 by default, 0.067 with 60 s).

Without ``--url`` a private node of ``$AMQP_LOCKS_RABBITMQ`` (default 3.10) is started
(``amqp_locks_dev.devbroker``, name ``guardscale``). The locks are fencing-free mutexes
(cluster mode: one quorum token queue each), acquired before the delay is switched on;
the round trip is added by ``tests/faults/proxy.py`` (half each way) on every connection
of the client, the guard's own included. The broker's CPU over the hold is read from
``/proc`` (its Erlang VM); divided by the checks answered it is an upper bound of a
check's cost (the held consumers and the connections' heartbeats are in it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from amqp_locks import aio
from amqp_locks.errors import AmqpLocksError
from amqp_locks.transport.quorum_guard import QuorumGuard
from amqp_locks_dev import devbroker
from tests.faults.proxy import FaultProxy

BATCH = 20  # acquires in flight while placing the locks (more overloads a 2-core node)
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _proxy_main(host: str, port: int, conn: Any) -> None:
    """The proxy in a process of its own: its pump threads must not share the client's
    GIL (in the client's process they delayed the guard's answers by seconds)."""
    with FaultProxy(host, port) as proxy:  # bytes only: no frame parsing needed
        conn.send(proxy.url())
        while (cmd := conn.recv()) != "exit":
            proxy.delay(cmd)
            conn.send("ok")


class _Proxy:
    def __init__(self, host: str, port: int) -> None:
        self.conn, child = multiprocessing.Pipe()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_proxy_main, args=(host, port, child), daemon=True
        )
        self.proc.start()
        self.url: str = self.conn.recv()

    def delay(self, seconds: float) -> None:
        self.conn.send(seconds)
        self.conn.recv()

    def close(self) -> None:
        self.conn.send("exit")
        self.proc.join(10)


def _guard(broker: aio.Broker) -> QuorumGuard:
    session = broker.core._session
    assert session is not None and session.guard is not None, "no quorum guard: not cluster mode"
    return session.guard


async def run(
    url: str,
    beam: int | None,
    locks: int,
    rtt_ms: float,
    hold: float,
    per_broker: int = 1000,
    lock_delay: float | None = None,
) -> dict[str, Any]:
    host, port = url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)
    proxy = _Proxy(host, int(port))
    try:
        # One held token is one channel: a connection carries fewer than channel_max (2047).
        brokers = [
            aio.Broker(
                proxy.url,
                cluster=True,
                connection_name=f"guard_scale {i}",
                lock_delay=lock_delay,
            )
            for i in range(math.ceil(locks / per_broker))
        ]
        prefix = f"guardscale-{os.getpid()}-{int(time.time())}"
        leases: list[Any] = [None] * locks
        replaced = 0
        failed_placing = 0
        rounds = 0
        try:
            t0 = time.monotonic()
            # Placing is not what is measured: a lease lost meanwhile (a connection that a
            # node busy declaring queues dropped) is acquired again before the delay.
            while todo := [
                j for j, lease in enumerate(leases) if lease is None or lease.lost.is_set()
            ]:
                replaced += sum(1 for j in todo if leases[j] is not None)
                if rounds >= 20:
                    raise RuntimeError(f"{len(todo)} mutexes not held after 20 rounds")
                rounds += 1  # a fresh name: a first use cut mid-creation may stay tokenless
                for i in range(0, len(todo), BATCH):
                    batch = todo[i : i + BATCH]
                    got = await asyncio.gather(
                        *(
                            aio.Mutex(
                                brokers[j * len(brokers) // locks],
                                f"{prefix}-{j}-{rounds}",
                                fencing=False,
                            ).acquire(timeout=60)
                            for j in batch
                        ),
                        return_exceptions=True,
                    )
                    for j, lease in zip(batch, got, strict=True):
                        if isinstance(lease, BaseException):
                            # a connection dropped while placing (a node busy making or
                            # deleting queues): placed again in the next round
                            if not isinstance(lease, AmqpLocksError):
                                raise lease
                            failed_placing += 1
                            lease = None
                        leases[j] = lease
            placed = time.monotonic() - t0
            guards = [_guard(b) for b in brokers]
            for g in guards:
                g.slowest = 0.0
            proxy.delay(rtt_ms / 2000)
            start = time.monotonic()
            cpu1, checked1 = (_cpu(beam) if beam else 0.0), sum(g.checked for g in guards)
            samples = []
            while (elapsed := time.monotonic() - start) < hold:
                await asyncio.sleep(min(10.0, hold - elapsed))
                now = time.monotonic()
                ages = [now - t for g in guards for t in g.lock_proofs.values()]
                lost = sum(1 for lease in leases if lease.lost.is_set())
                samples.append(
                    {
                        "t": round(now - start, 1),
                        "lost": lost,
                        "checked": sum(g.checked for g in guards) - checked1,
                        "in_flight": sum(len(g._in_flight) for g in guards),
                        "pipes": sum(len(g._pipes) for g in guards),
                        "max_proof_age": round(max(ages, default=0.0), 2),
                        "slowest_answer": round(max(g.slowest for g in guards), 2),
                        "load1": os.getloadavg()[0],
                    }
                )
                print(json.dumps(samples[-1]), flush=True)
                if lost:
                    break
            span = time.monotonic() - start
            checks = sum(g.checked for g in guards) - checked1
            cpu = (_cpu(beam) - cpu1) if beam else 0.0
            lost = sum(1 for lease in leases if lease.lost.is_set())
            reasons = {lease.lost_reason for lease in leases if lease.lost.is_set()}
            return {
                "locks": locks,
                "brokers": len(brokers),
                "rtt_ms": rtt_ms,
                "lock_delay_s": brokers[0].lock_delay,
                "quorum_timeout_s": brokers[0].quorum_timeout,
                "held_s": round(span, 1),
                "lost": lost,
                "lost_reasons": sorted(str(r)[:200] for r in reasons)[:3],
                "placed_s": round(placed, 1),
                "lost_while_placing": replaced,
                "acquires_failed_while_placing": failed_placing,
                "checks_per_s": round(checks / span, 1),
                "checks_per_lock_per_s": round(checks / span / locks, 3),
                "broker_cpu_s_per_s": round(cpu / span, 3) if beam else None,
                "broker_cpu_us_per_check": (
                    round(1e6 * cpu / checks, 1) if beam and checks else None
                ),
                "max_proof_age_s": max((s["max_proof_age"] for s in samples), default=None),
                "slowest_answer_s": max(g.slowest for g in guards),
                "most_in_flight": max(g.most_in_flight for g in guards),
                "load1_mean": round(sum(s["load1"] for s in samples) / max(1, len(samples)), 1),
            }
        finally:
            proxy.delay(0)
            for lease in leases:
                if lease is not None and lease.held:
                    await lease.release()
            for broker in brokers:
                await broker.close()
    finally:
        proxy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--locks", type=int, default=2000)
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--hold", type=float, default=600.0, help="seconds held with the delay")
    parser.add_argument("--per-broker", type=int, default=1000, help="locks per connection")
    parser.add_argument("--url", help="a running node (default: a private one is started)")
    parser.add_argument("--pid", type=int, help="the node's Erlang VM pid, for its CPU")
    parser.add_argument("--lock-delay", type=float, help="the Brokers' lock_delay (s)")
    args = parser.parse_args()
    url, pid = args.url, args.pid
    if url is None:
        url = devbroker.url("guardscale")
        pid = int((devbroker.node_dir("guardscale") / "rabbitmq.pid").read_text().split()[0])
    result = asyncio.run(
        run(url, pid, args.locks, args.rtt_ms, args.hold, args.per_broker, args.lock_delay)
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
