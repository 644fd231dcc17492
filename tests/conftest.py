"""Test fixtures: a real private RabbitMQ node (started once per session), brokers, names."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from yarl import URL

from amqp_locks import Broker
from amqp_locks_dev import devbroker

from .faultproxy import FaultProxy
from .nodes import node_name, test_home

TEST_NODE = node_name("amqplockstest")


@pytest.fixture(scope="session")
def node() -> Iterator[devbroker.NodeInfo]:
    """The private broker node every integration test uses (started by the tests)."""
    home = test_home()
    base_dir = home / TEST_NODE if home else None
    was_running = devbroker.status(name=TEST_NODE, base_dir=base_dir) is not None
    info = devbroker.start(name=TEST_NODE, base_dir=base_dir)
    yield info
    # Stop only a node this session started, and only under CI: on a developer machine
    # another test run may be using the same node right now.
    if not was_running and os.environ.get("CI") and os.environ.get("AMQP_LOCKS_KEEP_BROKER") != "1":
        devbroker.stop(name=TEST_NODE, base_dir=base_dir)


@pytest.fixture(scope="session")
def amqp_url(node: devbroker.NodeInfo) -> str:
    return node.url


@pytest.fixture(params=[False, True], ids=["classic", "quorum"])
def quorum(request: pytest.FixtureRequest) -> bool:
    """Whether the lock under test uses quorum queues: a test asking for it runs twice."""
    return bool(request.param)


@pytest.fixture
def broker(amqp_url: str) -> Iterator[Broker]:
    b = Broker(amqp_url, heartbeat=10.0)
    yield b
    b.close()


def fence_messages(broker: Broker, name: str) -> int:
    """Messages in the lock's fence shard, exactly: declare-ok counts quorum messages
    (list_queues' stats lag by seconds)."""
    from amqp_locks.names import fence_shard

    async def count() -> int:
        session = await broker._core.session()
        ok = await session.call(None, lambda ch: ch.queue_declare(fence_shard(name), passive=True))
        return int(ok.message_count)

    return broker._core.run(count())


def drop_fence_shard(broker: Broker, name: str) -> None:
    """Delete the lock's fence shard if it exists (queue.delete is idempotent)."""
    from amqp_locks.names import fence_shard

    async def drop() -> None:
        session = await broker._core.session()
        await session.call(None, lambda ch: ch.queue_delete(fence_shard(name)))

    broker._core.run(drop())


@pytest.fixture
def name() -> str:
    """A lock name unique to the test, so tests never see each other's queues."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def proxy(node: devbroker.NodeInfo) -> Iterator[FaultProxy]:
    url = URL(node.url)
    p = FaultProxy(url.host or "127.0.0.1", url.port or 5672)
    yield p
    p.close()
