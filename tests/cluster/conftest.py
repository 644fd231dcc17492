"""A private 3-node RabbitMQ cluster (`amqplocksc1..3`), started once per test session.

Never the shared single test node: these tests kill nodes. Before each test every node
runs again (a failed test may have left one down).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from amqp_locks import Broker, TokenSemaphore
from amqp_locks_dev import devbroker, devcluster, mesh, partition

from .. import waiting
from ..nodes import node_name, test_home

CLUSTER = node_name("amqplocksc") + ("-" if test_home() else "")


def _base_dir() -> Path | None:
    home = test_home()
    return home / CLUSTER if home else None


@pytest.fixture(scope="session")
def cluster() -> Iterator[devcluster.ClusterInfo]:
    base = _base_dir()
    was_running = any(devcluster.status(CLUSTER, base).values())
    if not was_running:
        # A session that starts the cluster starts it empty, as the single node's fixture
        # does (tests/conftest.py): its data outlives runs, and the quorum queues earlier
        # runs left (1,240 Raft members per node on the 4.3.6 cluster of one CI lane after
        # a day of runs, each recovered at boot and ticking on every node) slowed every lane
        # of the 2-core machine run after run (rehearsal 18: 4.3.6 files 2,162 s, was
        # 1,499-1,614 s).
        devcluster.reset(CLUSTER, base)
    info = devcluster.start(CLUSTER, 3, base)
    yield info
    if was_running or os.environ.get("AMQP_LOCKS_KEEP_BROKER") == "1":
        if not any(devcluster.status(CLUSTER, base).values()):  # a harness test stopped it
            devcluster.start(CLUSTER, 3, base)
    else:
        devcluster.stop(CLUSTER, base)


def _uses_harness(fixturenames: Iterable[str]) -> bool:
    """Whether a test starts a harness cluster (and so stops the shared one meanwhile)."""
    return bool({"make_partition", "make_mesh"} & set(fixturenames))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start a harness cluster run last (stable order otherwise): each stops
    the shared cluster, and starting it again between them cost up to 150 s a time on a
    loaded machine, inside the next test's timeout (rehearsal 90: a 3-node 4.3.6 restart
    in a harness test's teardown ran past its 240 s)."""
    items.sort(key=lambda item: _uses_harness(getattr(item, "fixturenames", ())))


@pytest.fixture(autouse=True)
def all_nodes_up(request: pytest.FixtureRequest, cluster: devcluster.ClusterInfo) -> None:
    """Every node of the shared cluster runs, and every node counts all as running, before
    a test that uses it: a failed test may have left one down, a harness test before it
    stopped them all (started again together: a node alone may wait for the others at
    boot), a test froze some (devcluster.running_everywhere says what a queue declared
    before every node counts every other costs)."""
    if _uses_harness(request.fixturenames):
        return
    up = devcluster.status(CLUSTER, _base_dir())
    if not any(up.values()):
        devcluster.start(CLUSTER, 3, _base_dir())
        return
    restarted = False
    for index, (_node, running) in enumerate(up.items(), 1):
        if not running:
            devcluster.start_node(CLUSTER, index, _base_dir())  # waits for every view
            restarted = True
    if not restarted:  # a node a test before froze may still be counted down
        devcluster.await_whole(devcluster.info(CLUSTER, _base_dir()))


#: Where each node's log stood when a test began: a failed test's report shows what the
#: nodes logged meanwhile (their warnings and errors: the nodes log at ``warning``).
LOG_MARKS = pytest.StashKey[dict[Path, int]]()
#: The most lines of one node's log a failed test's report shows (the newest).
LOG_LINES = 150


@pytest.fixture(autouse=True)
def broker_logs(request: pytest.FixtureRequest, cluster: devcluster.ClusterInfo) -> None:
    """Marks where each node's log stands (see :func:`pytest_runtest_makereport`): a broker
    crash behind a failure seen once in CI (a channel crash closing a holder's connection
    with 541) is then in the report, not in a log the run's cleanup deleted."""
    if _uses_harness(request.fixturenames):
        return
    request.node.stash[LOG_MARKS] = {
        n.log_file: n.log_file.stat().st_size if n.log_file.exists() else 0 for n in cluster.nodes
    }


def _new_log_lines(marks: dict[Path, int]) -> str:
    parts = []
    for path, start in marks.items():
        with contextlib.suppress(OSError), path.open("rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
            if lines:
                shown = "" if len(lines) <= LOG_LINES else f", the last {LOG_LINES} shown"
                parts.append(f"== {path.name}: {len(lines)} new lines{shown}")
                parts.extend(lines[-LOG_LINES:])
    return "\n".join(parts) or "(the nodes logged nothing at warning or above)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    marks = item.stash.get(LOG_MARKS, None)
    if marks is not None and report.when == "call" and report.failed:
        report.sections.append(("broker logs during the test", _new_log_lines(marks)))
    return report


@pytest.fixture(autouse=True)
def guard_debug(caplog: pytest.LogCaptureFixture) -> None:
    """A failed cluster test shows the quorum guard's DEBUG lines (a lock check channel
    closed or stalled, the probe link reopened): a false loss seen once in CI must be
    explainable from its report."""
    caplog.set_level(logging.DEBUG, logger="amqp_locks.cluster")


def only_on_43(what: str) -> pytest.MarkDecorator:
    """Skips a module of the network-namespace harnesses unless the tests run RabbitMQ 4.3
    (the figures they assert are 4.3.6's, a Khepri cluster)."""
    return pytest.mark.skipif(
        devbroker.default_version() != "4.3", reason=f"{what}: AMQP_LOCKS_RABBITMQ=4.3 (4.3.6)"
    )


class Nodes:
    """Kill/restart nodes of the test cluster; brokers that prefer a given node."""

    def __init__(self, info: devcluster.ClusterInfo) -> None:
        self.info = info
        self._brokers: list[Broker] = []

    def urls_from(self, index: int) -> list[str]:
        """Every node's URL, node `index` first (the Broker connects there first)."""
        urls = self.info.urls
        return urls[index - 1 :] + urls[: index - 1]

    def broker(
        self, index: int, heartbeat: float = 5.0, quorum_timeout: float | None = None
    ) -> Broker:
        b = Broker(
            self.urls_from(index),
            heartbeat=heartbeat,
            connect_timeout=5.0,
            quorum_timeout=quorum_timeout,
        )
        b.connect()
        assert b.url.endswith(f":{self.info.node(index).amqp_port}/%2F"), b.url
        self._brokers.append(b)
        return b

    @staticmethod
    def waiting(broker: Broker, tokens: str | None = None) -> bool:
        """Whether an acquire through `broker` is subscribed to its lock's wake-ups, or
        (`tokens` given: the token semaphore that carries a cluster-mode mutex or
        semaphore) whether a consumer waits for a token."""
        if tokens is not None:
            return TokenSemaphore(broker, tokens).status().waiting >= 1
        session = broker.core._session
        return session is not None and any(w.ready for w in list(session.waiters))

    def kill(self, index: int) -> None:
        assert devcluster.kill_node(CLUSTER, index, _base_dir())

    def restart(self, index: int) -> None:
        devcluster.start_node(CLUSTER, index, _base_dir())

    def report(self, name: str, index: int) -> str:
        """What node `index` says of the queues of lock `name` and their consumers: a
        failed liveness assertion shows whether a token was ready, held or gone, and who
        consumed (never raises: it only adds to a failure's message)."""
        lines = []
        for args in (
            ("list_queues", "-q", "name", "type", "leader", "online", "messages_ready",
             "messages_unacknowledged", "consumers"),
            ("list_consumers", "-q"),
        ):  # fmt: skip
            try:
                out = devbroker.rabbitmqctl(self.info.node(index), *args, timeout=20)
            except Exception as exc:  # a report, not a check
                out = f"{args[0]} failed: {exc!r}"
            lines += [line for line in out.splitlines() if name in line or "failed" in line]
        return "\n".join(lines)

    def members(self, queue: str, index: int = 1) -> tuple[set[int], set[int]]:
        """(the nodes holding a replica of quorum `queue`, those of them online), as node
        `index` sees them."""
        replicas = self.replicas(queue, index)
        if queue not in replicas:
            raise AssertionError(f"queue {queue!r} not found")
        return replicas[queue]

    def replicas(self, part: str, index: int = 1) -> dict[str, tuple[set[int], set[int]]]:
        """(members, online members) by node index of every quorum queue whose name
        contains `part`, as node `index` sees them."""
        out = devbroker.rabbitmqctl(
            self.info.node(index),
            "list_queues",
            "-q",
            "name",
            "type",
            "members",
            "online",
            "--formatter",
            "json",
        )
        size = len(self.info.urls)

        def indices(nodes: list[object]) -> set[int]:
            names = {str(n) for n in nodes}
            return {i for i in range(1, size + 1) if self.info.node(i).node in names}

        return {
            row["name"]: (indices(row["members"]), indices(row["online"]))
            for row in json.loads(out)
            if part in row["name"] and row["type"] == "quorum"
        }

    def pid(self, index: int) -> int:
        """The operating-system process id of node `index` (its Erlang VM)."""
        return int(self.info.node(index).pid_file.read_text().split()[0])

    def port(self, index: int) -> int:
        return self.info.node(index).amqp_port

    def close(self) -> None:
        for b in self._brokers:
            b.close()


@pytest.fixture
def nodes(cluster: devcluster.ClusterInfo) -> Iterator[Nodes]:
    n = Nodes(cluster)
    yield n
    n.close()


@pytest.fixture
def frozen(nodes: Nodes) -> Iterator[list[int]]:
    """Nodes frozen by the test (SIGSTOP; it appends their index), thawed (SIGCONT)
    afterwards even if the test fails."""
    stopped: list[int] = []
    yield stopped
    for index in stopped:
        os.kill(nodes.pid(index), signal.SIGCONT)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `cond` until true or fail naming `what` (a condition, not a fixed sleep)."""
    waiting.wait_until(cond, timeout, what, step=0.05)


#: Makes a partition harness: ``make_partition(net_ticktime=10)``; see the fixture.
MakePartition = Callable[..., partition.PartitionCluster]


@pytest.fixture
def make_partition() -> Iterator[MakePartition]:
    """Start a :class:`~amqp_locks_dev.partition.PartitionCluster` (node 1 in a network
    namespace of its own, the link cut by the test) on the line under test; every harness
    it made is torn down after the test, whatever happened (namespace, veth pair, nodes).

    One cluster at a time on this machine: the shared test cluster is stopped while a
    harness runs (see :func:`_harnesses`)."""
    yield from _harnesses(partition.partition_cluster, "partition")


#: A harness type (PartitionCluster, MeshCluster).
H = TypeVar("H")


def _harnesses(
    start: Callable[..., contextlib.AbstractContextManager[H]], folder: str
) -> Iterator[Callable[..., H]]:
    """The body of the harness fixtures: `start(**kwargs)` context managers under the test
    home's `folder`, all closed after the test; the shared test cluster stopped first (one
    cluster at a time on this machine) and started again only by the next test that uses
    it (:func:`all_nodes_up`; harness tests run last) or at the session's end if it ran
    before the session or is to be kept (``AMQP_LOCKS_KEEP_BROKER=1``)."""
    base = _base_dir()
    if any(devcluster.status(CLUSTER, base).values()):
        devcluster.stop(CLUSTER, base)
    home = test_home()
    stack = contextlib.ExitStack()

    def make(**kwargs: object) -> H:
        kwargs.setdefault("base_dir", home / folder if home else None)
        return stack.enter_context(start(**kwargs))

    with stack:
        yield make


#: Makes a mesh harness: ``make_mesh(size=5, net_ticktime=10)``; see the fixture.
MakeMesh = Callable[..., mesh.MeshCluster]


@pytest.fixture
def make_mesh() -> Iterator[MakeMesh]:
    """Start a :class:`~amqp_locks_dev.mesh.MeshCluster` (every node in a network namespace
    of its own, one link per pair of nodes) on the line under test; every mesh it made is
    torn down after the test, whatever happened. The shared test cluster is stopped
    meanwhile, as for :func:`make_partition`."""
    yield from _harnesses(mesh.mesh_cluster, "mesh")
