"""A healthy but busy cluster must tell no holder falsely that it lost its lock (issue 37).

    python -m benchmarks.busy_cluster --minutes 30 [--locks 200] [--churners 4] [--burners 2]

A private 3-node cluster of ``$AMQP_LOCKS_RABBITMQ`` (default 4.3; ``amqp_locks_dev``
starts it and stops it at the end) with, on the same machine:

* one *holder* process holding ``--locks`` mutexes in cluster mode through a Broker given
  all three URLs (the defaults: ``lock_delay`` 10 s, ``quorum_timeout`` 5 s), for the whole
  run;
* ``--churners`` threads in another process, each acquiring and releasing its own names
  over and over (a new name every 50 grants, so queues are made and expire as users' are);
* ``--burners`` processes spinning on the CPU.

Nothing is cut: every lost lease is a false loss. The run prints one JSON line: the
holder's losses (with their reasons), the churners' grants and losses, the machine's
load, and the guard's slowest check answer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from amqp_locks import Broker, Lease, Mutex
from amqp_locks_dev import devbroker, devcluster

NAME = "amqplocksbusy"


def _burn(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _holder(urls: list[str], locks: int, seconds: float, out: Any) -> None:
    """Hold `locks` mutexes for `seconds`; report every loss with its reason."""
    broker = Broker(urls, cluster=True)
    tag = uuid.uuid4().hex[:8]
    leases: list[Lease] = []
    try:
        for i in range(locks):
            lease = Mutex(broker, f"busy-{tag}-{i}").acquire(timeout=60)
            assert lease is not None, f"lock {i} not granted"
            leases.append(lease)
        placed = time.monotonic()
        out.send({"placed": len(leases)})
        slowest, checked = 0.0, 0
        while time.monotonic() - placed < seconds:
            time.sleep(1.0)
            session = broker.core._session  # the guard's own figures, read for the report
            if session is not None and session.guard is not None:
                slowest = max(slowest, session.guard.slowest)
                checked = max(checked, session.guard.checked)
        lost = [(lease.name, lease.lost_reason) for lease in leases if lease.lost.is_set()]
        out.send(
            {
                "held": len(leases),
                "lost": lost,
                "slowest_check_s": round(slowest, 3),
                "checks_answered": checked,
            }
        )
        for lease in leases:
            if not lease.lost.is_set():
                lease.release()
    finally:
        broker.close()


def _churn(urls: list[str], threads: int, stop: Any, out: Any) -> None:
    """`threads` threads acquiring and releasing names of their own until `stop`."""
    broker = Broker(urls, cluster=True)
    counts = {"grants": 0, "timeouts": 0, "lost": 0, "errors": 0}
    reasons: list[str] = []
    lock = threading.Lock()

    def churn(k: int) -> None:
        n = 0
        while not stop.is_set():
            name = f"churn-{os.getpid()}-{k}-{n // 50}"
            n += 1
            try:
                lease = Mutex(broker, name).acquire(timeout=30)
            except Exception as exc:  # counted, and the run goes on
                with lock:
                    counts["errors"] += 1
                    reasons.append(f"{type(exc).__name__}: {exc}")
                continue
            if lease is None:
                with lock:
                    counts["timeouts"] += 1
                continue
            time.sleep(0.05)  # a short critical section
            with lock:
                counts["grants"] += 1
                if lease.lost.is_set():
                    counts["lost"] += 1
                    reasons.append(str(lease.lost_reason))
            lease.release()

    workers = [threading.Thread(target=churn, args=(k,), daemon=True) for k in range(threads)]
    for t in workers:
        t.start()
    stop.wait()
    for t in workers:
        t.join(60)
    broker.close()
    out.send({**counts, "reasons": reasons[:10]})


def run(minutes: float, locks: int, churners: int, burners: int, version: str) -> dict[str, Any]:
    home = Path(os.environ.get("AMQP_LOCKS_HOME") or Path.home() / ".cache/amqp-locks")
    base = home / "bench" / version / NAME
    info = devcluster.start(NAME, 3, base, version=version)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    result: dict[str, Any] = {"version": version, "minutes": minutes, "locks": locks}
    procs: list[Any] = []
    try:
        procs = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(burners)]
        hold_recv, hold_send = ctx.Pipe(duplex=False)
        churn_recv, churn_send = ctx.Pipe(duplex=False)
        holder = ctx.Process(
            target=_holder, args=(info.urls, locks, minutes * 60, hold_send), daemon=True
        )
        churner = ctx.Process(
            target=_churn, args=(info.urls, churners, stop, churn_send), daemon=True
        )
        procs += [holder, churner]
        for p in procs:
            p.start()
        started = time.monotonic()
        result["placed"] = hold_recv.recv()["placed"]
        result["placed_after_s"] = round(time.monotonic() - started, 1)
        loads: list[float] = []
        while not hold_recv.poll(10):
            loads.append(os.getloadavg()[0])
            if not holder.is_alive():
                break
        result.update(hold_recv.recv() if hold_recv.poll(1) else {"holder": "died"})
        result["load_avg_max"] = max(loads, default=None)
        result["load_avg_mean"] = round(sum(loads) / len(loads), 2) if loads else None
        stop.set()
        result["churn"] = churn_recv.recv() if churn_recv.poll(120) else "no report"
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        devcluster.stop(NAME, base, version=version)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--locks", type=int, default=200)
    parser.add_argument("--churners", type=int, default=4)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--version", default=os.environ.get("AMQP_LOCKS_RABBITMQ", "4.3"))
    args = parser.parse_args()
    version = devbroker.check_version(args.version)
    print(json.dumps(run(args.minutes, args.locks, args.churners, args.burners, version)))


if __name__ == "__main__":
    main()
