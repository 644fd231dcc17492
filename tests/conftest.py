"""Test fixtures: a real private RabbitMQ node (started once per session), brokers, names."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
from yarl import URL

from amqp_locks import Broker
from amqp_locks.transport.session import Session
from amqp_locks_dev import devbroker

from .faultproxy import FaultProxy
from .nodes import node_name, test_home

# A test's timeout does not count the start-up of the servers it shares (its hooks).
from .timeouts import (  # noqa: F401
    pytest_fixture_setup,
    pytest_runtest_protocol,
    pytest_timeout_set_timer,
)

TEST_NODE = node_name("amqplockstest")
T = TypeVar("T")


@pytest.fixture(scope="session")
def node() -> Iterator[devbroker.NodeInfo]:
    """The private broker node every integration test uses (started by the tests)."""
    home = test_home()
    base_dir = home / TEST_NODE if home else None
    was_running = devbroker.status(name=TEST_NODE, base_dir=base_dir) is not None
    if not was_running:
        # A session that starts the node starts it empty, as on a new machine: its data
        # directory outlives runs (the test home is under ~/.cache), and what earlier runs
        # left (thousands of fence generations, quorum queues to recover at boot) made a
        # test that scans a shard's generations outlast its timeout (CI rehearsal,
        # 2026-11-29: generation 31,200 of one shard on a 3.10.8 node made at 04:14).
        shutil.rmtree(devbroker.node_dir(TEST_NODE, base_dir) / "mnesia", ignore_errors=True)
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


def on_session(broker: Broker, step: Callable[[Session], Awaitable[T]]) -> T:
    """`step` given the Broker's current session, run on its I/O thread: a test reads or
    changes the broker as the library's own calls do."""

    async def go() -> T:
        return await step(await broker.core.session())

    return broker.core.run(go())


def settle(broker: Broker) -> None:
    """Wait for everything the releases left running in the background (the token's
    commit, the wake-up notice, channels going back to the pool), not for the tasks that
    wait on purpose (`Session.deferred`: a fence generation's retirement, RETIRE_AFTER =
    10 s after a take renewed its shard, which happens now and then in a long suite)."""

    async def done() -> None:
        session = await broker.core.session()
        while tasks := session._tasks - session.deferred:
            await asyncio.gather(*tasks, return_exceptions=True)

    broker.core.run(done())


def queue_exists(broker: Broker, queue: str) -> bool:
    """Whether `queue` exists, by a passive declare: one round trip, where listing the
    node's queues (rabbitmqctl) starts an Erlang VM each time, seconds on a loaded machine."""
    return on_session(broker, lambda session: session.exists_passive(queue))


def queue_counts(broker: Broker, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of `queue`, exactly (declare-ok counts quorum messages)."""
    return on_session(broker, lambda session: session.declare_passive_counts(queue))


@pytest.fixture
def quick_heal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shorter heal registration delay and jitter (tokens/heal.py, read at each use): every
    heal still waits its whole period (lock delay + HEAL_MARGIN); test_heal's
    test_a_mutex_whose_creator_died_before_its_token_grants_again asserts that."""
    from amqp_locks.tokens import heal

    monkeypatch.setattr(heal, "REGISTER_AFTER", 0.3)
    monkeypatch.setattr(heal, "HEAL_JITTER", 0.5)


def heal_bound(lock_delay: float) -> float:
    """What replacing a first-use queue left short of tokens may take with `lock_delay`,
    from its first waiter's arrival (tokens/heal.py's bound): its wait for the queue to
    run (fresh.RUNNING_WAIT), registration, the period and its jitter, and two sample
    intervals (the period's end falls between two samples). Read at each use (quick_heal
    shortens REGISTER_AFTER and HEAL_JITTER)."""
    from amqp_locks.tokens import fresh, heal

    return (
        fresh.RUNNING_WAIT
        + heal.REGISTER_AFTER
        + lock_delay
        + heal.HEAL_MARGIN
        + heal.HEAL_JITTER
        + 2 * heal.SAMPLE_EVERY
    )


def fence_counter(broker: Broker, name: str) -> str:
    """The generation queue lock `name` counts on now (fencing.py; made if never made)."""
    from amqp_locks.fencing import current_queue

    return on_session(broker, lambda session: current_queue(session, name))


def fence_messages(broker: Broker, name: str) -> int:
    """Counter messages in the lock's current fence generation: every message taken on one
    channel, then returned by closing it. (Declare-ok also counts existence probes that
    landed behind the counter message and expire when they reach the head.)"""
    queue = fence_counter(broker, name)

    async def count(session: Session) -> int:
        ch = await session.open_channel()
        got = 0
        try:
            while True:
                m = await ch.basic_get(queue, no_ack=False)
                if m.delivery is None or type(m.delivery).__name__ != "GetOk":
                    return got
                got += 1 if m.body else 0
        finally:
            await ch.close()

    return on_session(broker, count)


def fence_shard_listed(node: devbroker.NodeInfo, k: int) -> list[str]:
    """Every queue of fence shard `k` the node lists: the pre-generation shard queue, the
    marker, generations and tombstones. Listed, not a range of numbers: a shard rebuilt far
    up (test_transport's repair_fence: generation 65,537) would make a range from 0 131,000
    names."""
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "--no-table-headers", "--quiet")
    mine = re.compile(
        rf"^(amqp-locks-shard-{k:02d}-fence|amqp-locks-fence-{k:02d}(-g\d+(-done)?)?)$"
    )
    return [q.strip() for q in out.splitlines() if mine.match(q.strip())]


def drop_fence_shard(node: devbroker.NodeInfo, broker: Broker, name: str) -> None:
    """Put the lock's fence shard back to "never made": every queue of it the node lists
    deleted (:func:`fence_shard_listed`). All of them: under load retires lag, and a
    generation left below a window read as a superseded top to the run made again from 0
    (rehearsal 43: CounterGone, "g1 superseded, none above it", in every later test on
    that shard)."""
    from amqp_locks.names import fence_shard_index

    k = fence_shard_index(name)
    listed = fence_shard_listed(node, k)

    async def drop(session: Session) -> None:
        session.fence_gens.pop(k, None)
        for q in listed:
            await session.call(None, lambda ch, q=q: ch.queue_delete(q))

    on_session(broker, drop)


@pytest.fixture
def name() -> str:
    """A lock name unique to the test, so tests never see each other's queues."""
    return f"t{uuid.uuid4().hex[:12]}"


def _node_proxy(node: devbroker.NodeInfo, amqp: bool) -> Iterator[FaultProxy]:
    url = URL(node.url)
    with FaultProxy(url.host or "127.0.0.1", url.port or 5672, amqp=amqp) as p:
        yield p


@pytest.fixture
def proxy(node: devbroker.NodeInfo) -> Iterator[FaultProxy]:
    """A fault proxy in front of the test node (byte-level faults)."""
    yield from _node_proxy(node, amqp=False)


@pytest.fixture
def amqp_proxy(node: devbroker.NodeInfo) -> Iterator[FaultProxy]:
    """A fault proxy in front of the test node that reads AMQP frames (mute, cut_after)."""
    yield from _node_proxy(node, amqp=True)
