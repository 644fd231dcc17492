"""The quorum guard on a real cluster: a holder whose node lost its majority is told.

Nodes 2 and 3 are frozen (SIGSTOP): node 1 keeps serving its clients, heartbeats flow, but
nothing commits on a quorum queue, so no probe is confirmed. The holder connected to node
1 must learn it lost its lock within ``quorum_timeout`` (plus scheduling), well before
``net_ticktime`` (60 s on these nodes) lets anyone notice node 1 is cut off; after the
nodes thaw, the lock is granted again with a higher fencing token.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from amqp_locks import Mutex, ReadWriteLock, TokenSemaphore

from .conftest import Nodes

pytestmark = pytest.mark.timeout(180)

BOUND = 3.0  # quorum_timeout given to the holder's Broker
SLACK = 2.0  # scheduling on a loaded 2-core machine


def _freeze(nodes: Nodes, frozen: list[int]) -> float:
    at = time.monotonic()
    for index in (2, 3):
        os.kill(nodes.pid(index), signal.SIGSTOP)
        frozen.append(index)
    return at


@pytest.mark.parametrize("kind", ["token", "mutex", "write"])
def test_holder_on_a_node_without_majority_is_told(
    nodes: Nodes, name: str, frozen: list[int], kind: str
) -> None:
    b1 = nodes.broker(1, quorum_timeout=BOUND)
    if kind == "token":
        TokenSemaphore(b1, name).setup(permits=1)
        lock = TokenSemaphore(b1, name)
    elif kind == "mutex":
        lock = Mutex(b1, name)  # type: ignore[assignment]
    else:
        lock = ReadWriteLock(b1, name).write_lock  # type: ignore[assignment]
    held = lock.acquire(timeout=20)
    assert held is not None
    guard = b1.core._session.guard if b1.core._session else None
    assert guard is not None and guard.confirmed > 0, "the guard never had a confirm"

    frozen_at = _freeze(nodes, frozen)
    assert held.lost.wait(BOUND + SLACK), "the holder was not told within quorum_timeout"
    told = time.monotonic() - frozen_at
    assert held.lost_reason is not None and "quorum" in held.lost_reason
    # The proof is the newest confirmed probe (sent at most one interval before the freeze)
    # or the held lock's newest answered check (at most one check period before it).
    assert told >= BOUND - b1.core.timing.check_period - 0.1, told
    print(f"\n{kind}: holder told {told:.2f} s after the freeze (quorum_timeout {BOUND} s)")

    for index in frozen:
        os.kill(nodes.pid(index), signal.SIGCONT)
    frozen.clear()
    b2 = nodes.broker(2)
    again = (
        TokenSemaphore(b2, name)
        if kind == "token"
        else Mutex(b2, name)
        if kind == "mutex"
        else ReadWriteLock(b2, name).write_lock
    ).acquire(timeout=60)
    assert again is not None, "the lock was not granted again after the thaw"
    assert again.fencing_token > held.fencing_token
    again.release()
