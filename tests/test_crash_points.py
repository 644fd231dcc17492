"""The crash-point harness (issue 36): a client process cut off after each frame it sends
on a multi-step path, the name granting again afterwards within the stated bound, with no
operator.

`FaultProxy.cut_after(n)` forwards the first `n` frames the client's connections send
(heartbeats not counted) and then resets all of them, as the client's death would. For a
path that sends N frames, every n in 1..N is tried on a fresh name: the creator (through
the proxy) starts the path and is cut; another client (direct) must then be granted within
the heal bound (tokens/heal.py: a queue left short of tokens is replaced by its waiters),
and once everyone released, the lock holds exactly its tokens (no token lost, none
doubled). The fence shards are made beforehand: their own paths are fencing.py's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest

from amqp_locks import Broker, Mutex, ReadWriteLock, prepare_fences
from amqp_locks.lease import Lease
from amqp_locks.names import quorum_mutex_name, token_queue
from amqp_locks.rwlock import readers_queue, writer_queue
from amqp_locks.tokens import heal

from . import waiting
from .conftest import heal_bound
from .conftest import queue_counts as _counts
from .faultproxy import FaultProxy

LOCK_DELAY = 2.0
#: Room for a loaded machine beyond the heal bound.
ALLOWANCE = 8.0


def _limit() -> float:
    """The heal bound with LOCK_DELAY from the waiter's arrival (conftest.heal_bound, read
    at use: quick_heal's values), and the allowance. Until 2026-12-02 this left out the
    first waiter's wait for the queue to run (fresh.RUNNING_WAIT, 5 s) and the samples, so
    the 8 s allowance was 2-3 s in truth (grants took 10-11 s against 12.8 s)."""
    return heal_bound(LOCK_DELAY) + ALLOWANCE


pytestmark = pytest.mark.usefixtures("quick_heal")


def _broker(url: str) -> Broker:
    return Broker(url, cluster=True, heartbeat=5.0, lock_delay=LOCK_DELAY)


Path = Callable[[Broker, str], "Lease | None"]


def _frames_of(proxy: FaultProxy, path: Path, name: str) -> int:
    """How many frames the path sends on a fresh name, start to grant (uncut)."""
    with contextlib.closing(_broker(proxy.url())) as b:
        b.core.run(b.core.session())
        proxy.count_frames()
        lease = path(b, name)
        sent = proxy.frames_sent
        assert lease is not None
        lease.release(wait=True)
    return sent


def _sweep(
    amqp_url: str,
    proxy: FaultProxy,
    path: Path,
    name_prefix: str,
    settled: Callable[[Broker, str], bool],
) -> dict[int, float]:
    """Cut after every frame of `path`; returns seconds to the next grant per cut point."""
    with contextlib.closing(_broker(amqp_url)) as direct:
        prepare_fences(direct)
        frames = _frames_of(proxy, path, f"{name_prefix}-count")
        assert frames > 3
        took: dict[int, float] = {}
        for n in range(1, frames + 1):
            name = f"{name_prefix}-{n}"
            proxy.count_frames()  # the last cut's dead client is gone: accept this one
            creator = _broker(proxy.url())
            try:
                creator.core.run(creator.core.session())
                proxy.cut_after(n)
                with contextlib.suppress(Exception):  # the cut, or a grant after a reconnect
                    lease = path(creator, name)
                    if lease is not None:
                        lease.release(wait=True)
                # A fresh connection's first fenced grant looks its shard's current fence
                # generation up (fencing.py), in a number of frames that depends on the
                # shard's state: a path that completed in fewer frames than the count run
                # was cut after its last one.
                completed = not proxy.fired
            finally:
                creator.close(timeout=1)
            if completed:
                break
            started = time.monotonic()
            lease = path(direct, name)
            took[n] = time.monotonic() - started
            assert lease is not None, f"cut after frame {n}: no grant in {took[n]:.1f}s"
            lease.release(wait=True)
            waiting.wait_until(
                lambda n=name: settled(direct, n),
                10,
                f"cut {n}: tokens settled",
                0.05,  # type: ignore[misc]
            )
        return took


def test_every_cut_of_a_first_use_mutex_grants_again(
    amqp_url: str, amqp_proxy: FaultProxy, name: str
) -> None:
    """Cluster mode's mutex, made on first use: after a cut at any frame the name grants
    within the bound, and exactly one token is left."""

    def path(b: Broker, n: str) -> Lease | None:
        return Mutex(b, n).acquire(timeout=_limit())

    def settled(b: Broker, n: str) -> bool:
        return _counts(b, token_queue(quorum_mutex_name(n))) == (1, 0)

    took = _sweep(amqp_url, amqp_proxy, path, name, settled)
    assert max(took.values()) <= _limit()
    _report("mutex", took)


def test_every_cut_of_a_first_use_read_write_lock_grants_again(
    amqp_url: str, amqp_proxy: FaultProxy, name: str
) -> None:
    """A read-write lock made on first use by a writer (readers queue with R tokens, then
    the writer queue with the turn): after a cut at any frame, a writer is granted within
    the bound, and exactly R tokens and one turn are left."""

    def path(b: Broker, n: str) -> Lease | None:
        return ReadWriteLock(b, n, readers=2).write_lock.acquire(timeout=_limit())

    def settled(b: Broker, n: str) -> bool:
        return _counts(b, readers_queue(n)) == (2, 0) and _counts(b, writer_queue(n)) == (1, 0)

    took = _sweep(amqp_url, amqp_proxy, path, name, settled)
    assert max(took.values()) <= _limit()
    _report("rwlock", took)


def _report(what: str, took: dict[int, float]) -> None:
    healed = sorted(n for n, t in took.items() if t > heal.REGISTER_AFTER)
    print(
        f"{what}: {len(took)} cut points, slowest grant {max(took.values()):.1f}s; "
        f"healed after cuts {healed}"
    )
