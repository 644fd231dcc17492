"""One shared base for "a private server on loopback" (:mod:`~amqp_locks_dev.devbroker`,
:mod:`~amqp_locks_dev.devdb`, :mod:`~amqp_locks_dev.devcluster`).

A server lives entirely in its own ``base_dir``: a ``node.json`` state file (ports, pid,
URL) that lets separate processes (``scripts/``, test runs, benchmarks) find and reuse a
running server, a ``.lock`` file that serialises its start and stop across processes,
and its logs. :class:`LocalServer` does the lifecycle every kind of server shares: pick
ports (the previous run's first, so URLs stay valid), launch and wait for it with a
deadline (the log tails in the error), stop it gracefully, then SIGTERM/SIGKILL, reap it,
crash it for fault tests; :func:`cli` is the ``start|stop|status|restart|url`` command
line. A subclass says how its kind is launched, probed and stopped.

Why not mirakuru (or the pytest-rabbitmq/-postgresql/-mysql executors built on it): an
executor keeps the server's process in the Python object that started it, so a server
started by ``scripts/broker``, a benchmark or another test process cannot be found,
probed or stopped through it; the state file, the lock and the re-attach would stay ours,
as would the launch itself (the unwrapped RabbitMQ scripts instead of Debian's ``su``
wrappers, the 4.0 line's ``unshare``+``chroot``, ``rabbitmqctl stop``, PostgreSQL as
``postgres``). What it would take over is one ``Popen`` and a polling loop.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, cast

HOST = "127.0.0.1"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
STATE_FILE = "node.json"


def pid_alive(pid: int | None) -> bool:
    """The process exists and is not a zombie (a zombie is dead for our purposes)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text()
        return fields.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def cmdline_mentions(pid: int, *needles: str) -> bool:
    """Whether the process's command line names one of `needles` (guards against pid
    reuse); True where /proc is missing (the pid is trusted then)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return any(n.encode() in cmdline for n in needles)


def _children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (PostgreSQL backends setsid(), so killpg misses them)."""
    kids: list[int] = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(entry.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.parent.name))
    return kids


def signal_and_wait(pid: int, sig: int, grace: float, *, tree: bool = False) -> bool:
    """Send ``sig`` (also to direct children if ``tree``) and wait; True once all are gone."""
    pids = [pid, *(_children_of(pid) if tree else [])]
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return not any(pid_alive(p) for p in pids)


@contextlib.contextmanager
def locked(base_dir: Path) -> Iterator[None]:
    """Serialise start/stop of one server across processes (e.g. parallel test runs)."""
    base_dir.mkdir(parents=True, exist_ok=True)
    with (base_dir / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """Ports the kernel considers free now (held together so they are distinct)."""
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


def write_state(base_dir: Path, data: dict[str, Any]) -> None:
    """Write `node.json` atomically (a reader never sees half a file)."""
    tmp = base_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(base_dir / STATE_FILE)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def home() -> Path:
    """``$AMQP_LOCKS_HOME``, defaulting to ``amqp-locks`` in the user's cache directory."""
    env = os.environ.get("AMQP_LOCKS_HOME")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "amqp-locks"


def resolve_dir(
    name: str, base_dir: Path | None, default: Callable[[], Path], error: type[Exception]
) -> Path:
    """The absolute directory of server `name` (`base_dir`, else `default()`)."""
    if not _NAME_RE.match(name):
        raise error(f"invalid name {name!r}: use letters, digits, _ and -")
    return (base_dir or default()).expanduser().resolve()


def apt_install(package: str, error: type[Exception], who: str) -> None:
    """``apt-get install`` one Debian package with no service started by it (only its
    binaries are wanted: policy-rc.d keeps the package's service from starting)."""
    if os.geteuid() != 0:
        raise error(
            f"{package} is not installed and we are not root; "
            f"run: sudo apt-get install -y {package}"
        )
    if shutil.which("apt-get") is None:
        raise error(f"{package} is not installed and apt-get is unavailable")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():
        policy.write_text(f"#!/bin/sh\n# {who}: no services during install\nexit 101\n")
        policy.chmod(0o755)
        made_policy = True
    try:
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", package]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise error(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- ledger

#: A file where every server this process (and its children) starts or finds running is
#: noted, once per server directory: what ``scripts/test`` stops at the end of a run
#: (:mod:`~amqp_locks_dev.servers`), leaving alone the servers that ran before it.
LEDGER_ENV = "AMQP_LOCKS_SERVER_LEDGER"
#: A server this run launched (stopped at the end), or one it found running (left alone).
STARTED, FOUND = "started", "found"


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The ledger's entries, in order (a torn last line is skipped)."""
    entries: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
    return entries


def note(entry: dict[str, Any], key: str, ledger: Path | None = None) -> None:
    """Append `entry` to `ledger` (default: the one ``$AMQP_LOCKS_SERVER_LEDGER`` names)
    unless an entry with the same `key` field value is there already: the first sighting
    of a server decides whether the run started it. No ledger, no note."""
    named = ledger or os.environ.get(LEDGER_ENV)
    if not named:
        return
    path = Path(named)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # several processes of one run note at once
        try:
            fh.seek(0)
            for line in fh.read().splitlines():
                with contextlib.suppress(ValueError):
                    if json.loads(line).get(key) == entry[key]:
                        return
            fh.seek(0, os.SEEK_END)
            fh.write(json.dumps(entry) + "\n")
            fh.flush()
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# -------------------------------------------------------------------------- lifecycle


class ServerInfo(ABC):
    """Base of a kind's description of one server (a frozen dataclass with a ``base_dir``
    field): where the lifecycle finds its URL, pid file and logs."""

    base_dir: Path

    @property
    @abstractmethod
    def url(self) -> str: ...

    @property
    @abstractmethod
    def pid_file(self) -> Path: ...

    @property
    @abstractmethod
    def log_file(self) -> Path: ...

    @property
    def startup_log(self) -> Path:
        """The server's stdout and stderr."""
        return self.base_dir / "startup.log"


InfoT = TypeVar("InfoT", bound=ServerInfo)


@dataclass
class Launch:
    """How to run a prepared server: its argv and environment, ``ready(seconds_left)``
    (True once it serves), and extra ``subprocess.Popen`` arguments (e.g. its user)."""

    argv: list[str]
    env: dict[str, str]
    ready: Callable[[float], bool]
    popen: dict[str, Any] = field(default_factory=dict)


# Servers started by this interpreter, reaped after a stop (no zombies/ResourceWarnings).
_children: dict[Path, subprocess.Popen[bytes]] = {}


def reap(base_dir: Path) -> None:
    proc = _children.pop(base_dir, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


class LocalServer(ABC, Generic[InfoT]):
    """The lifecycle of one kind of private server; ``InfoT`` describes one server.

    The ``*_unlocked`` methods expect the caller to hold :func:`locked` on the server's
    directory; :meth:`start`, :meth:`stop`, :meth:`restart` and :meth:`kill` take it.
    """

    #: The error this kind raises (a RuntimeError subclass of its module).
    error: ClassVar[type[RuntimeError]] = RuntimeError
    #: Seconds between readiness probes while a server starts.
    poll_interval: ClassVar[float] = 0.1
    #: The default graceful stop: this signal, then waiting this long.
    stop_signal: int = signal.SIGTERM
    stop_grace: ClassVar[float] = 60.0
    #: After a failed graceful stop: these signals in turn, each waited on that long.
    hard_signals: ClassVar[tuple[tuple[int, float], ...]] = (
        (signal.SIGTERM, 30.0),
        (signal.SIGKILL, 5.0),
    )
    #: Whether a hard stop or a kill also signals the server's direct children.
    kill_tree: ClassVar[bool] = False
    #: Ports never to hand out (e.g. epmd's).
    avoid_ports: ClassVar[frozenset[int]] = frozenset()

    # ---- what a kind says about itself

    @abstractmethod
    def decode(self, base_dir: Path, raw: dict[str, Any]) -> InfoT | None:
        """The server a state file describes (None if it is not one of this kind)."""

    @abstractmethod
    def encode(self, info: InfoT) -> dict[str, Any]:
        """The state file's fields for `info` (the base adds ``pid``)."""

    @abstractmethod
    def ports(self, info: InfoT) -> tuple[int, ...]:
        """The TCP ports `info` listens on, in the order :meth:`with_ports` takes them."""

    @abstractmethod
    def with_ports(self, template: InfoT, ports: Sequence[int]) -> InfoT:
        """`template` listening on `ports`."""

    @abstractmethod
    def describe(self, info: InfoT) -> str:
        """How errors name the server (``RabbitMQ node x@localhost``)."""

    @abstractmethod
    def answers(self, info: InfoT) -> bool:
        """A cheap protocol-level probe: the server serves on its port."""

    @abstractmethod
    def prepare(self, info: InfoT) -> Launch:
        """Write the server's files (config, data directory) and say how to launch it."""

    def needles(self, info: InfoT) -> tuple[str, ...]:
        """What the server's command line names (guards against pid reuse)."""
        return (str(info.base_dir),)

    def launched_pid(self, info: InfoT, proc: subprocess.Popen[bytes]) -> int:
        """The server's pid once it is ready (the Popen's by default)."""
        return proc.pid

    def same(self, prev: InfoT, template: InfoT) -> bool:
        """Whether the recorded server `prev` is the one asked for (may raise if it
        cannot be: different data layouts)."""
        return True

    def graceful_stop(self, info: InfoT, pid: int) -> bool:
        """Ask the server to stop; True once it is gone."""
        return signal_and_wait(pid, self.stop_signal, self.stop_grace)

    def ledger_id(self) -> str:
        """How the ledger names this kind: ``module`` or ``module:kind``, whose
        ``ledger_server(kind)`` gives this object back in another process."""
        return type(self).__module__

    def _note(self, base_dir: Path, how: str) -> None:
        note({"server": self.ledger_id(), "base_dir": str(base_dir), "how": how}, "base_dir")

    # ---- shared

    def pid_from_file(self, info: InfoT) -> int | None:
        try:
            return int(info.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def read_state(self, base_dir: Path) -> tuple[InfoT, int | None] | None:
        try:
            raw = json.loads((base_dir / STATE_FILE).read_text())
            info = self.decode(base_dir, raw)
            if info is None:
                return None
            pid = raw.get("pid")
            # pid is None while a start is in flight or after a stop; the pid file knows.
            return info, (int(pid) if pid is not None else self.pid_from_file(info))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_state(self, info: InfoT, pid: int | None) -> None:
        write_state(info.base_dir, {**self.encode(info), "pid": pid, "url": info.url})

    def is_ours(self, info: InfoT, pid: int | None) -> bool:
        """The pid is alive and is this server's (guards against pid reuse)."""
        return pid is not None and pid_alive(pid) and cmdline_mentions(pid, *self.needles(info))

    def running(self, info: InfoT, pid: int | None) -> bool:
        return self.is_ours(info, pid) and self.answers(info)

    def status(self, base_dir: Path) -> InfoT | None:
        """The running server (answering its protocol), or None; cheap enough to poll."""
        state = self.read_state(base_dir)
        return state[0] if state is not None and self.running(*state) else None

    def failure(self, info: InfoT, why: str) -> RuntimeError:
        logs = dict.fromkeys([info.startup_log, info.log_file])
        tails = "".join(f"\n--- {log} ---\n{tail(log)}" for log in logs)
        return self.error(f"{self.describe(info)} {why}.{tails}")

    def pick_ports(
        self, prev: InfoT | None, explicit: Sequence[int | None], strict: bool
    ) -> list[int]:
        """Prefer explicit ports, then the previous run's (stable URLs), then fresh ones;
        with `strict` (or an explicit port) a wanted port in use is an error."""
        before = self.ports(prev) if prev is not None else (None,) * len(explicit)
        fresh = free_ports(len(explicit), self.avoid_ports)
        ports: list[int] = []
        for port, old, spare in zip(explicit, before, fresh, strict=True):
            wanted = port or old
            if wanted is not None and port_free(wanted):
                ports.append(wanted)
            elif wanted is not None and (strict or port):
                raise self.error(f"port {wanted} on {HOST} is already in use")
            else:
                ports.append(spare)
        if len(set(ports)) != len(ports):
            raise self.error(f"the ports of one server must differ (got {ports})")
        return ports

    def hard_stop(self, info: InfoT, pid: int | None) -> None:
        """SIGTERM then SIGKILL (:attr:`hard_signals`), until the process is gone."""
        if pid is None:
            return
        for sig, grace in self.hard_signals:
            if signal_and_wait(pid, sig, grace, tree=self.kill_tree):
                return

    def launch(self, info: InfoT, wait: float) -> int:
        """Start the server in its own session and block until it is ready; its pid."""
        how = self.prepare(info)
        with info.startup_log.open("wb") as log:
            proc = subprocess.Popen(
                how.argv,
                env=how.env,
                cwd=info.base_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives our exit and Ctrl-C in the terminal
                **how.popen,
            )
        _children[info.base_dir] = proc
        deadline = time.monotonic() + wait
        while True:
            if proc.poll() is not None:
                raise self.failure(info, f"exited during startup (code {proc.returncode})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.hard_stop(info, self.launched_pid(info, proc))
                reap(info.base_dir)
                raise self.failure(info, f"did not start within {wait:.0f}s")
            if how.ready(remaining):
                return self.launched_pid(info, proc)
            time.sleep(self.poll_interval)

    def start_unlocked(
        self, template: InfoT, explicit: Sequence[int | None], wait: float, strict: bool
    ) -> InfoT:
        """The running server, else `template` started on the previous run's ports."""
        base_dir = template.base_dir
        state = self.read_state(base_dir)
        prev = state[0] if state is not None and self.same(state[0], template) else None
        if state is not None and prev is not None and self.running(prev, state[1]):
            self._note(base_dir, FOUND)
            ports = self.ports(prev)
            if any(p is not None and p != q for p, q in zip(explicit, ports, strict=True)):
                raise self.error(
                    f"{self.describe(prev)} already runs on port {ports[0]}; stop it first"
                )
            return prev
        if state is not None:
            # A server we started earlier that no longer answers (hung or half-booted).
            if self.is_ours(*state):
                self._note(base_dir, FOUND)  # it ran before: the run leaves it running
                self.hard_stop(*state)
            reap(base_dir)
        self._note(base_dir, STARTED)
        info = self.with_ports(template, self.pick_ports(prev, explicit, strict))
        self.write_state(info, None)
        pid = self.launch(info, wait)
        self.write_state(info, pid)
        return info

    def start(self, template: InfoT, explicit: Sequence[int | None], wait: float) -> InfoT:
        """Return the running server, starting it first if needed (idempotent)."""
        with locked(template.base_dir):
            return self.start_unlocked(template, explicit, wait, strict=False)

    def stop_unlocked(self, base_dir: Path) -> bool:
        state = self.read_state(base_dir)
        if state is None:
            return False
        info, pid = state
        if pid is None or not self.is_ours(info, pid):
            reap(base_dir)
            return False
        self._note(base_dir, FOUND)  # first seen running: not this run's to stop at the end
        if not self.graceful_stop(info, pid):
            self.hard_stop(info, pid)
        reap(base_dir)
        if pid_alive(pid):
            raise self.error(f"could not stop {self.describe(info)} (pid {pid})")
        self.write_state(info, None)
        return True

    def stop(self, base_dir: Path) -> bool:
        """Stop the server if it runs; return whether one was stopped (idempotent)."""
        with locked(base_dir):
            return self.stop_unlocked(base_dir)

    def restart(
        self, base_dir: Path, template: Callable[[InfoT | None], InfoT], wait: float
    ) -> InfoT:
        """Stop and start on the same ports and data. `template(prev)` is the server to
        start given the one recorded (None if none was)."""
        with locked(base_dir):
            state = self.read_state(base_dir)
            prev = state[0] if state is not None else None
            wanted = template(prev)
            self.stop_unlocked(base_dir)
            if prev is None:
                return self.start_unlocked(wanted, (None,) * len(self.ports(wanted)), wait, False)
            return self.start_unlocked(wanted, self.ports(prev), wait, strict=True)

    def kill(self, base_dir: Path, grace: float = 10.0) -> bool:
        """SIGKILL the server (a crash, for fault tests) and wait until it is gone; True
        if it ran. Its ports stay recorded, so a later start comes back on the same URL."""
        with locked(base_dir):
            state = self.read_state(base_dir)
            if state is None or not self.is_ours(*state):
                return False
            info, pid = state
            assert pid is not None
            self._note(base_dir, FOUND)
            signal_and_wait(pid, signal.SIGKILL, grace, tree=self.kill_tree)
            reap(base_dir)
            self.write_state(info, None)
            return True


class OnePortInfo(ServerInfo):
    """A server that listens on one TCP port, its ``port`` field (a database, Redis)."""

    port: int


OnePortT = TypeVar("OnePortT", bound=OnePortInfo)


class OnePortServer(LocalServer[OnePortT]):
    """The lifecycle of a one-port server: its ports are its info's ``port``."""

    def ports(self, info: OnePortT) -> tuple[int, ...]:
        return (info.port,)

    def with_ports(self, template: OnePortT, ports: Sequence[int]) -> OnePortT:
        return cast(OnePortT, replace(cast(Any, template), port=ports[0]))


# -------------------------------------------------------------------------------- CLI


def guarded(body: Callable[[], int], error: type[Exception]) -> int:
    """Run a CLI command: `error` is printed as ``error: ...`` with exit code 1."""
    try:
        return body()
    except error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


@dataclass
class Commands:
    """What ``start|stop|status|restart|url[|kill]`` do, given the parsed arguments."""

    start: Callable[[argparse.Namespace], ServerInfo]
    restart: Callable[[argparse.Namespace], ServerInfo]
    stop: Callable[[argparse.Namespace], bool]
    status: Callable[[argparse.Namespace], ServerInfo | None]
    kill: Callable[[argparse.Namespace], bool] | None = None


def cli(
    argv: Sequence[str] | None,
    parser: argparse.ArgumentParser,
    commands: Commands,
    error: type[Exception],
    *,
    arguments: Callable[[argparse.ArgumentParser], object] = lambda parser: None,
    default_name: str = "amqplocks",
    what: str = "server",
    port_help: str = "TCP port for start",
) -> int:
    """The server CLI: `parser` gets the command and the shared options, then the kind's
    own `arguments` (a positional one comes after the command); ``start``/``url``/
    ``restart`` print only the URL so ``$(...)`` captures it, ``status`` exits 3 when the
    server is not running."""
    names = ["start", "stop", "status", "restart", "url", *(["kill"] if commands.kill else [])]
    parser.add_argument("command", choices=names)
    parser.add_argument("--name", default=default_name, help=f"{what} name (default: %(default)s)")
    parser.add_argument("--base-dir", type=Path, default=None, help=f"{what} directory")
    parser.add_argument("--port", type=int, default=None, help=port_help)
    parser.add_argument("--wait", type=float, default=60.0, help="startup timeout (s)")
    arguments(parser)
    args = parser.parse_args(argv)

    def run() -> int:
        if args.command in ("start", "url"):
            print(commands.start(args).url)
        elif args.command == "restart":
            print(commands.restart(args).url)
        elif args.command in ("stop", "kill"):
            end = commands.kill if args.command == "kill" and commands.kill else commands.stop
            print("stopped" if end(args) else "not running", file=sys.stderr)
        else:
            info = commands.status(args)
            if info is None:
                print("not running")
                return 3
            print(info.url)
        return 0

    return guarded(run, error)
