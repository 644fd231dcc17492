"""A private RabbitMQ node on 127.0.0.1 for development, tests, demos and CI.

Each node lives entirely in its own ``base_dir`` (config, Erlang cookie, data, logs,
``node.json`` state), listens on loopback only and runs as the invoking user, so
several nodes can run side by side without touching a system-wide RabbitMQ.

We call the real scripts in ``/usr/lib/rabbitmq/bin`` rather than Debian's
``/usr/sbin`` wrappers: those ``su`` to the ``rabbitmq`` user, which then needs to
own (and traverse to) every directory, and they redirect output to
``/var/log/rabbitmq``.  Running as the invoking user works for root and non-root
alike; ``HOME=base_dir`` gives the server and ``rabbitmqctl`` the same cookie.

Three RabbitMQ lines can run here (``$AMQP_LOCKS_RABBITMQ`` or ``version=`` picks one):

- ``3.10``: Debian 12's ``rabbitmq-server`` (3.10.8, Erlang 25) from the host's packages;
- ``4.0``: Debian 13's ``rabbitmq-server`` (4.0.5, Erlang 27), configured with RabbitMQ
  4.3's defaults: transient non-exclusive queues and global QoS are denied
  (``deprecated_features.permit.* = false``);
- ``4.3``: Debian forky's ``rabbitmq-server`` (4.3.6, Erlang/OTP 29) with its own defaults
  (Khepri is the metadata store).

The host's Erlang is too old for 4.x, so each 4.x line runs inside a minimal Debian root
built once per machine with ``debootstrap`` from Debian's packages (``$AMQP_LOCKS_ROOTS``,
default ``/var/cache/amqp-locks``) and entered with ``chroot`` in a private mount namespace
(``unshare``) that binds /dev, /proc and the node's own directory; each line's Erlang
nodes register with an epmd of their own Erlang, on the line's own port. Needs root.

CLI: ``python -m amqp_locks_dev.devbroker start|stop|status|restart|url [--name NAME]
[--version 3.10|4.0|4.3]``, and ``ctl [--name NAME] [--version V] [--] ARGS...``: the
running node's own ``rabbitmqctl ARGS`` (its cookie, its line's root), exit status and all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import socket
import string
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .localserver import (
    HOST,
    Commands,
    Launch,
    LocalServer,
    ServerInfo,
    apt_install,
    cli,
    guarded,
    home,
    locked,
    pid_alive,
    reap,
    resolve_dir,
)

__all__ = [
    "DEFAULT_NAME",
    "DevBrokerError",
    "NodeInfo",
    "ensure_installed",
    "main",
    "rabbitmqctl",
    "restart",
    "start",
    "status",
    "stop",
    "url",
]

DEFAULT_NAME = "amqplocks"
#: Long lock holds keep token messages unacked for hours; RabbitMQ's default
#: consumer_timeout (30 min) would close the channel and silently drop the lock.
CONSUMER_TIMEOUT_MS = 365 * 24 * 3600 * 1000
#: rabbitmqctl's own distribution listener uses this range; never hand it out.
_CTL_DIST_PORTS = range(35672, 35683)
_EPMD_PORT = 4369
_SBIN_CANDIDATES = (Path("/usr/lib/rabbitmq/bin"),)
#: The RabbitMQ lines a private node can run, and the default one.
VERSIONS = ("3.10", "4.0", "4.3")
HOST_VERSION = "3.10"
#: Where the Debian roots of the 4.x lines are built (once per machine).
_ROOTS_ENV = "AMQP_LOCKS_ROOTS"
_DEFAULT_ROOTS = Path("/var/cache/amqp-locks")
_DEBIAN_MIRROR = "http://deb.debian.org/debian"
_CHROOT_SBIN = Path("/usr/lib/rabbitmq/bin")
#: RabbitMQ 4.3's defaults that 4.0.5 only has as opt-in denials.
_DEFAULTS_OF_4_3 = (
    "deprecated_features.permit.transient_nonexcl_queues = false\n"
    "deprecated_features.permit.global_qos = false\n"
)
#: The roots' /etc/hosts: debootstrap writes none, and 4.3.6 does not boot in a root
#: without ``localhost`` in it (issue 21).
_ROOT_HOSTS = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"


@dataclass(frozen=True)
class RootLine:
    """A RabbitMQ line that runs from a Debian root: which suite has it, how debootstrap
    builds that suite, and what sets the line's nodes apart on this machine."""

    #: Debian suite whose ``rabbitmq-server`` is the line (``trixie``: 4.0.5).
    suite: str
    #: The exact RabbitMQ release that suite ships (for messages and docs).
    release: str
    #: Erlang nodes of the line register with an epmd on this port (see the docstring).
    epmd_port: int
    #: debootstrap's script for the suite when it has none of its own name (forky: sid's).
    script: str | None = None
    #: Appended to every node's rabbitmq.conf.
    config: str = ""


#: The lines run from a Debian root, by line.
ROOT_LINES: dict[str, RootLine] = {
    "4.0": RootLine("trixie", "4.0.5", 4370, config=_DEFAULTS_OF_4_3),
    "4.3": RootLine("forky", "4.3.6", 4371, script="/usr/share/debootstrap/scripts/sid"),
}
_AMQP_HEADER = b"AMQP\x00\x00\x09\x01"


class DevBrokerError(RuntimeError):
    """The private broker could not be installed, started, stopped or queried."""


def default_version() -> str:
    """The RabbitMQ line new nodes run: ``$AMQP_LOCKS_RABBITMQ``, else 3.10 (the host's)."""
    return check_version(os.environ.get("AMQP_LOCKS_RABBITMQ") or HOST_VERSION)


def check_version(version: str) -> str:
    if version not in VERSIONS:
        raise DevBrokerError(
            f"unknown RabbitMQ line {version!r} for a private node: use one of {VERSIONS}"
        )
    return version


def root_line(version: str) -> RootLine:
    """How the 4.x line `version` runs (raises for the host's line, which has no root)."""
    try:
        return ROOT_LINES[check_version(version)]
    except KeyError:
        raise DevBrokerError(
            f"RabbitMQ {version} runs from the host's packages, not a root"
        ) from None


def root_dir(version: str) -> Path:
    """The Debian root holding the line `version` (see :func:`ensure_root`):
    ``$AMQP_LOCKS_ROOTS/rabbitmq-<line>-<suite>``."""
    roots = Path(os.environ.get(_ROOTS_ENV) or _DEFAULT_ROOTS)
    return roots / f"rabbitmq-{version}-{root_line(version).suite}"


@dataclass(frozen=True)
class NodeInfo(ServerInfo):
    """Where a private node lives and listens; enough to talk to it or restart it."""

    name: str
    amqp_port: int
    dist_port: int
    base_dir: Path
    #: The RabbitMQ line (``3.10``, ``4.0`` or ``4.3``; see the module docstring).
    version: str = HOST_VERSION
    #: An IP address the node listens on besides loopback (AMQP and Erlang distribution),
    #: and then the host part of its (long) node name: nodes on both sides of a veth pair
    #: (:mod:`~amqp_locks_dev.partition`) reach each other by address, with no name service.
    address: str = HOST
    #: The network namespace the node (and its ``rabbitmqctl``) runs in; None: the host's.
    netns: str | None = None
    #: The epmd port of the node and its CLI, instead of the line's shared one.
    epmd_port: int | None = None

    @property
    def chrooted(self) -> bool:
        return self.version != HOST_VERSION

    @property
    def long_name(self) -> bool:
        """Whether the node is named by its :attr:`address` (Erlang long names)."""
        return self.address != HOST

    @property
    def node(self) -> str:
        """Erlang node name; ``localhost`` (or the address) keeps distribution independent
        of DNS."""
        return f"{self.name}@{self.address if self.long_name else 'localhost'}"

    @property
    def url(self) -> str:
        """AMQP URL for the default vhost; guest is allowed on loopback (and, for a node
        with its own address, on that private address: see :func:`_write_config`)."""
        return f"amqp://guest:guest@{self.address}:{self.amqp_port}/%2F"

    @property
    def pid_file(self) -> Path:
        return self.base_dir / "rabbitmq.pid"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "log" / f"{self.node}.log"


# --------------------------------------------------------------------------- install


def _sbin_dir() -> Path | None:
    """Directory holding the unwrapped ``rabbitmq-server``/``rabbitmqctl`` scripts."""
    candidates = list(_SBIN_CANDIDATES)
    found = shutil.which("rabbitmq-server")
    if found:
        # Debian's /usr/sbin entries are su-wrappers; a tarball/Homebrew install is not.
        candidates.append(Path(found).resolve().parent)
    for d in candidates:
        if (d / "rabbitmq-server").exists() and (d / "rabbitmqctl").exists():
            return d
    return None


def _require_sbin() -> Path:
    sbin = _sbin_dir()
    if sbin is None:
        raise DevBrokerError("rabbitmq-server is not installed; call ensure_installed()")
    return sbin


def ensure_installed(version: str | None = None) -> None:
    """Make the RabbitMQ line `version` runnable here (default: :func:`default_version`).

    3.10: install Debian's rabbitmq-server if missing, without leaving a system node up
    (only the binaries are wanted: the package's service is kept from starting by
    policy-rc.d and stopped if it started anyway). 4.x: :func:`ensure_root`.
    """
    version = check_version(version or default_version())
    if version != HOST_VERSION:
        ensure_root(version)
        return
    if _sbin_dir() is not None:
        return
    apt_install("rabbitmq-server", DevBrokerError, "amqp_locks_dev.devbroker")
    # Belt and braces: if postinst started the default node anyway, stop it. Its CLI
    # wrapper su's to the rabbitmq user and so uses that user's cookie.
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run([ctl, "-q", "stop"], capture_output=True, timeout=60, check=False)
    if _sbin_dir() is None:
        raise DevBrokerError("apt-get installed rabbitmq-server but its scripts were not found")


_ROOT_READY = ".amqp-locks-root-ready"


def ensure_root(version: str) -> Path:
    """Build the Debian root holding the 4.x line `version` unless it is ready (once per
    machine, a minute or so: forky took 40 s here): ``debootstrap --variant=minbase
    --include=rabbitmq-server SUITE ROOT MIRROR [SCRIPT]`` from Debian's mirror
    (``$AMQP_LOCKS_DEBIAN_MIRROR``), then an ``/etc/hosts`` naming ``localhost``. Needs root.

    A complete root found without our marker (built by hand with the same command) is
    adopted: completed with the hosts file and marked, not built again."""
    line = root_line(version)
    root = root_dir(version)
    if (root / _ROOT_READY).exists():
        return root
    if os.geteuid() != 0:
        raise DevBrokerError(
            f"RabbitMQ {line.release} runs in a Debian {line.suite} root ({root}) built with "
            "debootstrap and entered with chroot: both need root"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    with locked(root.parent / ".build-lock"):
        if (root / _ROOT_READY).exists():
            return root
        mirror = os.environ.get("AMQP_LOCKS_DEBIAN_MIRROR") or _DEBIAN_MIRROR
        if _complete_root(root):
            how = "adopted by amqp_locks_dev.devbroker (built by hand)"
        else:
            _debootstrap(version, line, root, mirror)
            how = f"built by amqp_locks_dev.devbroker from {mirror}"
        (root / "etc" / "hosts").write_text(_ROOT_HOSTS)
        (root / _ROOT_READY).write_text(how + "\n")
    return root


def _complete_root(root: Path) -> bool:
    """Whether `root` is a finished debootstrap with rabbitmq-server installed: debootstrap
    removes its ``/debootstrap`` work folder last, and dpkg records the package."""
    if not (root / str(_CHROOT_SBIN).lstrip("/") / "rabbitmq-server").exists():
        return False
    if (root / "debootstrap").exists():
        return False
    try:
        status = (root / "var/lib/dpkg/status").read_text(errors="replace")
    except OSError:
        return False
    return "Package: rabbitmq-server\nStatus: install ok installed\n" in status


def _debootstrap(version: str, line: RootLine, root: Path, mirror: str) -> None:
    """debootstrap the line's suite into ``ROOT.partial``, then move it to `root` (a
    failed or interrupted build never leaves a root that looks finished)."""
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap", DevBrokerError, "amqp_locks_dev.devbroker")
    partial = root.with_name(root.name + ".partial")
    _remove_root(partial)
    cmd = [
        "debootstrap",
        "--variant=minbase",
        "--include=rabbitmq-server",
        line.suite,
        str(partial),
        mirror,
        *([line.script] if line.script else []),
    ]
    print(f"building the RabbitMQ {version} root: {' '.join(cmd)}", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DevBrokerError(f"debootstrap of {partial} timed out") from exc
    if proc.returncode != 0 or not _complete_root(partial):
        raise DevBrokerError(
            f"debootstrap of {partial} failed ({proc.returncode}):\n"
            f"{(proc.stderr or proc.stdout)[-2000:]}"
        )
    _remove_root(root)
    partial.rename(root)


def _remove_root(root: Path) -> None:
    """Delete a (partial) root, unmounting first what debootstrap may have left mounted
    in it (/proc, /sys): never recurse into a mounted host file system."""
    if not root.exists():
        return
    prefix = str(root.resolve()) + "/"
    with contextlib.suppress(OSError):
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for point in sorted((m for m in mounts if m.startswith(prefix)), reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    shutil.rmtree(root)


# ----------------------------------------------------------------------------- state


def home_subdir(version: str | None = None) -> str:
    """The folder of ``$AMQP_LOCKS_HOME`` holding the nodes of one RabbitMQ line (their
    data directories cannot be shared between lines)."""
    version = check_version(version or default_version())
    return "broker" if version == HOST_VERSION else f"broker-{version}"


def _default_base_dir(name: str, version: str) -> Path:
    """``$AMQP_LOCKS_HOME/broker/<name>`` (``broker-4.0/<name>`` for the 4.0 line, ...),
    defaulting to the user's cache directory."""
    return home() / home_subdir(version) / name


def _resolve(name: str, base_dir: Path | None, version: str | None = None) -> Path:
    version = check_version(version or default_version())
    return resolve_dir(name, base_dir, lambda: _default_base_dir(name, version), DevBrokerError)


def node_dir(
    name: str = DEFAULT_NAME, base_dir: Path | None = None, version: str | None = None
) -> Path:
    """The node's data directory (where :data:`EXTRA_CONFIG` goes), started or not."""
    return _resolve(name, base_dir, version)


# -------------------------------------------------------------------------- liveness


def _amqp_ping(port: int, timeout: float = 2.0, host: str = HOST) -> bool:
    """True if something on ``port`` answers the AMQP 0-9-1 header with Connection.Start."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_AMQP_HEADER)
            data = b""
            while len(data) < 11:
                chunk = sock.recv(64)
                if not chunk:
                    return False
                data += chunk
    except OSError:
        return False
    # frame type 1 (method) on channel 0, class 10 (connection) method 10 (start)
    return data[0] == 1 and data[1:3] == b"\x00\x00" and data[7:11] == b"\x00\x0a\x00\x0a"


# -------------------------------------------------------------------- process control


def _env(info: NodeInfo) -> dict[str, str]:
    """A clean environment: inherited RABBITMQ_*/NODENAME-style vars must not leak in."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "TMPDIR", "LANG", "LC_ALL")}
    env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    d = info.base_dir
    if info.chrooted:
        env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
        env["ERL_EPMD_PORT"] = str(root_line(info.version).epmd_port)
    if info.epmd_port is not None:
        env["ERL_EPMD_PORT"] = str(info.epmd_port)
    if info.long_name:
        env["RABBITMQ_USE_LONGNAME"] = "true"
    dist_ip = "{" + info.address.replace(".", ",") + "}"
    env.update(
        {
            # The Erlang cookie is read from $HOME: server and CLI share base_dir's.
            "HOME": str(d),
            # An epmd this node starts serves its other address too (peers look it up).
            "ERL_EPMD_ADDRESS": HOST if not info.long_name else f"{HOST},{info.address}",
            "RABBITMQ_NODENAME": info.node,
            "RABBITMQ_NODE_IP_ADDRESS": HOST,
            "RABBITMQ_NODE_PORT": str(info.amqp_port),
            "RABBITMQ_DIST_PORT": str(info.dist_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": f"-kernel inet_dist_use_interface {dist_ip}",
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(info.pid_file),
        }
    )
    return env


def _write_config(info: NodeInfo) -> None:
    d = info.base_dir
    for sub in ("mnesia", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    listeners = f"listeners.tcp.1 = {HOST}:{info.amqp_port}\n"
    if info.long_name:
        # guest over the node's own address too: a private address of a test network (a
        # veth pair to a namespace the tests made), never one of the host's interfaces.
        listeners += f"listeners.tcp.2 = {info.address}:{info.amqp_port}\n"
        listeners += "loopback_users.guest = false\n"
    (d / "rabbitmq.conf").write_text(
        "# Generated by amqp_locks_dev.devbroker; rewritten on every start.\n"
        + listeners
        + f"consumer_timeout = {CONSUMER_TIMEOUT_MS}\n"
        "log.console = false\n"
        "log.file.level = warning\n"
        + (root_line(info.version).config if info.chrooted else "")
        + _extra_config(d)
    )
    (d / "enabled_plugins").write_text("[].\n")
    # Shadows /etc/rabbitmq/rabbitmq-env.conf so system settings cannot leak in.
    (d / "rabbitmq-env.conf").write_text("# intentionally empty\n")
    cookie = d / ".erlang.cookie"
    if not cookie.exists():
        alphabet = string.ascii_uppercase
        cookie.write_text("".join(secrets.choice(alphabet) for _ in range(32)))
        cookie.chmod(0o400)  # Erlang refuses cookies readable by others


#: Settings appended to a node's rabbitmq.conf on every start (`devcluster` writes them).
EXTRA_CONFIG = "extra.conf"


def _extra_config(base_dir: Path) -> str:
    try:
        return (base_dir / EXTRA_CONFIG).read_text()
    except FileNotFoundError:
        return ""


#: Run in a private mount namespace: bind /dev, /proc and the node's directory (same path)
#: into the root, then chroot into it. The mounts vanish with the namespace's last process.
_CHROOT_SCRIPT = (
    "r=$1; b=$2; shift 2; "
    'mount --rbind /dev "$r/dev" && mount -t proc proc "$r/proc" '
    '&& mkdir -p "$r$b" && mount --bind "$b" "$r$b" || exit 125; '
    'exec chroot "$r" "$@"'
)


def _command(info: NodeInfo, program: str, *args: str) -> list[str]:
    """The argv running RabbitMQ's `program` for this node's line."""
    netns = ["ip", "netns", "exec", info.netns] if info.netns else []
    if not info.chrooted:
        return [*netns, str(_require_sbin() / program), *args]
    root = ensure_root(info.version)
    return [
        *netns,
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        _CHROOT_SCRIPT,
        "sh",
        str(root),
        str(info.base_dir),
        str(_CHROOT_SBIN / program),
        *args,
    ]


def _run_ctl(
    info: NodeInfo, args: Sequence[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    cmd = _command(info, "rabbitmqctl", "-n", info.node, *args)
    try:
        return subprocess.run(
            cmd,
            env=_env(info),
            cwd=info.base_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise DevBrokerError(f"rabbitmqctl {' '.join(args)} timed out after {timeout}s") from exc


def rabbitmqctl(info: NodeInfo, *args: str, timeout: float = 60) -> str:
    """Run ``rabbitmqctl -n NODE ARGS`` with the node's cookie and return stdout."""
    proc = _run_ctl(info, args, timeout)
    if proc.returncode != 0:
        raise DevBrokerError(
            f"rabbitmqctl {' '.join(args)} failed ({proc.returncode}):\n"
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc.stdout


#: How a 4.0.5 node's boot fails when its deprecated-feature check loses a race.
DENY_FAILURE = "failed_to_deny_deprecated_features"
#: Boots given to such a node (here and in devcluster).
BOOT_ATTEMPTS = 5


class _Nodes(LocalServer[NodeInfo]):
    """How a private RabbitMQ node is launched, probed and stopped (see LocalServer)."""

    error = DevBrokerError
    poll_interval = 0.2
    avoid_ports = frozenset(
        {*_CTL_DIST_PORTS, _EPMD_PORT, *(line.epmd_port for line in ROOT_LINES.values())}
    )

    def decode(self, base_dir: Path, raw: dict[str, Any]) -> NodeInfo:
        epmd = raw.get("epmd_port")
        return NodeInfo(
            raw["name"],
            int(raw["amqp_port"]),
            int(raw["dist_port"]),
            base_dir,
            str(raw.get("version", HOST_VERSION)),
            str(raw.get("address", HOST)),
            raw.get("netns"),
            int(epmd) if epmd is not None else None,
        )

    def encode(self, info: NodeInfo) -> dict[str, Any]:
        return {
            "name": info.name,
            "node": info.node,
            "amqp_port": info.amqp_port,
            "dist_port": info.dist_port,
            "version": info.version,
            "address": info.address,
            "netns": info.netns,
            "epmd_port": info.epmd_port,
        }

    def ports(self, info: NodeInfo) -> tuple[int, ...]:
        return (info.amqp_port, info.dist_port)

    def with_ports(self, template: NodeInfo, ports: Sequence[int]) -> NodeInfo:
        return replace(template, amqp_port=ports[0], dist_port=ports[1])

    def describe(self, info: NodeInfo) -> str:
        return f"RabbitMQ node {info.node}"

    def needles(self, info: NodeInfo) -> tuple[str, ...]:
        return (info.node, str(info.base_dir))

    def answers(self, info: NodeInfo) -> bool:
        return _amqp_ping(info.amqp_port, host=info.address)

    def same(self, prev: NodeInfo, template: NodeInfo) -> bool:
        if prev.name != template.name:
            return False
        if prev.version != template.version:
            raise DevBrokerError(
                f"{prev.node} in {prev.base_dir} is a RabbitMQ {prev.version} node, not "
                f"{template.version}; its data cannot be shared: use another name or directory"
            )
        return True

    def prepare(self, info: NodeInfo) -> Launch:
        _write_config(info)
        info.pid_file.unlink(missing_ok=True)

        def ready(remaining: float) -> bool:
            # await_startup fails fast until the node has registered with epmd, so poll it.
            if not info.pid_file.exists():
                return False
            ctl = _run_ctl(
                info,
                ["await_startup", "--timeout", str(max(1, int(remaining)))],
                timeout=remaining + 10,
            )
            return ctl.returncode == 0 and _amqp_ping(info.amqp_port, host=info.address)

        return Launch(_command(info, "rabbitmq-server"), _env(info), ready)

    def launched_pid(self, info: NodeInfo, proc: subprocess.Popen[bytes]) -> int:
        pid = self.pid_from_file(info)  # the VM's (the script may have exec'd into it)
        return pid if pid is not None else proc.pid

    def launch(self, info: NodeInfo, wait: float) -> int:
        """Boot the node; a 4.0.5 node configured to deny transient shared queues may fail
        its deprecated-feature check at boot ("failed_to_deny_deprecated_features", seen on
        restarts under load, intermittently) and boots on a later try: give it a few."""
        for attempt in range(BOOT_ATTEMPTS):
            try:
                return super().launch(info, wait)
            except DevBrokerError as e:
                if DENY_FAILURE not in str(e) or attempt == BOOT_ATTEMPTS - 1:
                    raise
                reap(info.base_dir)
                time.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    def graceful_stop(self, info: NodeInfo, pid: int) -> bool:
        # With a pid file, `stop` blocks until the OS process has exited.
        args = ["stop", str(info.pid_file)] if info.pid_file.exists() else ["stop"]
        return _run_ctl(info, args, timeout=120).returncode == 0 and not pid_alive(pid)


#: The private nodes' lifecycle (:mod:`~amqp_locks_dev.devcluster` uses it too).
NODES = _Nodes()


def ledger_server(kind: str | None = None) -> _Nodes:
    """The lifecycle the server ledger's ``amqp_locks_dev.devbroker`` entries name."""
    return NODES


# ------------------------------------------------------------------------------- API


def start(
    name: str = DEFAULT_NAME,
    base_dir: Path | None = None,
    amqp_port: int | None = None,
    wait: float = 60.0,
    version: str | None = None,
) -> NodeInfo:
    """Return the running node, starting it first if needed (idempotent).

    A restarted node reuses its previous ports when they are still free, so URLs
    handed out earlier stay valid; data in ``base_dir`` always survives. `version` is the
    RabbitMQ line (default: ``$AMQP_LOCKS_RABBITMQ``, else 3.10).
    """
    version = check_version(version or default_version())
    ensure_installed(version)
    base = _resolve(name, base_dir, version)
    return NODES.start(NodeInfo(name, 0, 0, base, version), (amqp_port, None), wait)


def stop(
    name: str = DEFAULT_NAME, base_dir: Path | None = None, version: str | None = None
) -> bool:
    """Stop the node if it runs; return whether one was stopped (idempotent)."""
    return NODES.stop(_resolve(name, base_dir, version))


def status(
    name: str = DEFAULT_NAME, base_dir: Path | None = None, version: str | None = None
) -> NodeInfo | None:
    """The running node (answering AMQP), or None; cheap enough to poll."""
    return NODES.status(_resolve(name, base_dir, version))


def restart(
    name: str = DEFAULT_NAME,
    base_dir: Path | None = None,
    wait: float = 60.0,
    version: str | None = None,
) -> NodeInfo:
    """Stop and start on the same ports and data, as a broker restart test needs."""
    base = _resolve(name, base_dir, version)

    def template(prev: NodeInfo | None) -> NodeInfo:
        # A node that ran keeps its line; a new one gets `version` (or the default).
        line = check_version(prev.version if prev is not None else version or default_version())
        ensure_installed(line)
        return NodeInfo(name, 0, 0, base, line)

    return NODES.restart(base, template, wait)


def url(name: str = DEFAULT_NAME, base_dir: Path | None = None, version: str | None = None) -> str:
    """The node's AMQP URL, starting the node if it is not running."""
    return start(name, base_dir, version=version).url


# ------------------------------------------------------------------------------- CLI


#: Seconds `ctl` lets one rabbitmqctl command run.
CTL_TIMEOUT = 600.0


def ctl(argv: Sequence[str]) -> int:
    """``ctl [--name N] [--base-dir D] [--version V] [--] ARGS...``: run the node's
    ``rabbitmqctl ARGS`` (our options only before ARGS); its output and exit status are
    rabbitmqctl's. A node that is not running: exit 3, as ``status`` says it."""
    parser = argparse.ArgumentParser(
        prog="scripts/broker ctl",
        description="Run rabbitmqctl against the private node (its cookie, its RabbitMQ line).",
    )
    parser.add_argument("--name", default=DEFAULT_NAME, help="node name (default: %(default)s)")
    parser.add_argument("--base-dir", type=Path, default=None, help="node directory")
    parser.add_argument(
        "--version",
        choices=VERSIONS,
        default=None,
        help=f"RabbitMQ line (default: $AMQP_LOCKS_RABBITMQ, else {HOST_VERSION})",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="rabbitmqctl's arguments")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if not args:
        parser.error("missing rabbitmqctl arguments (e.g. list_queues name messages)")

    def run() -> int:
        info = status(ns.name, ns.base_dir, version=ns.version)
        if info is None:
            line = f" --version {ns.version}" if ns.version else ""
            print(f"not running (start it: scripts/broker start{line})", file=sys.stderr)
            return 3
        proc = _run_ctl(info, args, CTL_TIMEOUT)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        return proc.returncode

    return guarded(run, DevBrokerError)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; ``start``/``url`` print only the URL so ``$(...)`` captures it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:
        return ctl(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m amqp_locks_dev.devbroker", description="Private RabbitMQ node on 127.0.0.1."
    )
    commands = Commands(
        start=lambda a: start(a.name, a.base_dir, a.port, a.wait, version=a.version),
        restart=lambda a: restart(a.name, a.base_dir, a.wait, version=a.version),
        stop=lambda a: stop(a.name, a.base_dir, version=a.version),
        status=lambda a: status(a.name, a.base_dir, version=a.version),
    )
    return cli(
        argv,
        parser,
        commands,
        DevBrokerError,
        default_name=DEFAULT_NAME,
        what="node",
        port_help="AMQP port for start",
        arguments=lambda p: p.add_argument(
            "--version",
            choices=VERSIONS,
            default=None,
            help=f"RabbitMQ line (default: $AMQP_LOCKS_RABBITMQ, else {HOST_VERSION})",
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
