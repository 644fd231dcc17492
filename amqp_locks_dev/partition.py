"""A 3-node RabbitMQ cluster that a test can cut in two: node 1 in a network namespace.

Issue 21 (point 6): partition tests own their partition. :func:`partition_cluster` makes a
network namespace ``alp-<id>`` joined to the host by a veth pair (a private /30 out of
``10.231.0.0/16`` that no address or route of the host overlaps), starts node 1 of a
cluster inside it and nodes 2 and 3 on the host, and joins them. The cut is the link going
down (:meth:`PartitionCluster.cut`), the heal the link coming back; ``tc netem`` does not
work here, ``ip netns`` does. A client (a Python subprocess) can live beside node 1 on the
minority side: :meth:`PartitionCluster.run_in_namespace`.

How the two sides find each other, with no name service and nothing shared with other
nodes on this machine:

- Nodes are named by address (Erlang long names, ``p1x@10.231.0.2``, ``p2x@10.231.0.1``)
  and listen for AMQP and distribution on loopback and on their side's veth address.
- The cluster has its own epmd port, and the harness runs one epmd per side on it (host:
  loopback + the host's veth address; namespace: loopback + the namespace's), so peers can
  look each other up across the link and teardown can stop exactly those processes.
- While the link is down, the host routes the /30 into a blackhole route (installed with
  the veth pair, at a low priority): without it, packets for the namespace's address
  would follow the host's default route out of the machine. Test traffic only ever goes
  to loopback and to the namespace.

Teardown (:meth:`PartitionCluster.teardown`, run by the context manager's ``finally`` and
by ``atexit``) kills the nodes, every process left in the namespace and the epmds, deletes
the veth pair, the blackhole route and the namespace, and checks that none is left. A
harness whose process died before its teardown is swept by the next one: each harness
records what it made under ``/run/amqp-locks-partitions`` before making it.

Needs root (namespaces, links, chroot). The nodes run ``devcluster``'s cluster settings
(``cluster_partition_handling = pause_minority``) plus ``net_ticktime`` when given
(RabbitMQ's default is 60 s; the broker cannot see a lost peer sooner than 0.75 of it).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from . import devbroker, devcluster
from .devbroker import NODES, DevBrokerError, NodeInfo
from .localserver import (
    HOST,
    STARTED,
    cmdline_mentions,
    home,
    locked,
    note,
    pid_alive,
    signal_and_wait,
)

__all__ = [
    "ClusterNodes",
    "Network",
    "PartitionCluster",
    "PartitionError",
    "leftovers",
    "partition_cluster",
    "sweep_stale_partitions",
]

#: The private range the harness's /30s come from (checked against the host's addresses
#: and routes before use).
SUBNETS = ipaddress.IPv4Network("10.231.0.0/16")
#: Records of live harnesses (owner pid and what it made), for sweeping a crashed one's.
STATE_DIR = Path("/run/amqp-locks-partitions")
#: Priority of the blackhole route for a /30 (the connected route, metric 0, wins while
#: the link is up).
_BLACKHOLE_METRIC = 4242
#: The namespace prefix: ``ip netns list`` shows ours by it.
PREFIX = "alp-"
SIZE = 3
#: A harness's network record type (Network, mesh.MeshNetwork).
_N = TypeVar("_N")


class PartitionError(DevBrokerError):
    """The partition harness could not set up, cut, heal or remove its network."""


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30) -> str:
    proc = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise PartitionError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


# ----------------------------------------------------------------------------- network


@dataclass(frozen=True)
class Network:
    """A namespace joined to the host by a veth pair on a private /30."""

    id: str
    subnet: ipaddress.IPv4Network

    @property
    def ns(self) -> str:
        return f"{PREFIX}{self.id}"

    @property
    def host_veth(self) -> str:
        return f"alp{self.id}h"  # interface names have at most 15 characters

    @property
    def ns_veth(self) -> str:
        return f"alp{self.id}n"

    @property
    def host_ip(self) -> str:
        return str(self.subnet[1])

    @property
    def ns_ip(self) -> str:
        return str(self.subnet[2])

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "subnet": str(self.subnet), "owner": os.getpid()}


def _host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix the host has an address or a route in (any table)."""
    out = _run(["ip", "-4", "-o", "addr", "show"]) + _run(
        ["ip", "-4", "route", "show", "table", "all"]
    )
    nets = []
    for token in out.split():
        with contextlib.suppress(ValueError):
            if token[0].isdigit() and ("." in token):
                nets.append(ipaddress.IPv4Network(token, strict=False))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _host_networks()
    for subnet in SUBNETS.subnets(new_prefix=30):
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise PartitionError(f"no free /30 left in {SUBNETS}")


def _delete_network(net: Network) -> list[str]:
    """Remove everything `net` may have made (whatever exists of it); the errors."""
    errors: list[str] = []
    pids = _run(["ip", "netns", "pids", net.ns], check=False).split()
    for pid in (int(p) for p in pids if p.isdigit()):
        # Only processes in a namespace this harness made: nodes, epmd, clients.
        signal_and_wait(pid, signal.SIGKILL, 5.0)
    for argv in (
        ["ip", "link", "del", net.host_veth],
        ["ip", "route", "del", "blackhole", str(net.subnet), "metric", str(_BLACKHOLE_METRIC)],
        ["ip", "netns", "del", net.ns],
    ):
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        gone = "Cannot find device" in proc.stderr or "No such" in proc.stderr
        if proc.returncode != 0 and not gone:
            errors.append(f"{' '.join(argv)}: {proc.stderr.strip()}")
    (STATE_DIR / f"{net.id}.json").unlink(missing_ok=True)
    return errors


def leftovers(net: Network) -> list[str]:
    """What of `net` still exists (empty after a complete teardown)."""
    left = []
    if net.ns in _run(["ip", "netns", "list"]).split():
        left.append(f"namespace {net.ns}")
    if Path(f"/sys/class/net/{net.host_veth}").exists():
        left.append(f"link {net.host_veth}")
    if str(net.subnet) in _run(["ip", "-4", "route", "show", "type", "blackhole"]):
        left.append(f"blackhole route {net.subnet}")
    return left


def _update_record(net: Network, **fields: Any) -> None:
    """Add to the record of `net` what a sweep would need to stop (written before it
    exists, so a harness killed at any point leaves nothing a sweep cannot find)."""
    path = STATE_DIR / f"{net.id}.json"
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw) + "\n")


def sweep_record(raw: dict[str, Any], delete_network: Callable[[], object]) -> None:
    """Stop what the record `raw` of a harness whose process is gone names, in the order
    that frees each step's resources: its nodes, its epmds, its network
    (`delete_network`, the harness's own), then its files."""
    base = Path(raw["base_dir"]) if raw.get("base_dir") else None
    if base is not None:
        for state in sorted(base.glob("*/node.json")):
            with contextlib.suppress(DevBrokerError, OSError):
                NODES.kill(state.parent)
    for pid in raw.get("epmds", []):
        if pid_alive(pid) and cmdline_mentions(pid, "epmd"):
            signal_and_wait(pid, signal.SIGKILL, 5.0)
    delete_network()
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)


def sweep_dead(
    pattern: str,
    network_of: Callable[[dict[str, Any]], _N | None],
    delete_network: Callable[[_N], object],
) -> list[_N]:
    """Sweep (:func:`sweep_record`) each record in STATE_DIR matching `pattern` whose owner
    process is gone; the networks swept. `network_of` reads a record's network (None: not
    this harness's record); a record that cannot be read is left."""
    swept = []
    for path in sorted(STATE_DIR.glob(pattern)):
        try:
            raw = json.loads(path.read_text())
            net = network_of(raw)
            owner = int(raw["owner"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if net is None or pid_alive(owner):
            continue
        sweep_record(raw, functools.partial(delete_network, net))
        swept.append(net)
    return swept


def _network_of(raw: dict[str, Any]) -> Network | None:
    if raw.get("kind", "partition") != "partition":
        return None  # a mesh's record (amqp_locks_dev.mesh sweeps it)
    return Network(str(raw["id"]), ipaddress.IPv4Network(raw["subnet"]))


def sweep_stale_partitions() -> list[str]:
    """Remove what partition harnesses whose process is gone left (a SIGKILLed test run):
    their host-side nodes and epmd, their network and their files; the namespaces swept.
    :func:`amqp_locks_dev.mesh.sweep_stale` sweeps meshes' too (one sweep for
    ``scripts/servers`` and every harness)."""
    return [net.ns for net in sweep_dead("*.json", _network_of, _delete_network)]


def _create_network() -> Network:
    """Make the namespace, the veth pair and the blackhole route (recorded first)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with locked(STATE_DIR):  # two harnesses never pick the same /30
        sweep_stale_partitions()
        net = Network(secrets.token_hex(3), _pick_subnet())
        (STATE_DIR / f"{net.id}.json").write_text(json.dumps(net.record()) + "\n")
        try:
            note({"netns": net.ns, "how": STARTED}, "netns")  # the run's stop removes it
            _run(["ip", "netns", "add", net.ns])
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    net.host_veth,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    net.ns_veth,
                    "netns",
                    net.ns,
                ]
            )
            _run(["ip", "addr", "add", f"{net.host_ip}/30", "dev", net.host_veth])
            _run(
                [
                    "ip",
                    "route",
                    "add",
                    "blackhole",
                    str(net.subnet),
                    "metric",
                    str(_BLACKHOLE_METRIC),
                ]
            )
            _run(["ip", "link", "set", net.host_veth, "up"])
            _run(["ip", "-n", net.ns, "addr", "add", f"{net.ns_ip}/30", "dev", net.ns_veth])
            _run(["ip", "-n", net.ns, "link", "set", net.ns_veth, "up"])
            _run(["ip", "-n", net.ns, "link", "set", "lo", "up"])
        except BaseException:
            _delete_network(net)
            raise
    return net


def _link_up(net: Network) -> bool:
    """Both ends of the veth pair carry traffic (operstate UP on each side)."""
    host = Path(f"/sys/class/net/{net.host_veth}/operstate").read_text().strip()
    inner = _run(["ip", "-n", net.ns, "-o", "link", "show", net.ns_veth])
    return host == "up" and "state UP" in inner


# ----------------------------------------------------------------------------- cluster


def _epmd_argv(version: str) -> list[str]:
    """epmd of the line's Erlang (the 4.x lines': from their Debian root)."""
    if version == devbroker.HOST_VERSION:
        return [shutil.which("epmd") or "/usr/bin/epmd"]
    return ["chroot", str(devbroker.ensure_root(version)), "/usr/bin/epmd"]


def _listening(host: str, port: int, netns: str | None = None) -> bool:
    if netns is None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return True
        return False
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1)"
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def _spawn_epmd(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start an epmd (`argv`, with its ``ip netns exec`` prefix if any) detached, silent."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _watcher(index: int) -> str:
    """A node's registered watcher for node `index` (ClusterNodes.watch_node_down)."""
    return f"amqp_locks_watch_{index}"


@dataclass
class ClusterNodes:
    """What a harness's started nodes answer (shared with :mod:`~amqp_locks_dev.mesh`):
    node lookup by 1-based index, ``rabbitmqctl`` on the node's side, what it sees; and the
    lifecycle both harnesses share (:meth:`running`, :meth:`_teardown`)."""

    version: str
    base_dir: Path
    net_ticktime: int | None
    nodes: tuple[NodeInfo, ...] = ()
    #: Seconds from nothing to a joined cluster (network, epmds, boots, joins).
    started_in: float = 0.0
    _epmds: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _clients: list[subprocess.Popen[Any]] = field(default_factory=list)
    _torn_down: bool = False
    #: (observer, index) pairs with a watcher armed and not yet read (:meth:`watch_node_down`).
    _watched: set[tuple[int, int]] = field(default_factory=set)

    def _start(self, wait: float) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def running(self, wait: float) -> Iterator[Self]:
        """Start the harness and yield it, torn down on exit whatever happened (and at
        interpreter exit if the ``with`` body never returns)."""
        atexit.register(self.teardown)
        try:
            self._start(wait)
            yield self
        finally:
            atexit.unregister(self.teardown)
            self.teardown()

    def _teardown(
        self, kill_nodes: Callable[[], list[str]], drop_network: Callable[[], list[str]], what: str
    ) -> None:
        """Stop, in this order, the clients, the nodes (`kill_nodes`: its errors), the epmds,
        then the network (`drop_network`: its errors and leftovers) and the files; raises
        naming `what` if anything is left. Once only."""
        if self._torn_down:
            return
        self._torn_down = True
        for proc in self._clients:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        errors = kill_nodes()
        for epmd in self._epmds:
            if epmd.poll() is None:
                epmd.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                epmd.wait(timeout=10)
        errors += drop_network()
        if os.environ.get("AMQP_LOCKS_KEEP_BROKER") != "1":
            shutil.rmtree(self.base_dir, ignore_errors=True)
        if errors:
            raise PartitionError(f"{what} teardown: " + "; ".join(errors))

    def _node_dir(self, name: str, index: int) -> Path:
        """Node `index`'s prepared folder, with the harness's ``net_ticktime`` if set."""
        d = devcluster._node_dir(self.base_dir, name, index)
        if self.net_ticktime is not None:
            (d / "advanced.config").write_text(
                f"[{{kernel, [{{net_ticktime, {int(self.net_ticktime)}}}]}}].\n"
            )
        return d

    def node(self, index: int) -> NodeInfo:
        if not 1 <= index <= len(self.nodes):
            raise PartitionError(f"node index {index} out of range 1..{len(self.nodes)}")
        return self.nodes[index - 1]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def rabbitmqctl(self, index: int, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl`` against node `index`, run on that node's side."""
        return devbroker.rabbitmqctl(self.node(index), *args, timeout=timeout)

    def running_nodes(self, observer: int) -> list[str]:
        """The nodes `observer` reports running (``cluster_status``)."""
        return devcluster.members(self.node(observer))[1]

    def watch_node_down(self, observer: int, index: int, timeout: float = 60) -> None:
        """Start a watcher on node `observer` that notes when it sees node `index` go down
        (the Erlang kernel's ``nodedown``, by ``net_kernel:monitor_nodes``), for
        :meth:`wait_node_down` to read. Arm it before a cut: a ``rabbitmqctl`` started
        after the cut on a loaded machine may boot after the node is already down (rehearsal
        79, two busy loops beside four lanes: a 3-node mesh read 17.8 s for a 10 s tick),
        and then could only say when it asked."""
        target, reg = self.node(index).node, _watcher(index)
        expr = (
            f"T = '{target}', catch exit(whereis({reg}), kill), Self = self(), "
            "P = spawn(fun() -> ok = net_kernel:monitor_nodes(true), "
            "D0 = case lists:member(T, nodes()) of "
            "false -> os:system_time(millisecond); true -> undefined end, "
            "Self ! armed, "
            "L = fun Loop(D) -> receive "
            "{nodedown, T} when D =:= undefined -> Loop(os:system_time(millisecond)); "
            "{get, From} when D =/= undefined -> From ! {down, D}, Loop(D); "
            "{nodedown, _} -> Loop(D); {nodeup, _} -> Loop(D) "
            "after 900000 -> ok end end, L(D0) end), "
            f"register({reg}, P), receive armed -> armed after 30000 -> timeout end."
        )
        out = self.rabbitmqctl(observer, "eval", expr, timeout=timeout).strip()
        if out != "armed":
            raise PartitionError(f"node {observer}: watcher for node {index} not armed: {out!r}")
        self._watched.add((observer, index))

    def wait_node_down(self, observer: int, index: int, timeout: float = 120) -> float:
        """Block until node `observer` sees node `index` go down; the time it did, in
        ``time.time()`` seconds. Read from the watcher :meth:`watch_node_down` armed (once
        per arming), else one is armed now: then a node already down reads as the time of
        asking, not of the loss."""
        if (observer, index) not in self._watched:
            self.watch_node_down(observer, index)
        self._watched.discard((observer, index))
        reg, ms = _watcher(index), int(timeout * 1000)
        expr = (
            f"case whereis({reg}) of undefined -> not_armed; "
            f"P -> P ! {{get, self()}}, receive {{down, D}} -> {{down, D}} "
            f"after {ms} -> timeout end end."
        )
        out = self.rabbitmqctl(observer, "eval", expr, timeout=timeout + 30).strip()
        if not out.startswith("{down,"):
            raise PartitionError(f"node {observer} did not see node {index} go down: {out}")
        return int(out.rstrip("}").split(",")[1]) / 1000

    def kill(self, index: int) -> bool:
        """SIGKILL node `index` (a crash); whether it was running."""
        return NODES.kill(self.node(index).base_dir)

    def start_node(self, index: int, wait: float = 180.0) -> NodeInfo:
        """Start node `index` again on its ports; it rejoins from its data."""
        node = self.node(index)
        return NODES.start(node, devbroker.NODES.ports(node), wait)


@dataclass
class PartitionCluster(ClusterNodes):
    """A started 3-node cluster, node 1 in the namespace of :attr:`net`; see the module.

    Node indexes are 1-based like the node names. Make it with :func:`partition_cluster`.
    """

    net: Network = field(kw_only=True)
    _down: bool = False

    # ---- addresses and commands

    def node_url(self, index: int) -> str:
        """AMQP URL of node `index` (node 1's: the namespace's address)."""
        return self.node(index).url

    def ns_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace, beside node 1."""
        return ["ip", "netns", "exec", self.net.ns, *argv]

    def run_in_namespace(self, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` (e.g. ``[sys.executable, "-c", ...]``) in the namespace: a client on
        node 1's side of the cut. Killed at teardown if still running."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.ns_argv(argv), **popen)
        self._clients.append(proc)
        return proc

    # ---- faults

    def cut(self, both: bool = False, heard: bool = False) -> None:
        """Take the link down: the host's end (and the namespace's, with `both`). Nothing
        is sent or reset: each side's packets to the other are dropped (a silent cut).

        `heard`: the majority hears of the cut at once, as after a REJECT, a reset or an
        unreachable reply: nodes 2 and 3 drop their Erlang distribution links to node 1
        (``erlang:disconnect_node``) right after the link goes down, instead of noticing
        0.75-1.25 x ``net_ticktime`` later. Returns once both have."""
        _run(["ip", "link", "set", self.net.host_veth, "down"])
        if both:
            _run(["ip", "-n", self.net.ns, "link", "set", self.net.ns_veth, "down"])
        self._down = True
        if heard:
            target = self.node(1).node
            expr = f"erlang:disconnect_node('{target}')."
            with ThreadPoolExecutor(len(self.nodes) - 1) as pool:
                outs = list(
                    pool.map(
                        lambda i: self.rabbitmqctl(i, "eval", expr),
                        range(2, len(self.nodes) + 1),
                    )
                )
            if any(out.strip() not in ("true", "false") for out in outs):
                raise PartitionError(f"disconnect_node from node 1 failed: {outs}")

    def heal(self, timeout: float = 10) -> None:
        """Bring both ends of the link up and return once both carry traffic."""
        _run(["ip", "-n", self.net.ns, "link", "set", self.net.ns_veth, "up"])
        _run(["ip", "link", "set", self.net.host_veth, "up"])
        deadline = time.monotonic() + timeout
        while not _link_up(self.net):
            if time.monotonic() > deadline:
                raise PartitionError(f"the link {self.net.host_veth} did not come up in {timeout}s")
            time.sleep(0.02)
        self._down = False

    @property
    def is_cut(self) -> bool:
        return self._down

    # ---- lifecycle

    def teardown(self) -> None:
        """Stop every process this harness started and delete its network and files, even
        half-made; raises if anything is left (``ip netns list``, ``ip link``)."""

        def kill_nodes() -> list[str]:
            errors = []
            for node in self.nodes:
                try:
                    NODES.kill(node.base_dir)
                except (DevBrokerError, OSError) as e:
                    errors.append(f"kill {node.node}: {e}")
            return errors

        self._teardown(
            kill_nodes, lambda: _delete_network(self.net) + leftovers(self.net), "partition harness"
        )

    def _start(self, wait: float) -> None:
        began = time.monotonic()
        _update_record(self.net, base_dir=str(self.base_dir))
        name = f"p{self.net.id}"
        version = self.version
        devbroker.ensure_installed(version)
        devcluster._prepare(self.base_dir, name, SIZE, version)
        epmd_port, *ports = devcluster._pick_ports(1 + 2 * SIZE)
        sides = [(self.net.ns, self.net.ns_ip), (None, self.net.host_ip)]
        for netns, address in sides:
            argv = [*_epmd_argv(version), "-port", str(epmd_port), "-address", f"{HOST},{address}"]
            prefix = ["ip", "netns", "exec", netns] if netns else []
            self._epmds.append(_spawn_epmd([*prefix, *argv]))
        _update_record(self.net, epmds=[p.pid for p in self._epmds])
        for netns, address in sides:
            deadline = time.monotonic() + 30
            while not _listening(address, epmd_port, netns):
                if time.monotonic() > deadline:
                    raise PartitionError(f"epmd on {address}:{epmd_port} did not start")
                time.sleep(0.05)
        templates = []
        for i in range(1, SIZE + 1):
            d = self._node_dir(name, i)
            netns, address = sides[0] if i == 1 else sides[1]
            templates.append(
                NodeInfo(
                    devcluster._node_name(name, i), 0, 0, d, version, address, netns, epmd_port
                )
            )

        def boot(i: int) -> NodeInfo:
            t = templates[i]
            with locked(t.base_dir):
                return NODES.start_unlocked(t, (ports[2 * i], ports[2 * i + 1]), wait, strict=True)

        self.nodes = tuple(
            devcluster._parallel([lambda i=i: boot(i) for i in range(SIZE)])  # type: ignore[misc]
        )
        for node in self.nodes[1:]:
            devcluster._join(self.nodes[0], node)
        self.started_in = time.monotonic() - began


@contextlib.contextmanager
def partition_cluster(
    version: str | None = None,
    net_ticktime: int | None = None,
    base_dir: Path | None = None,
    wait: float = 180.0,
) -> Iterator[PartitionCluster]:
    """A started :class:`PartitionCluster` of RabbitMQ `version` (default
    ``$AMQP_LOCKS_RABBITMQ``), torn down on exit whatever happened (and at interpreter exit
    if the ``with`` body never returns). `base_dir` holds the nodes' files (a fresh folder
    under ``$AMQP_LOCKS_HOME/partition`` by default) and is deleted at teardown."""
    if os.geteuid() != 0:
        raise PartitionError("a partition harness needs root (network namespaces, chroot)")
    version = devbroker.check_version(version or devbroker.default_version())
    net = _create_network()
    base = (base_dir or home() / "partition") / f"{version}-{net.id}"
    with PartitionCluster(version, base, net_ticktime, net=net).running(wait) as cluster:
        yield cluster


def _main() -> int:
    """``python -m amqp_locks_dev.partition [VERSION] [NET_TICKTIME]``: start a harness,
    cut, measure the majority's detection, heal, tear down; print the figures as JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m amqp_locks_dev.partition",
        description="Start a private 3-node RabbitMQ cluster with node 1 in a network "
        "namespace (root), cut it off silently, measure when node 2 sees it down, heal, "
        "tear everything down; print the figures as JSON.",
    )
    parser.add_argument("version", nargs="?", choices=devbroker.VERSIONS, help="RabbitMQ line")
    parser.add_argument("net_ticktime", nargs="?", type=int, default=10, help="seconds")
    args = parser.parse_args()
    version, tick = args.version, args.net_ticktime
    with partition_cluster(version, net_ticktime=tick) as pc:
        figures: dict[str, Any] = {
            "version": pc.version,
            "net_ticktime": tick,
            "start_s": round(pc.started_in, 2),
            "running": pc.running_nodes(2),
        }
        pc.watch_node_down(2, 1)
        cut_at = time.time()
        pc.cut()
        figures["detected_s"] = round(pc.wait_node_down(2, 1) - cut_at, 2)
        figures["running_after_cut"] = pc.running_nodes(2)
        pc.heal()
    figures["leftovers"] = leftovers(pc.net)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
