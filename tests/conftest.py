"""Test fixtures: a real private RabbitMQ node (started once per session), brokers, names."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from yarl import URL

from amqp_locks import Broker, devbroker

from .faultproxy import FaultProxy

# AMQP_LOCKS_TEST_NODE: another node name, for test runs side by side on one host (Erlang
# node names are host-wide, whatever the home directory).
TEST_NODE = os.environ.get("AMQP_LOCKS_TEST_NODE") or "amqplockstest"


@pytest.fixture(scope="session")
def node() -> Iterator[devbroker.NodeInfo]:
    """The private broker node every integration test uses (started by the tests)."""
    base = os.environ.get("AMQP_LOCKS_TEST_HOME")
    base_dir = Path(base) / devbroker.default_version() / TEST_NODE if base else None
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


@pytest.fixture
def broker(amqp_url: str) -> Iterator[Broker]:
    b = Broker(amqp_url, heartbeat=10.0)
    yield b
    b.close()


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
