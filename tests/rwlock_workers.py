"""Read-write lock code run in spawned processes by tests/test_rwlock.py.

Every process records what it holds in shared memory, under one lock, *after* its acquire
returned and *before* it calls release: the broker's hand-off order then guarantees that
two recorded holds overlap only if the broker granted them at the same time.

counters: [readers now, writers now, violations, most readers at once, reader grants,
writer grants]
"""

from __future__ import annotations

import sys
import time
from typing import Any

from amqp_locks import Broker, ReadWriteLock

READERS_NOW, WRITERS_NOW, VIOLATIONS, MOST_READERS, READ_GRANTS, WRITE_GRANTS = range(6)


def enter(lock: Any, counters: Any, shared: bool) -> None:
    with lock:
        if counters[WRITERS_NOW] or (not shared and counters[READERS_NOW]):
            counters[VIOLATIONS] += 1
        if shared:
            counters[READERS_NOW] += 1
            counters[READ_GRANTS] += 1
            counters[MOST_READERS] = max(counters[MOST_READERS], counters[READERS_NOW])
        else:
            counters[WRITERS_NOW] += 1
            counters[WRITE_GRANTS] += 1


def leave(lock: Any, counters: Any, shared: bool) -> None:
    with lock:
        counters[READERS_NOW if shared else WRITERS_NOW] -= 1


def contend(
    url: str,
    name: str,
    shared: bool,
    rounds: int,
    hold: float,
    lock: Any,
    counters: Any,
    quorum: bool = False,
    stop: Any = None,
    together: Any = None,
) -> None:
    """`rounds` holds (or until `stop` is set), each `hold` seconds long. With a `together`
    barrier, a reader takes its first grant before waiting on it and a writer waits first:
    every reader then holds at once before any writer asks, whatever order the spawned
    processes started in (on a busy machine one can finish its rounds before the next has
    imported anything)."""
    with Broker(url) as broker:
        rw = ReadWriteLock(broker, name, quorum=quorum)  # set up by the test
        side = rw.read_lock if shared else rw.write_lock
        done = 0
        if together is not None:
            first = _grant(side, lock, counters, shared) if shared else None
            together.wait(120)
            if first is not None:
                _free(first, lock, counters, shared, hold)
                done = 1
        while done < rounds and not (stop is not None and stop.is_set()):
            _free(_grant(side, lock, counters, shared), lock, counters, shared, hold)
            done += 1


def _grant(side: Any, lock: Any, counters: Any, shared: bool) -> Any:
    lease = side.acquire(timeout=120)
    assert lease is not None, "acquire timed out"
    enter(lock, counters, shared)
    return lease


def _free(lease: Any, lock: Any, counters: Any, shared: bool, hold: float) -> None:
    time.sleep(hold)  # the work done while holding
    leave(lock, counters, shared)
    lease.release()


def hold(url: str, name: str, mode: str) -> None:
    """Acquire `mode` ("read" or "write"), print `HELD token`, then hold until killed."""
    broker = Broker(url)
    rw = ReadWriteLock(broker, name)
    lease = (rw.read_lock if mode == "read" else rw.write_lock).acquire(timeout=60)
    assert lease is not None
    print(f"HELD {lease.fencing_token}", flush=True)
    sys.stdin.read()  # until the test closes our stdin or kills us


if __name__ == "__main__":
    hold(sys.argv[1], sys.argv[2], sys.argv[3])
