"""Cluster mode's mutex on fresh names, on the 3-node cluster (tokens/fresh.py): clients on
every node racing on a name nobody used get one token, one holder at a time; the queue is
gone once unused and made again with higher fencing tokens."""

from __future__ import annotations

import pytest

from amqp_locks import Broker, Mutex, TokenAdmin
from amqp_locks.errors import QueueNotFound
from amqp_locks.names import quorum_mutex_name, token_queue
from amqp_locks.tokens import fresh

from .. import waiting
from ..workers import race_first_use
from .conftest import Nodes

SHORT_EXPIRES_MS = 1500


def _counts(broker: Broker, queue: str) -> tuple[int, int] | None:
    """(ready, consumers) of `queue`, None when it does not exist."""

    async def go() -> tuple[int, int] | None:
        session = await broker.core.session()
        try:  # one passive declare: a queue can expire between two
            return await session.declare_passive_counts(queue)
        except QueueNotFound:
            return None

    return broker.core.run(go())


def test_clients_on_every_node_racing_on_a_fresh_name(nodes: Nodes, name: str) -> None:
    racers = [nodes.urls_from(1 + i % 3) for i in range(9)]
    current, most, violations, grants = race_first_use(racers, name)
    assert (current, most, violations, grants) == (0, 1, 0, 9)
    queue = token_queue(quorum_mutex_name(name))
    b = nodes.broker(2)
    waiting.wait_until(lambda: _counts(b, queue) == (1, 0), 10, "one token, back", 0.02)
    st = TokenAdmin(b, quorum_mutex_name(name)).status()
    assert (st.permits, st.ready, st.held) == (1, 1, 0)


def test_expiry_and_rising_tokens_across_nodes(
    nodes: Nodes, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fresh, "EXPIRES_MS", SHORT_EXPIRES_MS)
    queue = token_queue(quorum_mutex_name(name))
    tokens = []
    for index in (1, 2, 3):
        lease = Mutex(nodes.broker(index), name).acquire(timeout=10)
        assert lease is not None
        tokens.append(lease.fencing_token)
        lease.release(wait=True)
    reader = nodes.broker(1)
    waiting.wait_until(lambda: _counts(reader, queue) is None, 30, f"{queue!r} to expire", 0.1)
    lease = Mutex(nodes.broker(3), name).acquire(timeout=10)  # made again, on another node
    assert lease is not None
    tokens.append(lease.fencing_token)
    lease.release(wait=True)
    assert tokens == sorted(set(tokens)), tokens
    waiting.wait_until(lambda: _counts(reader, queue) is None, 30, f"{queue!r} to expire", 0.1)
