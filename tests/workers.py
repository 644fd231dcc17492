"""Code run in other processes by the tests (spawned, so each has its own Broker/thread)."""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from amqp_locks import Broker, Mutex, PersistentSemaphore, TokenSemaphore


def reporting(target: Any, report: str, *args: Any) -> None:
    """Run `target(*args)` in a spawned process; on an exception, write its traceback to
    the file `report` (read by `joined`) before exiting non-zero, so a failed worker's
    cause reaches the test's own failure message and not only captured stderr."""
    try:
        target(*args)
    except BaseException:
        Path(report).write_text(traceback.format_exc())
        raise


def spawn(ctx: Any, reports: str, target: Any, arglists: list[tuple[Any, ...]]) -> list[Any]:
    """One `reporting` process of `target` per argument tuple (not started yet), each
    with its own report file under `reports`."""
    return [
        ctx.Process(target=reporting, args=(target, f"{reports}/{i}.err", *args))
        for i, args in enumerate(arglists)
    ]


def joined(procs: list[Any], reports: str, timeout: float = 240) -> None:
    """Join spawned `reporting` processes; fail naming each one's exit code and the last
    lines of the traceback it reported."""
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    if codes != [0] * len(procs):
        told = [
            f"#{i} ({code}): " + " | ".join(f.read_text().strip().splitlines()[-3:])
            for i, code in enumerate(codes)
            if code != 0
            for f in [Path(reports) / f"{i}.err"]
            if f.exists()
        ]
        raise AssertionError(f"workers' exit codes {codes}; " + "; ".join(told))


def contend(
    url: str,
    name: str,
    slots: int,
    rounds: int,
    lock: Any,
    occupancy: Any,
    counters: Any,
    kind: str = "semaphore",
) -> None:
    """Acquire/release `rounds` times; count every overlap seen in shared memory.

    counters: [current holders, max seen, violations, grants]
    """
    with Broker(url) as broker:
        sem: Any = (
            PersistentSemaphore(broker, name, max_races=1000)
            if kind == "semaphore"
            else TokenSemaphore(broker, name)
        )
        for _ in range(rounds):
            lease = sem.acquire(timeout=120)
            assert lease is not None, "acquire timed out"
            with lock:
                counters[0] += 1
                counters[3] += 1
                counters[1] = max(counters[1], counters[0])
                if counters[0] > slots or occupancy[lease.number] != 0:
                    counters[2] += 1
                occupancy[lease.number] += 1
            time.sleep(0.001)  # the "work" done while holding
            with lock:
                counters[0] -= 1
                occupancy[lease.number] -= 1
            lease.release()


def hold(url: str, name: str, kind: str, holder_id: str | None = None) -> None:
    """Acquire, report `HELD slot token`, then hold until killed."""
    broker = Broker(url, holder_id=holder_id)
    lock: Any = {"semaphore": PersistentSemaphore, "mutex": Mutex, "token": TokenSemaphore}[kind](
        broker, name
    )
    lease = lock.acquire(timeout=60)
    assert lease is not None
    print(f"HELD {lease.number} {lease.fencing_token}", flush=True)
    sys.stdin.read()  # until the test closes our stdin or kills us


if __name__ == "__main__":
    hold(*sys.argv[1:5])


def contend_in_processes(
    url: str, name: str, slots: int, procs_n: int, rounds: int, kind: str = "semaphore"
) -> list[int]:
    """Run `procs_n` spawned `contend` processes; returns the shared counters
    [current holders, max seen, violations, grants] once all exited cleanly."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    occupancy = ctx.Array("i", slots + 1, lock=False)
    counters = ctx.Array("i", 4, lock=False)
    with tempfile.TemporaryDirectory() as reports:
        args = (url, name, slots, rounds, lock, occupancy, counters, kind)
        procs = spawn(ctx, reports, contend, [args] * procs_n)
        for p in procs:
            p.start()
        joined(procs, reports)
    return list(counters)


def first_use_contend(
    urls: list[str],
    name: str,
    lock: Any,
    counters: Any,
    ready: Any,
    go: Any,
    permits: int = 0,
    cluster: bool = True,
) -> None:
    """Connect (in cluster mode unless `cluster` is false), say so (`ready`), wait for
    `go`, then take `name` once (all racers hit its first use together) and count
    overlaps: the mutex `name` (`permits` 0), else the first-use token semaphore `name`
    with `permits` permits (classic on one node when not `cluster`).

    counters: [current holders, max seen, violations, grants]
    """
    limit = permits or 1
    with Broker(urls, cluster=cluster, heartbeat=5.0) as broker:
        broker.connect()
        before = broker.core.run(broker.core.session())
        ready.release()
        go.wait()
        if permits:
            sem = TokenSemaphore(broker, name, first_use=True, permits=permits, quorum=cluster)
            lease = sem.acquire(timeout=120)
        else:
            lease = Mutex(broker, name).acquire(timeout=120)
        assert lease is not None, "acquire timed out"
        # Losing the race must not cost the loser its connection (and every other lock
        # on it): the broker closing it (541 when a consume meets a quorum queue whose
        # member is not running yet, tokens/fresh.py) is a failure. The client's own
        # drops (missed heartbeats on a stalled machine) read otherwise and are not.
        reason = before.lost_reason or ""
        assert not reason.startswith("connection closed:"), f"the broker closed: {reason}"
        with lock:
            counters[0] += 1
            counters[3] += 1
            counters[1] = max(counters[1], counters[0])
            if counters[0] > limit:
                counters[2] += 1
        time.sleep(0.02)  # the "work" done while holding
        with lock:
            counters[0] -= 1
        lease.release(wait=True)


def race_first_use(
    urls_per_proc: list[list[str]], name: str, permits: int = 0, cluster: bool = True
) -> list[int]:
    """One spawned `first_use_contend` process per URL list, all released at once on the
    fresh name; returns [current holders, max seen, violations, grants] after all exited."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    counters = ctx.Array("i", 4, lock=False)
    ready, go = ctx.Semaphore(0), ctx.Event()
    with tempfile.TemporaryDirectory() as reports:
        procs = spawn(
            ctx,
            reports,
            first_use_contend,
            [(urls, name, lock, counters, ready, go, permits, cluster) for urls in urls_per_proc],
        )
        for p in procs:
            p.start()
        for _ in procs:  # every racer connected: the race is on the first use, not connects
            assert ready.acquire(timeout=120), "a racer did not connect"
        go.set()
        joined(procs, reports)
    return list(counters)
