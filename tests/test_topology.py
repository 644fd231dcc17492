"""The one table of what every lock is on the broker (amqp_locks.topology): docs render
from it, every function it names exists, and every queue the locks make on a real broker
is in it (a queue added in code but not in the table fails here)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from amqp_locks import (
    Broker,
    Mutex,
    PersistentSemaphore,
    ReadWriteLock,
    SemaphoreAdmin,
    TokenSemaphore,
    topology,
)
from amqp_locks_dev import devbroker

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
BEGIN, END = "<!-- topology:begin -->\n", "<!-- topology:end -->"


def test_docs_carry_the_table() -> None:
    """docs/protocol.md's block is what ``python -m amqp_locks.topology`` prints."""
    text = DOCS.read_text()
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    assert block == topology.markdown(), "run: python -m amqp_locks.topology (and paste)"


def test_every_named_function_exists() -> None:
    for q in topology.QUEUES:
        if not q.arguments.startswith("("):
            assert topology.resolve(q.arguments) is not None
        assert callable(topology.resolve(q.creator)) or topology.resolve(q.creator)


def _queues(node: devbroker.NodeInfo) -> set[str]:
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "--no-table-headers", "--quiet")
    return {line.strip() for line in out.splitlines() if line.strip()}


def _patterns(name: str) -> list[re.Pattern[str]]:
    """Each table row's name for lock `name`, slot numbers generalised."""
    out = []
    for q in topology.QUEUES:
        pattern = (
            re.escape(q.name(name)).replace(r"\-1\-A", r"-\d+-A").replace(r"\-1\-B", r"-\d+-B")
        )
        out.append(re.compile(pattern + "$"))
    return out


def test_every_queue_the_locks_make_is_in_the_table(
    node: devbroker.NodeInfo, amqp_url: str, name: str
) -> None:
    """Use every kind, on one node and in cluster mode, with a waiter that registers; every
    queue named after the lock is one of the table's (shared ones aside: shards, records,
    probes)."""
    before = _queues(node)
    with Broker(amqp_url) as one, Broker(amqp_url, cluster=True) as cluster:
        SemaphoreAdmin(one, name).create(1)
        for b in (one, cluster):
            with Mutex(b, name, timeout=10):
                pass
            sem = TokenSemaphore(b, f"{name}-t", first_use=True, permits=1)
            held = sem.acquire(timeout=10)
            assert held is not None
            got: list[object] = []
            waiter = threading.Thread(target=lambda s=sem, g=got: g.append(s.acquire(timeout=1.6)))
            waiter.start()  # waits 1.6 s: registers on the waiting queue after 1 s
            waiter.join(10)
            assert got == [None]  # held meanwhile
            held.release(wait=True)
            rw = ReadWriteLock(b, f"{name}-r", readers=2)
            for half in (rw.read_lock, rw.write_lock):
                lease = half.acquire(timeout=10)
                assert lease is not None
                lease.release(wait=True)
        with PersistentSemaphore(one, name, timeout=10):
            pass
        made = _queues(node) - before
        SemaphoreAdmin(one, name).destroy()
    ours = {q for q in made if q.startswith(name)}
    assert ours, "the locks made no queue?"
    patterns = _patterns(name) + _patterns(f"{name}-t") + _patterns(f"{name}-r")
    missing = sorted(q for q in ours if not any(p.match(q) for p in patterns))
    assert not missing, f"queues made but not in amqp_locks.topology: {missing}"
