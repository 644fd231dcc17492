"""A RabbitMQ cluster of 3 or 5 nodes, each in its own network namespace, one link per pair.

Issue 29 (point 3): partitions other than "node 1 alone". :func:`mesh_cluster` puts node
``i`` in a namespace ``alp-<id>-<i>`` and joins every pair of namespaces by a veth pair of
their own, so a test can cut exactly the links it wants: one (:meth:`MeshCluster.cut_link`,
a partial partition: 1 and 2 lose each other, both still see 3) or every link across
groups (:meth:`MeshCluster.split`). A cut takes both ends of the link down: the routes
over it go, and each side's packets to the other fall to its namespace's *sink* (an
interface with no carrier and no ARP, whose packets the kernel drops): nothing reaches
the other side, nothing is reset, a new connection hangs as across a real partition
(a blackhole route would fail it at once with EINVAL). :meth:`MeshCluster.heal` brings
every link up again.

Addresses (one /24 per mesh out of ``10.231.128.0/17``, checked against the host's
addresses and routes like :mod:`~amqp_locks_dev.partition`'s /30s; the host blackholes the
whole /24 at a low priority, so partition harnesses see it as taken):

- node ``i``: ``.240+i`` (a /32 on the namespace's loopback), the host part of its Erlang
  long name (``m<id><i>@10.231.x.24i``); AMQP and distribution listen on it and on
  127.0.0.1;
- link ``(i, j)``: the /30 ``.64+4k`` (``k`` counting pairs in order), ``.+1`` at i's end;
  inside namespace ``i`` node ``j``'s address routes over that link only (source: node
  ``i``'s address), with the whole /24 routed into the sink behind it (at a worse metric),
  so a cut link never falls back on another path;
- host link ``i``: the /30 ``.4i``, host end ``.4i+1``. The host (the test process,
  its clients) reaches node ``i`` over it; it is never cut. It never carries node-to-node
  traffic: no namespace routes anything but the host end's own /30 into it, the namespaces
  forward nothing (``net.ipv4.ip_forward = 0`` in each) and the host's ends have
  forwarding off, whatever the host's ``ip_forward``.

Each namespace runs an epmd of the cluster's own port (loopback + the node's address);
``rabbitmqctl`` for node ``i`` runs in namespace ``i`` and needs nothing on the host.

Teardown (the context manager's ``finally``, and ``atexit``) kills clients, nodes and
epmds, deletes the host links, the host's blackhole and the namespaces (with the links
inside them) and checks nothing is left. What a mesh makes is recorded under
``/run/amqp-locks-partitions`` (``mesh-<id>.json``) before it is made; a harness whose
process died is swept by the next harness of either kind (:func:`sweep_stale`).
Needs root.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import devbroker, devcluster
from .devbroker import NODES, DevBrokerError, NodeInfo
from .localserver import HOST, STARTED, home, locked, note, signal_and_wait
from .partition import (
    _BLACKHOLE_METRIC,
    PREFIX,
    STATE_DIR,
    ClusterNodes,
    PartitionError,
    _epmd_argv,
    _host_networks,
    _listening,
    _run,
    _spawn_epmd,
    sweep_dead,
    sweep_stale_partitions,
)

__all__ = [
    "MeshCluster",
    "MeshNetwork",
    "mesh_cluster",
    "mesh_leftovers",
    "sweep_stale",
    "sweep_stale_meshes",
]

#: Where meshes' /24s come from (the upper half of partition.SUBNETS: partition harnesses
#: take their /30s from the lower end).
BLOCKS = ipaddress.IPv4Network("10.231.128.0/17")
SIZES = (3, 5)
#: Each namespace forwards nothing, and uses its sink's route though the sink has no
#: carrier (set, not inherited from the host's settings).
_NS_SYSCTLS = (
    "net.ipv4.ip_forward=0",
    "net.ipv4.conf.all.ignore_routes_with_linkdown=0",
    "net.ipv4.conf.default.ignore_routes_with_linkdown=0",
)
_NODE_OFFSET = 240
_LINK_OFFSET = 64


@dataclass(frozen=True)
class MeshNetwork:
    """The names and addresses of one mesh: namespaces, host links, pair links."""

    id: str
    block: ipaddress.IPv4Network
    size: int

    def ns(self, i: int) -> str:
        return f"{PREFIX}{self.id}-{i}"

    @property
    def namespaces(self) -> list[str]:
        return [self.ns(i) for i in self.indexes]

    @property
    def indexes(self) -> range:
        return range(1, self.size + 1)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(itertools.combinations(self.indexes, 2))

    def _at(self, offset: int) -> str:
        return str(self.block.network_address + offset)

    def address(self, i: int) -> str:
        """Node `i`'s own address (its Erlang name's host part, its AMQP URL's)."""
        return self._at(_NODE_OFFSET + i)

    @property
    def sink_veth(self) -> str:
        """The sink in each namespace (its peer: ``+ "x"``)."""
        return f"alp{self.id}s"

    # host link i: a /30 at 4i; interface names have at most 15 characters (12 here)
    def host_veth(self, i: int) -> str:
        return f"alp{self.id}h{i}"

    def host_ns_veth(self, i: int) -> str:
        return f"alp{self.id}n{i}"

    def host_end(self, i: int) -> str:
        return self._at(4 * i + 1)

    def host_ns_end(self, i: int) -> str:
        return self._at(4 * i + 2)

    # pair link (i, j): a /30 at 64 + 4k; the end in namespace i is "l<i><j>"
    def link_veth(self, i: int, j: int) -> str:
        return f"alp{self.id}l{i}{j}"

    def link_end(self, i: int, j: int) -> str:
        """The address of link (i, j)'s end in namespace `i`."""
        k = self.pairs.index((min(i, j), max(i, j)))
        return self._at(_LINK_OFFSET + 4 * k + (1 if i < j else 2))

    def record(self) -> dict[str, Any]:
        return {
            "kind": "mesh",
            "id": self.id,
            "block": str(self.block),
            "size": self.size,
            "owner": os.getpid(),
        }


def _record_path(net: MeshNetwork) -> Path:
    return STATE_DIR / f"mesh-{net.id}.json"


def _update_record(net: MeshNetwork, **fields: Any) -> None:
    path = _record_path(net)
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw) + "\n")


def _pick_block() -> ipaddress.IPv4Network:
    used = [u for u in _host_networks() if u.prefixlen > 0]
    for path in STATE_DIR.glob("mesh-*.json"):  # a mesh half-made: no blackhole yet
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            used.append(ipaddress.IPv4Network(json.loads(path.read_text())["block"]))
    for block in BLOCKS.subnets(new_prefix=24):
        if not any(block.overlaps(u) for u in used):
            return block
    raise PartitionError(f"no free /24 left in {BLOCKS}")


def _ip(*args: str, check: bool = True) -> str:
    return _run(["ip", *args], check=check)


def _ns_ip(ns: str, *args: str) -> str:
    return _run(["ip", "-n", ns, *args])


def _route_args(net: MeshNetwork, i: int, j: int) -> list[str]:
    """Namespace `i`'s route to node `j`: over link (i, j), from node i's address."""
    return [
        f"{net.address(j)}/32",
        "via",
        net.link_end(j, i),
        "dev",
        net.link_veth(i, j),
        "src",
        net.address(i),
    ]


def _create_network(size: int) -> MeshNetwork:
    """Make the namespaces, links, addresses and routes (recorded before any is made)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with locked(STATE_DIR):  # the same lock as partition's: no two harnesses pick alike
        sweep_stale()
        net = MeshNetwork(secrets.token_hex(3), _pick_block(), size)
        _record_path(net).write_text(json.dumps(net.record()) + "\n")
        try:
            # The host's blackhole first: the block counts as taken from here on.
            _ip("route", "add", "blackhole", str(net.block), "metric", str(_BLACKHOLE_METRIC))
            for i in net.indexes:
                ns = net.ns(i)
                note({"netns": ns, "how": STARTED}, "netns")  # the run's stop removes it
                _ip("netns", "add", ns)
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw", *_NS_SYSCTLS])
                _ns_ip(ns, "link", "set", "lo", "up")
                _ns_ip(ns, "addr", "add", f"{net.address(i)}/32", "dev", "lo")
                # The sink: one end up without ARP, its peer down (so no carrier).
                sink = net.sink_veth
                _ns_ip(ns, "link", "add", sink, "type", "veth", "peer", "name", sink + "x")
                _ns_ip(ns, "link", "set", sink, "arp", "off", "up")
                _ns_ip(
                    ns,
                    "route",
                    "add",
                    str(net.block),
                    "dev",
                    sink,
                    "src",
                    net.address(i),
                    "metric",
                    str(_BLACKHOLE_METRIC),
                )
                # host link i
                host, inner = net.host_veth(i), net.host_ns_veth(i)
                _ip("link", "add", host, "type", "veth", "peer", "name", inner, "netns", ns)
                Path(f"/proc/sys/net/ipv4/conf/{host}/forwarding").write_text("0\n")
                _ip("addr", "add", f"{net.host_end(i)}/30", "dev", host)
                _ip("link", "set", host, "up")
                _ns_ip(ns, "addr", "add", f"{net.host_ns_end(i)}/30", "dev", inner)
                _ns_ip(ns, "link", "set", inner, "up")
                _ip(
                    "route",
                    "add",
                    f"{net.address(i)}/32",
                    "via",
                    net.host_ns_end(i),
                    "dev",
                    host,
                    "src",
                    net.host_end(i),
                )
            for i, j in net.pairs:
                _ns_ip(
                    net.ns(i),
                    "link",
                    "add",
                    net.link_veth(i, j),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    net.link_veth(j, i),
                    "netns",
                    net.ns(j),
                )
                for a, b in ((i, j), (j, i)):
                    _ns_ip(
                        net.ns(a),
                        "addr",
                        "add",
                        f"{net.link_end(a, b)}/30",
                        "dev",
                        net.link_veth(a, b),
                    )
            for i, j in net.pairs:
                _link_up(net, i, j)
        except BaseException:
            _delete_network(net)
            raise
    return net


def _link_up(net: MeshNetwork, i: int, j: int) -> None:
    """Both ends of link (i, j) up and each side's route to the other over it (a link
    set down loses its routes)."""
    for a, b in ((i, j), (j, i)):
        _ns_ip(net.ns(a), "link", "set", net.link_veth(a, b), "up")
    for a, b in ((i, j), (j, i)):
        _ns_ip(net.ns(a), "route", "replace", *_route_args(net, a, b))


def _link_down(net: MeshNetwork, i: int, j: int) -> None:
    for a, b in ((i, j), (j, i)):
        _ns_ip(net.ns(a), "link", "set", net.link_veth(a, b), "down")


#: Run in a namespace: connect to each HOST:PORT argument; print those that fail.
_PROBE = (
    "import socket, sys\n"
    "for t in sys.argv[1:]:\n"
    "    h, p = t.rsplit(':', 1)\n"
    "    try:\n"
    "        socket.create_connection((h, int(p)), timeout=1).close()\n"
    "    except OSError:\n"
    "        print(t)\n"
)


def _unreachable(ns: str, targets: Sequence[tuple[str, int]]) -> list[str]:
    """Which of `targets` a TCP connect from namespace `ns` does not reach."""
    argv = ["ip", "netns", "exec", ns, sys.executable, "-c", _PROBE]
    argv += [f"{h}:{p}" for h, p in targets]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    if proc.returncode != 0:
        return [f"probe in {ns} failed: {proc.stderr.strip()}"]
    return proc.stdout.split()


def _delete_network(net: MeshNetwork) -> list[str]:
    """Remove whatever exists of `net`, processes in its namespaces first; the errors."""
    errors: list[str] = []
    for ns in net.namespaces:
        pids = _run(["ip", "netns", "pids", ns], check=False).split()
        for pid in (int(p) for p in pids if p.isdigit()):
            signal_and_wait(pid, signal.SIGKILL, 5.0)
    argvs = [["ip", "link", "del", net.host_veth(i)] for i in net.indexes]
    argvs.append(
        ["ip", "route", "del", "blackhole", str(net.block), "metric", str(_BLACKHOLE_METRIC)]
    )
    argvs += [["ip", "netns", "del", ns] for ns in net.namespaces]  # pair links with them
    for argv in argvs:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        gone = "Cannot find device" in proc.stderr or "No such" in proc.stderr
        if proc.returncode != 0 and not gone:
            errors.append(f"{' '.join(argv)}: {proc.stderr.strip()}")
    _record_path(net).unlink(missing_ok=True)
    return errors


def mesh_leftovers(net: MeshNetwork) -> list[str]:
    """What of `net` still exists (empty after a complete teardown): namespaces, any host
    interface named ``alp<id>...``, the host's blackhole or routes into the block."""
    left = []
    listed = {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}
    left += [f"namespace {ns}" for ns in net.namespaces if ns in listed]
    left += [
        f"link {p.name}"
        for p in sorted(Path("/sys/class/net").iterdir())
        if p.name.startswith(f"alp{net.id}")
    ]
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        with contextlib.suppress(ValueError, IndexError):
            words = line.split()
            dest = words[1] if words[0] in ("blackhole", "local", "broadcast") else words[0]
            if ipaddress.IPv4Network(dest, strict=False).overlaps(net.block):
                left.append(f"route {line.strip()}")
    return left


def sweep_stale() -> list[str]:
    """Remove what every harness (partition or mesh) whose process is gone left: one sweep
    for ``scripts/servers`` and every harness; the namespaces swept."""
    return sweep_stale_partitions() + sweep_stale_meshes()


def sweep_stale_meshes() -> list[str]:
    """Remove what meshes whose process is gone left: their nodes, epmds, network and
    files."""
    nets = sweep_dead(
        "mesh-*.json",
        lambda raw: MeshNetwork(
            str(raw["id"]), ipaddress.IPv4Network(raw["block"]), int(raw["size"])
        ),
        _delete_network,
    )
    return [ns for net in nets for ns in net.namespaces]


def _join_all(seed: NodeInfo, others: Sequence[NodeInfo]) -> None:
    """``devcluster._join`` of every node in `others`, its stops and starts side by side:
    only the ``join_cluster`` calls (membership changes) go one at a time. A third of a
    5-node mesh's start-up was its joins one after the other."""
    joiners = [n for n in others if seed.node not in devcluster.members(n)[0]]
    if not joiners:
        return
    devcluster._parallel(
        [lambda n=n: devbroker.rabbitmqctl(n, "stop_app") for n in joiners]  # type: ignore[misc]
    )
    for node in joiners:
        devbroker.rabbitmqctl(node, "join_cluster", seed.node, timeout=120)
    devcluster._parallel(
        [lambda n=n: devcluster._start_joined(n) for n in joiners]  # type: ignore[misc]
    )


@dataclass
class MeshCluster(ClusterNodes):
    """A started cluster, node ``i`` in namespace ``net.ns(i)``; see the module.

    Node indexes are 1-based like the node names. Make it with :func:`mesh_cluster`.
    """

    net: MeshNetwork = field(kw_only=True)
    epmd_port: int = 0
    _cut: set[tuple[int, int]] = field(default_factory=set)

    @property
    def size(self) -> int:
        return self.net.size

    def node_url(self, index: int) -> str:
        """AMQP URL of node `index`: its own address, reachable from the host (over the
        node's host link) and from its namespace (and, while their link is up, from the
        namespace of any other node)."""
        return self.node(index).url

    def ns_argv(self, index: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside node `index`'s namespace."""
        self.node(index)
        return ["ip", "netns", "exec", self.net.ns(index), *argv]

    def run_in_namespace(
        self, index: int, argv: Sequence[str], **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start `argv` in node `index`'s namespace: a client on that node's side of any
        cut. Killed at teardown if still running."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.ns_argv(index, argv), **popen)
        self._clients.append(proc)
        return proc

    # ---- faults

    def _pair(self, i: int, j: int) -> tuple[int, int]:
        self.node(i)
        self.node(j)
        if i == j:
            raise PartitionError(f"no link from node {i} to itself")
        return (min(i, j), max(i, j))

    def cut_link(self, i: int, j: int) -> None:
        """Take both ends of link (i, j) down: from then on, packets between nodes i and j
        are dropped on the sender's side (its sink), nothing is sent or reset. Every other
        link stays up."""
        pair = self._pair(i, j)
        _link_down(self.net, *pair)
        self._cut.add(pair)

    def heal_link(self, i: int, j: int, timeout: float = 10) -> None:
        """Bring link (i, j) up again; returns once TCP gets through it both ways."""
        pair = self._pair(i, j)
        _link_up(self.net, *pair)
        self._cut.discard(pair)
        self._await_links([pair], timeout)

    def split(self, *groups: Iterable[int]) -> None:
        """Cut every link between nodes of different `groups` (disjoint; a node in none
        keeps all its links: a bridge between the groups)."""
        sets = [set(g) for g in groups]
        seen: set[int] = set()
        for g in sets:
            for i in g:
                self.node(i)
            if g & seen:
                raise PartitionError(f"groups {groups} overlap")
            seen |= g
        for a, b in itertools.combinations(sets, 2):
            for i in a:
                for j in b:
                    self.cut_link(i, j)

    def heal(self, timeout: float = 10) -> None:
        """Every link up again; returns once every pair of namespaces gets TCP through its
        link (a connect to the peer's epmd)."""
        for pair in self.net.pairs:
            _link_up(self.net, *pair)
        self._cut.clear()
        self._await_links(self.net.pairs, timeout)

    @property
    def cut_links(self) -> set[tuple[int, int]]:
        return set(self._cut)

    def _await_links(self, pairs: Sequence[tuple[int, int]], timeout: float) -> None:
        targets: dict[int, list[tuple[str, int]]] = {}
        for i, j in pairs:
            targets.setdefault(i, []).append((self.net.address(j), self.epmd_port))
            targets.setdefault(j, []).append((self.net.address(i), self.epmd_port))
        deadline = time.monotonic() + timeout
        while True:
            with ThreadPoolExecutor(len(targets)) as pool:
                failed = [
                    f"{self.net.ns(i)} -> {t}"
                    for i, out in zip(
                        targets,
                        pool.map(lambda i: _unreachable(self.net.ns(i), targets[i]), targets),
                        strict=True,
                    )
                    for t in out
                ]
            if not failed:
                return
            if time.monotonic() > deadline:
                raise PartitionError(f"links still not carrying traffic: {failed}")
            time.sleep(0.05)

    # ---- lifecycle

    def teardown(self) -> None:
        """Stop every process this mesh started and delete its network and files, even
        half-made; raises if anything is left."""

        def kill(node_dir: Path) -> str | None:
            try:
                NODES.kill(node_dir)
            except (DevBrokerError, OSError) as e:
                return f"kill the node in {node_dir}: {e}"
            return None

        def kill_nodes() -> list[str]:
            # Every node that got as far as a state file, booted or not (a failed start
            # leaves `nodes` empty); whatever else runs in the namespaces dies with them.
            node_dirs = [state.parent for state in sorted(self.base_dir.glob("*/node.json"))]
            if not node_dirs:
                return []
            with ThreadPoolExecutor(len(node_dirs)) as pool:
                return [e for e in pool.map(kill, node_dirs) if e]

        self._teardown(
            kill_nodes, lambda: _delete_network(self.net) + mesh_leftovers(self.net), "mesh harness"
        )

    def _start(self, wait: float) -> None:
        began = time.monotonic()
        net, version = self.net, self.version
        _update_record(net, base_dir=str(self.base_dir))
        name = f"m{net.id}"
        devbroker.ensure_installed(version)
        devcluster._prepare(self.base_dir, name, self.size, version)
        self.epmd_port, *ports = devcluster._pick_ports(1 + 2 * self.size)
        for i in net.indexes:
            argv = [
                *_epmd_argv(version),
                "-port",
                str(self.epmd_port),
                "-address",
                f"{HOST},{net.address(i)}",
            ]
            self._epmds.append(_spawn_epmd(["ip", "netns", "exec", net.ns(i), *argv]))
        _update_record(net, epmds=[p.pid for p in self._epmds])
        deadline = time.monotonic() + 30
        for i in net.indexes:
            while not _listening(net.address(i), self.epmd_port):  # from the host
                if time.monotonic() > deadline:
                    raise PartitionError(f"epmd of {net.ns(i)} did not start")
                time.sleep(0.05)
        self._await_links(net.pairs, 10)  # every link carries traffic before the boots
        templates = []
        for i in net.indexes:
            d = self._node_dir(name, i)
            templates.append(
                NodeInfo(
                    devcluster._node_name(name, i),
                    0,
                    0,
                    d,
                    version,
                    net.address(i),
                    net.ns(i),
                    self.epmd_port,
                )
            )

        def boot(k: int) -> NodeInfo:
            t = templates[k]
            with locked(t.base_dir):
                return NODES.start_unlocked(t, (ports[2 * k], ports[2 * k + 1]), wait, strict=True)

        self.nodes = tuple(
            devcluster._parallel([lambda k=k: boot(k) for k in range(self.size)])  # type: ignore[misc]
        )
        _join_all(self.nodes[0], self.nodes[1:])
        self.started_in = time.monotonic() - began


@contextlib.contextmanager
def mesh_cluster(
    version: str | None = None,
    size: int = 3,
    net_ticktime: int | None = None,
    base_dir: Path | None = None,
    wait: float = 300.0,
) -> Iterator[MeshCluster]:
    """A started :class:`MeshCluster` of `size` (3 or 5) RabbitMQ `version` nodes (default
    ``$AMQP_LOCKS_RABBITMQ``), torn down on exit whatever happened (and at interpreter exit
    if the ``with`` body never returns). `wait`: each node's boot timeout (5 nodes boot at
    once on a small machine). `base_dir` holds the nodes' files (a fresh folder under
    ``$AMQP_LOCKS_HOME/mesh`` by default) and is deleted at teardown."""
    if os.geteuid() != 0:
        raise PartitionError("a mesh harness needs root (network namespaces, chroot)")
    if size not in SIZES:
        raise PartitionError(f"a mesh has {' or '.join(map(str, SIZES))} nodes, not {size}")
    version = devbroker.check_version(version or devbroker.default_version())
    net = _create_network(size)
    base = (base_dir or home() / "mesh") / f"{version}-{net.id}"
    with MeshCluster(version, base, net_ticktime, net=net).running(wait) as cluster:
        yield cluster


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m amqp_locks_dev.mesh [--version V] [--size N] [--net-ticktime T]``: start a
    mesh, cut link 1-2, measure node 1's detection, heal, tear down; the figures as JSON."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m amqp_locks_dev.mesh", description=_main.__doc__
    )
    parser.add_argument("--version", choices=devbroker.VERSIONS, default=None)
    parser.add_argument("--size", type=int, choices=SIZES, default=3)
    parser.add_argument("--net-ticktime", type=int, default=10)
    args = parser.parse_args(argv)
    with mesh_cluster(args.version, args.size, net_ticktime=args.net_ticktime) as mc:
        figures: dict[str, Any] = {
            "version": mc.version,
            "size": mc.size,
            "net_ticktime": args.net_ticktime,
            "start_s": round(mc.started_in, 2),
            "nodes": [n.node for n in mc.nodes],
            "urls": mc.urls,
        }
        mc.watch_node_down(1, 2)
        cut_at = time.time()
        mc.cut_link(1, 2)
        figures["detected_s"] = round(mc.wait_node_down(1, 2) - cut_at, 2)
        figures["running_1_after_cut"] = mc.running_nodes(1)
        began = time.monotonic()
        mc.heal()
        figures["heal_s"] = round(time.monotonic() - began, 2)
    figures["leftovers"] = mesh_leftovers(mc.net)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
