"""The mesh harness (amqp_locks_dev.mesh, issue 29 point 3) cuts exactly the links asked for.

Every node of a RabbitMQ 4.3.6 cluster runs in a network namespace of its own, one veth
link per pair of nodes; with ``net_ticktime = 10``:

- 3 nodes, link 1-2 cut: node 1 sees node 2 go down, still sees node 3 running, and node 3
  sees all three; after the heal all three run again as every node sees it;
- 5 nodes split {1, 4, 5} | {2, 3}: node 1 sees 2 and 3 down, node 4 still sees 5; after
  the heal all five run again;
- teardown leaves no namespace, link or route: after a test, after a start or a network
  set-up that failed half-way, and after a harness killed by SIGKILL (swept by the next
  one).

Run with ``-s`` to see the figures (start-up, cut to detection, heal to all running).
"""

from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import sys
import time

import pytest

from amqp_locks import Broker
from amqp_locks_dev import devbroker, localserver, mesh, partition

from .. import nodes
from .conftest import MakeMesh, only_on_43, wait_until

pytestmark = [
    only_on_43("the harness's figures are RabbitMQ 4.3.6's (Khepri)"),
]

NET_TICKTIME = 10
#: A client in a namespace: connects to the URL given (guest, over a non-loopback address)
#: and closes.
CLIENT = r"""
import asyncio, sys
import aiormq

async def main() -> None:
    await (await aiormq.connect(sys.argv[1])).close()

asyncio.run(main())
"""

#: How long after the heal every node must see every node running again.
HEAL_BOUND = 90.0


@pytest.fixture(autouse=True)
def all_nodes_up() -> None:
    """Not the shared test cluster: this module makes its own (one cluster at a time)."""


def _heal(mc: mesh.MeshCluster, which: str) -> None:
    """Heals every link; prints how long the links and then every node took to be back."""
    healed_at = time.monotonic()
    mc.heal()
    links_at = time.monotonic()
    wait_until(lambda: _all_running(mc), HEAL_BOUND, f"{which} running after the heal")
    done = time.monotonic()
    print(f"heal: links up in {links_at - healed_at:.2f} s, all running {done - healed_at:.2f} s")


def _names(mc: mesh.MeshCluster, *indexes: int) -> set[str]:
    return {mc.node(i).node for i in indexes}


def _all_running(mc: mesh.MeshCluster) -> bool:
    everyone = _names(mc, *range(1, mc.size + 1))
    return all(set(mc.running_nodes(i)) == everyone for i in range(1, mc.size + 1))


def _gone(net: mesh.MeshNetwork) -> None:
    assert mesh.mesh_leftovers(net) == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in net.namespaces)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"alp{net.id}" not in links
    assert not (partition.STATE_DIR / f"mesh-{net.id}.json").exists()


@pytest.mark.timeout(600)
def test_a_cut_link_parts_only_its_two_nodes(make_mesh: MakeMesh) -> None:
    mc = make_mesh(version="4.3", size=3, net_ticktime=NET_TICKTIME)
    print(f"\nmesh: 3-node {mc.version} cluster up in {mc.started_in:.1f} s")
    assert _all_running(mc)
    # Clients: on the host (any node, over its host link), beside node 1 (node 1).
    broker = Broker(mc.urls, connect_timeout=10)
    broker.connect()
    broker.close()
    beside = mc.run_in_namespace(1, [sys.executable, "-c", CLIENT, mc.node_url(1)])
    assert beside.wait(timeout=60) == 0

    mc.watch_node_down(1, 2)  # before the cut: a CLI booted after it reads late under load
    cut_at = time.time()
    mc.cut_link(1, 2)
    detected = mc.wait_node_down(1, 2, timeout=60) - cut_at
    print(f"cut 1-2 -> node 1 sees node 2 down: {detected:.2f} s")
    assert detected <= 1.25 * NET_TICKTIME + 5
    assert _names(mc, 1, 3) <= set(mc.running_nodes(1))
    assert mc.node(2).node not in mc.running_nodes(1)
    assert set(mc.running_nodes(3)) == _names(mc, 1, 2, 3)

    _heal(mc, "all three")

    mc.kill(3)
    mc.wait_node_down(1, 3, timeout=30)
    restarted_at = time.monotonic()
    assert mc.start_node(3).netns == mc.net.ns(3)
    wait_until(lambda: _all_running(mc), HEAL_BOUND, "all three running after node 3's restart")
    print(f"kill 3, start 3 -> all running: {time.monotonic() - restarted_at:.2f} s")

    net = mc.net
    mc.teardown()
    _gone(net)


@pytest.mark.timeout(900)
def test_a_split_of_five_parts_the_groups(make_mesh: MakeMesh) -> None:
    mc = make_mesh(version="4.3", size=5, net_ticktime=NET_TICKTIME)
    print(f"\nmesh: 5-node {mc.version} cluster up in {mc.started_in:.1f} s")
    assert _all_running(mc)

    for i in (2, 3):
        mc.watch_node_down(1, i)
    cut_at = time.time()
    mc.split([1, 4, 5], [2, 3])
    assert mc.cut_links == {(1, 2), (1, 3), (2, 4), (2, 5), (3, 4), (3, 5)}
    seen = [mc.wait_node_down(1, i, timeout=60) - cut_at for i in (2, 3)]
    print(f"split -> node 1 sees nodes 2, 3 down: {seen[0]:.2f} s, {seen[1]:.2f} s")
    running = set(mc.running_nodes(4))
    assert _names(mc, 1, 4, 5) <= running and not running & _names(mc, 2, 3)
    # No other path: from node 1's namespace TCP gets to 4 and 5 only; the host, over its
    # own links, to every node.
    net, port = mc.net, mc.epmd_port
    targets = [(net.address(i), port) for i in range(2, 6)]
    unreachable = mesh._unreachable(net.ns(1), targets)
    assert unreachable == [f"{net.address(i)}:{port}" for i in (2, 3)]
    assert all(partition._listening(net.address(i), port) for i in range(1, 6))

    _heal(mc, "all five")

    net = mc.net
    mc.teardown()
    _gone(net)


@pytest.mark.timeout(300)
def test_a_start_that_fails_half_way_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The joins fail with every node booted: nodes, epmds and network must all go."""
    made: list[mesh.MeshNetwork] = []
    pids: list[int] = []
    create = mesh._create_network

    def creating(size: int) -> mesh.MeshNetwork:
        made.append(create(size))
        return made[-1]

    def failing_join(seed: devbroker.NodeInfo, others: list[devbroker.NodeInfo]) -> None:
        pids.extend(int(n.pid_file.read_text().split()[0]) for n in (seed, *others))
        raise devbroker.DevBrokerError("injected")

    monkeypatch.setattr(mesh, "_create_network", creating)
    monkeypatch.setattr(mesh, "_join_all", failing_join)
    home = nodes.test_home()
    base = home / "mesh" if home else None
    failing = pytest.raises(devbroker.DevBrokerError, match="injected")
    with failing, mesh.mesh_cluster("4.3", 3, base_dir=base):
        pass
    assert made and len(pids) == 3
    assert not any(localserver.pid_alive(pid) for pid in pids)
    _gone(made[0])


@pytest.mark.timeout(60)
def test_a_network_that_fails_half_way_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, ...]] = []
    made: list[mesh.MeshNetwork] = []
    ns_ip, delete = mesh._ns_ip, mesh._delete_network

    def failing(ns: str, *args: str) -> str:
        calls.append(args)
        if len(calls) == 20:  # in the second namespace's setup, links made already
            raise partition.PartitionError("injected")
        return ns_ip(ns, *args)

    def deleting(net: mesh.MeshNetwork) -> list[str]:
        made.append(net)
        return delete(net)

    monkeypatch.setattr(mesh, "_ns_ip", failing)
    monkeypatch.setattr(mesh, "_delete_network", deleting)
    with pytest.raises(partition.PartitionError, match="injected"):
        mesh._create_network(3)
    assert made
    _gone(made[0])


#: A harness killed before its teardown: makes a mesh's network and epmds, then waits.
CRASHING = r"""
import subprocess, sys, time
from amqp_locks_dev import mesh
net = mesh._create_network(3)
epmds = [subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"]) for ns in net.namespaces]
mesh._update_record(net, epmds=[p.pid for p in epmds])
print(net.id, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_killed_harness_is_swept_by_the_next() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CRASHING], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    net_id = proc.stdout.readline().strip()
    record = partition.STATE_DIR / f"mesh-{net_id}.json"
    raw = json.loads(record.read_text())
    net = mesh.MeshNetwork(net_id, ipaddress.IPv4Network(raw["block"]), 3)
    assert mesh.mesh_leftovers(net)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert set(net.namespaces) <= set(mesh.sweep_stale())
    _gone(net)
