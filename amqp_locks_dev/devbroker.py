"""A private RabbitMQ node on 127.0.0.1 for development, tests, demos and CI.

Each node lives entirely in its own ``base_dir`` (config, Erlang cookie, data, logs,
``node.json`` state), listens on loopback only and runs as the invoking user, so
several nodes can run side by side without touching a system-wide RabbitMQ.

We call the real scripts in ``/usr/lib/rabbitmq/bin`` rather than Debian's
``/usr/sbin`` wrappers: those ``su`` to the ``rabbitmq`` user, which then needs to
own (and traverse to) every directory, and they redirect output to
``/var/log/rabbitmq``.  Running as the invoking user works for root and non-root
alike; ``HOME=base_dir`` gives the server and ``rabbitmqctl`` the same cookie.

Two RabbitMQ lines can run here (``$AMQP_LOCKS_RABBITMQ`` or ``version=`` picks one):

- ``3.10``: Debian 12's ``rabbitmq-server`` (3.10.8, Erlang 25) from the host's packages;
- ``4.0``: Debian 13's ``rabbitmq-server`` (4.0.5, Erlang 27). Erlang 25 is too old for it,
  so it runs inside a minimal trixie root built once per machine with ``debootstrap``
  from Debian's packages (``$AMQP_LOCKS_ROOTS``, default ``/var/cache/amqp-locks``) and
  entered with ``chroot`` in a private mount namespace (``unshare``) that binds /dev,
  /proc and the node's own directory; its Erlang nodes use their own epmd port. The node
  is configured with RabbitMQ 4.3's defaults: transient non-exclusive queues and global
  QoS are denied (``deprecated_features.permit.* = false``). Needs root.

CLI: ``python -m amqp_locks_dev.devbroker start|stop|status|restart|url [--name NAME]
[--version 3.10|4.0]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .localserver import cmdline_mentions, write_state
from .localserver import locked as _locked
from .localserver import pid_alive as _pid_alive
from .localserver import port_free as _port_free
from .localserver import tail as _tail

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
HOST = "127.0.0.1"
#: Long lock holds keep token messages unacked for hours; RabbitMQ's default
#: consumer_timeout (30 min) would close the channel and silently drop the lock.
CONSUMER_TIMEOUT_MS = 365 * 24 * 3600 * 1000
#: rabbitmqctl's own distribution listener uses this range; never hand it out.
_CTL_DIST_PORTS = range(35672, 35683)
_EPMD_PORT = 4369
_SBIN_CANDIDATES = (Path("/usr/lib/rabbitmq/bin"),)
#: The RabbitMQ lines a private node can run, and the default one.
VERSIONS = ("3.10", "4.0")
HOST_VERSION = "3.10"
#: Where the trixie root of the 4.0 line is built (once per machine).
_ROOTS_ENV = "AMQP_LOCKS_ROOTS"
_DEFAULT_ROOTS = Path("/var/cache/amqp-locks")
_DEBIAN_MIRROR = "http://deb.debian.org/debian"
_CHROOT_SBIN = Path("/usr/lib/rabbitmq/bin")
#: Erlang nodes of the chrooted line register with their own epmd (its Erlang is newer).
_CHROOT_EPMD_PORT = 4370
#: RabbitMQ 4.3's defaults that 4.0.5 only has as opt-in denials.
_DEFAULTS_OF_4_3 = (
    "deprecated_features.permit.transient_nonexcl_queues = false\n"
    "deprecated_features.permit.global_qos = false\n"
)
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_AMQP_HEADER = b"AMQP\x00\x00\x09\x01"

# Server processes started by this interpreter, so they can be reaped after a stop
# (avoids zombies and "subprocess still running" ResourceWarnings).
_children: dict[Path, subprocess.Popen[bytes]] = {}


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


def trixie_root() -> Path:
    """The Debian 13 root that holds RabbitMQ 4.0.5 (see :func:`ensure_trixie_root`)."""
    roots = Path(os.environ.get(_ROOTS_ENV) or _DEFAULT_ROOTS)
    return roots / "rabbitmq-4.0-trixie"


@dataclass(frozen=True)
class NodeInfo:
    """Where a private node lives and listens; enough to talk to it or restart it."""

    name: str
    amqp_port: int
    dist_port: int
    base_dir: Path
    #: The RabbitMQ line (``3.10`` or ``4.0``; see the module docstring).
    version: str = HOST_VERSION

    @property
    def chrooted(self) -> bool:
        return self.version != HOST_VERSION

    @property
    def node(self) -> str:
        """Erlang node name; ``localhost`` keeps distribution independent of DNS."""
        return f"{self.name}@localhost"

    @property
    def url(self) -> str:
        """AMQP URL for the default vhost; guest is allowed because we use loopback."""
        return f"amqp://guest:guest@{HOST}:{self.amqp_port}/%2F"

    @property
    def pid_file(self) -> Path:
        return self.base_dir / "rabbitmq.pid"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "log" / f"{self.node}.log"

    @property
    def startup_log(self) -> Path:
        return self.base_dir / "startup.log"


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


def _apt_install(package: str) -> None:
    """``apt-get install`` one Debian package with no service started by it."""
    if os.geteuid() != 0:
        raise DevBrokerError(
            f"{package} is not installed and we are not root; "
            f"run: sudo apt-get install -y {package}"
        )
    if shutil.which("apt-get") is None:
        raise DevBrokerError(f"{package} is not installed and apt-get is unavailable")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():
        policy.write_text(
            "#!/bin/sh\n# amqp_locks_dev.devbroker: no services during install\nexit 101\n"
        )
        policy.chmod(0o755)
        made_policy = True
    try:
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", package]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise DevBrokerError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)


def ensure_installed(version: str | None = None) -> None:
    """Make the RabbitMQ line `version` runnable here (default: :func:`default_version`).

    3.10: install Debian's rabbitmq-server if missing, without leaving a system node up
    (only the binaries are wanted: the package's service is kept from starting by
    policy-rc.d and stopped if it started anyway). 4.0: :func:`ensure_trixie_root`.
    """
    if check_version(version or default_version()) != HOST_VERSION:
        ensure_trixie_root()
        return
    if _sbin_dir() is not None:
        return
    _apt_install("rabbitmq-server")
    # Belt and braces: if postinst started the default node anyway, stop it. Its CLI
    # wrapper su's to the rabbitmq user and so uses that user's cookie.
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run([ctl, "-q", "stop"], capture_output=True, timeout=60, check=False)
    if _sbin_dir() is None:
        raise DevBrokerError("apt-get installed rabbitmq-server but its scripts were not found")


_ROOT_READY = ".amqp-locks-root-ready"


def ensure_trixie_root() -> Path:
    """Build the Debian 13 root holding rabbitmq-server 4.0.5 unless it exists (once per
    machine, about a minute): ``debootstrap --variant=minbase --include=rabbitmq-server
    trixie`` from Debian's mirror (``$AMQP_LOCKS_DEBIAN_MIRROR``). Needs root."""
    root = trixie_root()
    if (root / _ROOT_READY).exists():
        return root
    if os.geteuid() != 0:
        raise DevBrokerError(
            f"RabbitMQ 4.0 runs in a Debian 13 root ({root}) built with debootstrap and "
            "entered with chroot: both need root"
        )
    with _locked(root.parent / ".build-lock"):
        if (root / _ROOT_READY).exists():
            return root
        if shutil.which("debootstrap") is None:
            _apt_install("debootstrap")
        partial = root.with_name(root.name + ".partial")
        _remove_root(partial)
        mirror = os.environ.get("AMQP_LOCKS_DEBIAN_MIRROR") or _DEBIAN_MIRROR
        cmd = [
            "debootstrap", "--variant=minbase", "--include=rabbitmq-server",
            "trixie", str(partial), mirror,
        ]
        print(f"building the RabbitMQ 4.0 root: {' '.join(cmd)}", file=sys.stderr)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        except subprocess.TimeoutExpired as exc:
            raise DevBrokerError(f"debootstrap of {partial} timed out") from exc
        server = partial / str(_CHROOT_SBIN).lstrip("/") / "rabbitmq-server"
        if proc.returncode != 0 or not server.exists():
            raise DevBrokerError(
                f"debootstrap of {partial} failed ({proc.returncode}):\n"
                f"{(proc.stderr or proc.stdout)[-2000:]}"
            )
        _remove_root(root)
        partial.rename(root)
        (root / _ROOT_READY).write_text(f"built by amqp_locks_dev.devbroker from {mirror}\n")
    return root


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
    """``$AMQP_LOCKS_HOME/broker/<name>`` (``broker-4.0/<name>`` for the 4.0 line),
    defaulting to the user's cache directory."""
    home = os.environ.get("AMQP_LOCKS_HOME")
    if home:
        root = Path(home)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(cache) / "amqp-locks"
    return root / home_subdir(version) / name


def _resolve(name: str, base_dir: Path | None, version: str | None = None) -> Path:
    if not _NAME_RE.match(name):
        raise DevBrokerError(f"invalid node name {name!r}: use letters, digits, _ and -")
    version = check_version(version or default_version())
    return (base_dir or _default_base_dir(name, version)).expanduser().resolve()


def _read_state(base_dir: Path) -> tuple[NodeInfo, int | None] | None:
    try:
        raw = json.loads((base_dir / "node.json").read_text())
        info = NodeInfo(
            raw["name"],
            int(raw["amqp_port"]),
            int(raw["dist_port"]),
            base_dir,
            str(raw.get("version", HOST_VERSION)),
        )
        pid = raw.get("pid")
        # pid is None while a start is in flight; the server's pid file then knows.
        return info, (int(pid) if pid is not None else _pid_from_file(info))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_state(info: NodeInfo, pid: int | None) -> None:
    data = {
        "name": info.name,
        "node": info.node,
        "amqp_port": info.amqp_port,
        "dist_port": info.dist_port,
        "pid": pid,
        "url": info.url,
        "version": info.version,
    }
    write_state(info.base_dir, data)


# -------------------------------------------------------------------------- liveness


def _is_our_beam(info: NodeInfo, pid: int | None) -> bool:
    """The pid is alive and is this node's VM (guards against pid reuse)."""
    return (
        pid is not None and _pid_alive(pid) and cmdline_mentions(pid, info.node, str(info.base_dir))
    )


def _amqp_ping(port: int, timeout: float = 2.0) -> bool:
    """True if something on ``port`` answers the AMQP 0-9-1 header with Connection.Start."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
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


def _running(info: NodeInfo, pid: int | None) -> bool:
    return _is_our_beam(info, pid) and _amqp_ping(info.amqp_port)


def _pid_from_file(info: NodeInfo) -> int | None:
    try:
        return int(info.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ ports


def _free_ports(count: int) -> list[int]:
    """Ports the kernel considers free now (held together so they are distinct)."""
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
            if port not in _CTL_DIST_PORTS and port not in (_EPMD_PORT, _CHROOT_EPMD_PORT):
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


def _pick_ports(
    prev: NodeInfo | None, amqp_port: int | None, dist_port: int | None, strict: bool
) -> tuple[int, int]:
    """Prefer explicit ports, then the previous run's (stable URL), then fresh ones."""
    want_amqp = amqp_port or (prev.amqp_port if prev else None)
    want_dist = dist_port or (prev.dist_port if prev else None)
    fresh = _free_ports(2)
    ports: list[int] = []
    for wanted, explicit, spare in (
        (want_amqp, amqp_port, fresh[0]),
        (want_dist, dist_port, fresh[1]),
    ):
        if wanted is not None and _port_free(wanted):
            ports.append(wanted)
        elif wanted is not None and (strict or explicit):
            raise DevBrokerError(f"port {wanted} on {HOST} is already in use")
        else:
            ports.append(spare)
    if ports[0] == ports[1]:
        raise DevBrokerError(f"AMQP and distribution ports must differ (got {ports[0]})")
    return ports[0], ports[1]


# -------------------------------------------------------------------- process control


def _env(info: NodeInfo) -> dict[str, str]:
    """A clean environment: inherited RABBITMQ_*/NODENAME-style vars must not leak in."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "TMPDIR", "LANG", "LC_ALL")}
    env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    d = info.base_dir
    if info.chrooted:
        env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
        env["ERL_EPMD_PORT"] = str(_CHROOT_EPMD_PORT)
    env.update(
        {
            # The Erlang cookie is read from $HOME: server and CLI share base_dir's.
            "HOME": str(d),
            "ERL_EPMD_ADDRESS": HOST,
            "RABBITMQ_NODENAME": info.node,
            "RABBITMQ_NODE_IP_ADDRESS": HOST,
            "RABBITMQ_NODE_PORT": str(info.amqp_port),
            "RABBITMQ_DIST_PORT": str(info.dist_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
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
    (d / "rabbitmq.conf").write_text(
        "# Generated by amqp_locks_dev.devbroker; rewritten on every start.\n"
        f"listeners.tcp.1 = {HOST}:{info.amqp_port}\n"
        f"consumer_timeout = {CONSUMER_TIMEOUT_MS}\n"
        "log.console = false\n"
        "log.file.level = warning\n"
        + (_DEFAULTS_OF_4_3 if info.chrooted else "")
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
    'r=$1; b=$2; shift 2; '
    'mount --rbind /dev "$r/dev" && mount -t proc proc "$r/proc" '
    '&& mkdir -p "$r$b" && mount --bind "$b" "$r$b" || exit 125; '
    'exec chroot "$r" "$@"'
)


def _command(info: NodeInfo, program: str, *args: str) -> list[str]:
    """The argv running RabbitMQ's `program` for this node's line."""
    if not info.chrooted:
        return [str(_require_sbin() / program), *args]
    root = ensure_trixie_root()
    return [
        "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _CHROOT_SCRIPT,
        "sh", str(root), str(info.base_dir), str(_CHROOT_SBIN / program), *args,
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


def _failure(info: NodeInfo, why: str) -> DevBrokerError:
    return DevBrokerError(
        f"RabbitMQ node {info.node} {why}.\n"
        f"--- {info.startup_log} ---\n{_tail(info.startup_log)}\n"
        f"--- {info.log_file} ---\n{_tail(info.log_file)}"
    )


def _launch(info: NodeInfo, wait: float) -> int:
    """Start the VM in its own session and block until it accepts AMQP; return its pid."""
    _write_config(info)
    info.pid_file.unlink(missing_ok=True)
    with info.startup_log.open("wb") as log:
        proc = subprocess.Popen(
            _command(info, "rabbitmq-server"),
            env=_env(info),
            cwd=info.base_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives our exit and Ctrl-C in the terminal
        )
    _children[info.base_dir] = proc
    deadline = time.monotonic() + wait
    # await_startup fails fast until the node has registered with epmd, so poll it.
    while True:
        if proc.poll() is not None:
            raise _failure(info, f"exited during startup (code {proc.returncode})")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _kill(info, _pid_from_file(info))
            raise _failure(info, f"did not start within {wait:.0f}s")
        if info.pid_file.exists():
            ctl = _run_ctl(
                info,
                ["await_startup", "--timeout", str(max(1, int(remaining)))],
                timeout=remaining + 10,
            )
            if ctl.returncode == 0 and _amqp_ping(info.amqp_port):
                break
        time.sleep(0.2)
    pid = _pid_from_file(info)
    return pid if pid is not None else proc.pid


def _kill(info: NodeInfo, pid: int | None, grace: float = 30.0) -> None:
    """Last resort when the CLI cannot reach the node: SIGTERM, then SIGKILL."""
    if pid is None or not _is_our_beam(info, pid):
        return
    for sig, budget in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        end = time.monotonic() + budget
        while time.monotonic() < end:
            if not _pid_alive(pid):
                return
            time.sleep(0.1)


def _reap(base_dir: Path) -> None:
    proc = _children.pop(base_dir, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


# ------------------------------------------------------------------------------- API


def _status(base_dir: Path) -> NodeInfo | None:
    state = _read_state(base_dir)
    if state is None:
        return None
    info, pid = state
    return info if _running(info, pid) else None


def _start(
    name: str,
    base_dir: Path,
    amqp_port: int | None,
    dist_port: int | None,
    wait: float,
    strict: bool,
    version: str | None = None,
) -> NodeInfo:
    version = check_version(version or default_version())
    state = _read_state(base_dir)
    prev = state[0] if state and state[0].name == name else None
    if prev is not None and prev.version != version:
        raise DevBrokerError(
            f"{prev.node} in {base_dir} is a RabbitMQ {prev.version} node, not {version}; "
            "its data cannot be shared: use another name or directory"
        )
    if state is not None and prev is not None and _running(prev, state[1]):
        if amqp_port is not None and amqp_port != prev.amqp_port:
            raise DevBrokerError(
                f"{prev.node} is already running on port {prev.amqp_port}; stop it first"
            )
        return prev
    if state is not None:
        # A VM we started earlier that no longer answers (hung or half-booted).
        _kill(state[0], state[1])
        _reap(base_dir)
    ports = _pick_ports(prev, amqp_port, dist_port, strict)
    info = NodeInfo(
        name=name, amqp_port=ports[0], dist_port=ports[1], base_dir=base_dir, version=version
    )
    _write_state(info, None)
    pid = _launch(info, wait)
    _write_state(info, pid)
    return info


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
    with _locked(base):
        return _start(name, base, amqp_port, None, wait, strict=False, version=version)


def _stop(base_dir: Path) -> bool:
    state = _read_state(base_dir)
    if state is None:
        return False
    info, pid = state
    if not _is_our_beam(info, pid):
        _reap(base_dir)
        return False
    # With a pid file, `stop` blocks until the OS process has exited.
    args = ["stop", str(info.pid_file)] if info.pid_file.exists() else ["stop"]
    proc = _run_ctl(info, args, timeout=120)
    if proc.returncode != 0 or _pid_alive(pid):
        _kill(info, pid)
    _reap(base_dir)
    if _pid_alive(pid):
        raise DevBrokerError(f"could not stop {info.node} (pid {pid})")
    _write_state(info, None)
    return True


def stop(
    name: str = DEFAULT_NAME, base_dir: Path | None = None, version: str | None = None
) -> bool:
    """Stop the node if it runs; return whether one was stopped (idempotent)."""
    base = _resolve(name, base_dir, version)
    with _locked(base):
        return _stop(base)


def status(
    name: str = DEFAULT_NAME, base_dir: Path | None = None, version: str | None = None
) -> NodeInfo | None:
    """The running node (answering AMQP), or None; cheap enough to poll."""
    return _status(_resolve(name, base_dir, version))


def restart(
    name: str = DEFAULT_NAME,
    base_dir: Path | None = None,
    wait: float = 60.0,
    version: str | None = None,
) -> NodeInfo:
    """Stop and start on the same ports and data, as a broker restart test needs."""
    base = _resolve(name, base_dir, version)
    with _locked(base):
        state = _read_state(base)
        # A node that ran keeps its line; a new one gets `version` (or the default).
        version = state[0].version if state is not None else version
        ensure_installed(version)
        _stop(base)
        if state is None:
            return _start(name, base, None, None, wait, strict=False, version=version)
        prev = state[0]
        return _start(
            name, base, prev.amqp_port, prev.dist_port, wait, strict=True, version=version
        )


def url(name: str = DEFAULT_NAME, base_dir: Path | None = None, version: str | None = None) -> str:
    """The node's AMQP URL, starting the node if it is not running."""
    return start(name, base_dir, version=version).url


# ------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; ``start``/``url`` print only the URL so ``$(...)`` captures it."""
    parser = argparse.ArgumentParser(
        prog="python -m amqp_locks_dev.devbroker", description="Private RabbitMQ node on 127.0.0.1."
    )
    parser.add_argument("command", choices=["start", "stop", "status", "restart", "url"])
    parser.add_argument("--name", default=DEFAULT_NAME, help="node name (default: %(default)s)")
    parser.add_argument("--base-dir", type=Path, default=None, help="node directory")
    parser.add_argument("--port", type=int, default=None, help="AMQP port for start")
    parser.add_argument("--wait", type=float, default=60.0, help="startup timeout (s)")
    parser.add_argument(
        "--version", choices=VERSIONS, default=None,
        help=f"RabbitMQ line (default: $AMQP_LOCKS_RABBITMQ, else {HOST_VERSION})",
    )
    args = parser.parse_args(argv)
    v = args.version
    try:
        if args.command in ("start", "url"):
            print(start(args.name, args.base_dir, args.port, args.wait, version=v).url)
        elif args.command == "restart":
            print(restart(args.name, args.base_dir, args.wait, version=v).url)
        elif args.command == "stop":
            stopped = stop(args.name, args.base_dir, version=v)
            print("stopped" if stopped else "not running", file=sys.stderr)
        else:
            info = status(args.name, args.base_dir, version=v)
            if info is None:
                print("not running")
                return 3
            print(info.url)
    except DevBrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
