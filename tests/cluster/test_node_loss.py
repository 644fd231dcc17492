"""Issue 21: the holder's node dies (SIGKILL) and stays down; every primitive goes on.

For each primitive: the lock's queues are set up through node 1 (so their quorum leaders
die too) or, on 4.3, also through node 3 (leaders on a survivor); a holder connected only
to node 1, a waiter connected to node 2. Node 1 is
killed and left down. The waiter must be granted within ``GRANT_BOUND`` (on 4.3: not before
the lock delay, issue 29) with no operator
action, the holder (whose process lives) must have been told first, and the fencing token
must rise. Node 1 comes back only for the next test (conftest's ``all_nodes_up``).

This holds on a Khepri cluster (4.3) too, where a dead node's exclusive queues stay until
it returns, because in cluster mode no lock is held by an exclusive queue
(docs/protocol.md section 11).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from amqp_locks.transport.quorum_guard import DEFAULT_LOCK_DELAY
from amqp_locks_dev import devbroker

from .conftest import Nodes
from .locks import KINDS, Held, set_up, take

pytestmark = pytest.mark.timeout(240)

#: Issue 21's target: a waiter on a surviving node is granted within 5 s (TARGET, printed
#: with the figure). Issue 29: on 4.3 a token held through a lost node is granted again
#: only after the lock delay (10 s by default), so that a cut-off holder is always told
#: first: there, within the delay + 5 s, and not before the delay has passed. What the
#: test asserts is a ceiling, as tests/cluster/test_failover.py's: the time is the
#: broker's (a new Raft leader, its failure detection), and in CI beside three other
#: lanes it once took 5.55 s on 3.10.8.
LOCK_DELAY = DEFAULT_LOCK_DELAY if devbroker.default_version() == "4.3" else 0.0
TARGET = LOCK_DELAY + 5.0
GRANT_BOUND = LOCK_DELAY + 15.0
WAIT = 60.0  # the waiter's own timeout

#: Where the lock's quorum leaders are: on the node that dies, or on a survivor (node 3;
#: 4.3 only, the Khepri line this is about, to keep CI's other lines short).
PLACEMENTS = ["dead", "survivor"] if devbroker.default_version() == "4.3" else ["dead"]


@pytest.mark.parametrize("leaders", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_waiter_granted_while_the_holders_node_stays_down(
    nodes: Nodes, name: str, kind: str, leaders: str
) -> None:
    b1, b2 = nodes.broker(1), nodes.broker(2)
    set_up(b1 if leaders == "dead" else nodes.broker(3), kind, name)
    # The premise: each of the lock's queues has a replica running on every node, so the
    # two survivors are a majority of each (all_nodes_up waited for every node's view).
    replicas = nodes.replicas(name, 2)
    assert replicas and all(r == ({1, 2, 3}, {1, 2, 3}) for r in replicas.values()), replicas
    held = take(b1, kind, name, 20)
    told_at: list[float] = []
    held.lease.on_lost(lambda _lease: told_at.append(time.monotonic()))

    got: list[tuple[float, Held]] = []
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            new = take(b2, kind, name, WAIT, waiter=True)
            got.append((time.monotonic(), new))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    # Whether the waiter queued up before the kill or after, the bound is the same.
    assert not got, "the waiter was granted while the holder held the lock"
    killed = time.monotonic()
    nodes.kill(1)
    assert held.lease.lost.wait(5.0), "the holder on the killed node was not told"
    t.join(WAIT)
    if errors or not got:  # the broker's view, while the waiter's connection still stands
        report = nodes.report(name, 2)
        assert not errors, f"the waiter failed: {errors[0]!r}; node 2 says:\n{report}"
        assert got, f"the waiter was never granted; node 2 says:\n{report}"
    granted_at, new = got[0]
    assert told_at, "on_lost was not called"
    told, granted = told_at[0] - killed, granted_at - killed
    print(
        f"\n{kind} (leaders on the {leaders} node): holder told {told:.3f} s, "
        f"waiter granted {granted:.3f} s after the kill "
        f"({'within' if granted <= TARGET else 'over'} the {TARGET:.0f} s target)"
    )
    assert granted <= GRANT_BOUND, f"granted only {granted:.2f} s after the kill"
    assert granted >= LOCK_DELAY, f"granted {granted:.2f} s after the kill: before the delay"
    # on_lost runs on its own thread, after lease.lost is set: an upper bound of "told"
    assert told_at[0] < granted_at, "the waiter was granted before the holder was told"
    assert new.lease.fencing_token > held.lease.fencing_token
    new.release()


@pytest.mark.parametrize("kind", KINDS)
def test_waiter_on_the_dead_node_moves_on(nodes: Nodes, name: str, kind: str) -> None:
    """Issue 21 point 4: a waiter whose node dies reconnects to another node and waits out
    its remaining time; the holder's release (elsewhere) then reaches it."""
    b1, b2 = nodes.broker(1), nodes.broker(2)
    set_up(b2, kind, name)
    held = take(b2, kind, name, 20)
    got: list[Held] = []
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            got.append(take(b1, kind, name, WAIT, waiter=True))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    nodes.kill(1)
    # The waiter's connection dies with node 1; it must not fail, and cannot be granted
    # while the holder (on node 2) holds.
    assert not held.lease.lost.wait(2.0), "the holder on a surviving node lost its lock"
    assert not errors, f"the waiter failed when its node died: {errors[0]!r}"
    assert not got, "the waiter was granted while the holder held the lock"
    released = time.monotonic()
    held.release()
    t.join(WAIT)
    assert not errors, f"the waiter failed: {errors[0]!r}"
    assert got, "the waiter was never granted"
    print(f"\n{kind}: waiter granted {time.monotonic() - released:.3f} s after the release")
    assert str(nodes.port(1)) not in b1.url  # it moved to another node
    assert got[0].lease.fencing_token > held.lease.fencing_token
    got[0].release()


#: A crashed holder process's lock must go on at once, lock delay or not (issue 29): its
#: channel closes and the broker returns its token without waiting. Scheduling absorbs.
CRASH_BOUND = 3.0


@pytest.mark.parametrize("kind", ["mutex", "write"])
def test_a_crashed_holder_process_is_not_delayed(nodes: Nodes, name: str, kind: str) -> None:
    """The lock delay applies to a lost *node*, not to a lost *process*: a SIGKILLed
    holder (its node alive) hands its lock to a waiter on another node in milliseconds."""
    b2 = nodes.broker(2)
    set_up(nodes.broker(1), kind, name)
    root = Path(__file__).resolve().parents[2]
    url = nodes.urls_from(1)[0]
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.partition_holder", url, name, kind, "0", "0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"},
    )
    try:
        assert holder.stdout is not None
        held = holder.stdout.readline().split()
        assert held[:1] == ["HELD"], held
        box: list[tuple[float, Held]] = []

        def waiter() -> None:
            new = take(b2, kind, name, WAIT, waiter=True)
            box.append((time.monotonic(), new))

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        assert not box, "granted while the holder held the lock"
        killed = time.monotonic()
        holder.kill()
        t.join(WAIT)
        assert box, "the waiter was never granted"
        granted = box[0][0] - killed
        print(f"\n{kind}: waiter granted {granted:.3f} s after the holder process was killed")
        assert granted < CRASH_BOUND, f"granted {granted:.2f} s after the crash"
        assert box[0][1].lease.fencing_token > int(held[1])
        box[0][1].release()
    finally:
        holder.kill()
        holder.wait(30)
