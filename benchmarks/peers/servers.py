"""Private Redis, ZooKeeper and PostgreSQL servers on loopback for the peer libraries.

Each peer is measured against its real server, started here in a temporary directory on
a free port of 127.0.0.1 and stopped (with the directory removed) when the block ends.
Redis and ZooKeeper come from Debian's packages (``scripts/bench`` installs them);
PostgreSQL is ``amqp_locks_dev.devdb``'s private server. A server that cannot start is
reported (its peers are then not measured) instead of stopping the whole run.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from amqp_locks_dev import devdb
from amqp_locks_dev.localserver import HOST, pid_alive, tail

#: ZooKeeper's tick; sessions may ask for 2..20 ticks unless the bounds below widen that.
ZK_TICK_MS = 2000
#: Lowered from 2 ticks (4 s) so a client may *ask* for a short session (tuned settings);
#: clients asking for the default 10 s get 10 s.
ZK_MIN_SESSION_MS = 1000
ZK_JARS = ("/usr/share/java/zookeeper.jar", "/usr/share/java/slf4j-nop.jar")


@dataclass
class Servers:
    """What is running: connection targets by server kind, and why others are missing."""

    urls: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait(check: object, proc: subprocess.Popen[bytes], log: Path, what: str, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited during startup ({proc.returncode}):\n{tail(log)}")
        with contextlib.suppress(OSError):
            if check():  # type: ignore[operator]
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start within {wait:.0f} s:\n{tail(log)}")
        time.sleep(0.1)  # polling a starting server: there is nothing to await


def _ask(port: int, payload: bytes, timeout: float = 1.0) -> bytes:
    """Send ``payload``; the answer up to the server's close (or the first chunk for Redis)."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(payload)
        data = s.recv(4096)
        with contextlib.suppress(OSError):
            while payload != b"PING\r\n" and (chunk := s.recv(4096)):
                data += chunk
        return data


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if pid_alive(proc.pid):  # pragma: no cover - reaped above
        proc.kill()


def _start_redis(base: Path, procs: list[subprocess.Popen[bytes]]) -> tuple[str, str, str]:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(exe).exists():
        raise RuntimeError("redis-server is not installed (scripts/bench installs it)")
    port = free_port()
    log = base / "redis.log"
    cmd = [exe, "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no"]
    cmd += ["--dir", str(base), "--daemonize", "no", "--logfile", str(log)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=base)
    procs.append(proc)  # stopped by the caller whatever happens next
    _wait(lambda: _ask(port, b"PING\r\n").startswith(b"+PONG"), proc, log, "redis-server", 30)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    words = [w for w in version.stdout.split() if w.startswith("v=")]
    settings = "no persistence (--save '' --appendonly no)"
    return f"redis://{HOST}:{port}/0", words[0][2:] if words else "unknown", settings


def _start_zookeeper(base: Path, procs: list[subprocess.Popen[bytes]]) -> tuple[str, str, str]:
    java = shutil.which("java")
    if java is None or not all(Path(j).exists() for j in ZK_JARS):
        raise RuntimeError("zookeeper or a JRE is not installed (scripts/bench installs them)")
    port = free_port()
    (base / "data").mkdir()
    cfg = base / "zoo.cfg"
    cfg.write_text(
        f"tickTime={ZK_TICK_MS}\ndataDir={base / 'data'}\nclientPort={port}\n"
        f"clientPortAddress={HOST}\nminSessionTimeout={ZK_MIN_SESSION_MS}\n"
        "maxClientCnxns=0\nadmin.enableServer=false\n4lw.commands.whitelist=srvr\n"
        # Benchmark data need not survive a host crash (as for devdb's fsync=off).
        "forceSync=no\n"
    )
    log = base / "zookeeper.log"
    cmd = [java, "-Xmx512m", "-XX:+UseSerialGC", "-cp", ":".join(ZK_JARS)]
    cmd += ["org.apache.zookeeper.server.quorum.QuorumPeerMain", str(cfg)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=base)
    procs.append(proc)  # stopped by the caller whatever happens next
    # `ruok` answers before the server serves; `srvr` says so only once it does.
    _wait(lambda: _ask(port, b"srvr").startswith(b"Zookeeper version"), proc, log, "ZooKeeper", 60)
    first = _ask(port, b"srvr").decode(errors="replace").partition("\n")[0]
    version = first.partition(":")[2].strip().split("-")[0] or "unknown"
    settings = (
        f"tickTime {ZK_TICK_MS} ms, minSessionTimeout {ZK_MIN_SESSION_MS} ms, "
        "forceSync=no, standalone"
    )
    return f"{HOST}:{port}", version, settings


@contextlib.contextmanager
def running(kinds: set[str], log: object = print) -> Iterator[Servers]:
    """Start the servers named in ``kinds`` ("redis", "zookeeper", "postgresql")."""
    out = Servers()
    tmp = devdb.db_fixture_base("amqp-locks-peers-")  # PostgreSQL's user must traverse it
    procs: list[subprocess.Popen[bytes]] = []
    pg_base: Path | None = None
    try:
        for kind, start, label in (
            ("redis", _start_redis, "Redis"),
            ("zookeeper", _start_zookeeper, "ZooKeeper"),
        ):
            if kind in kinds:
                try:
                    (tmp / kind).mkdir()
                    out.urls[kind], out.versions[label], out.settings[kind] = start(
                        tmp / kind, procs
                    )
                except Exception as exc:
                    out.missing[kind] = str(exc)
        if "postgresql" in kinds:
            try:
                pg_base = tmp / "postgresql"
                info = devdb.start("postgresql", name="peers", base_dir=pg_base)
                out.urls["postgresql"] = info.url
                out.settings["postgresql"] = "amqp_locks_dev.devdb private server (fsync=off)"
            except Exception as exc:
                pg_base = None
                out.missing["postgresql"] = str(exc)
        for kind, why in out.missing.items():
            log(f"  {kind} not started: {why.splitlines()[0]}")  # type: ignore[operator]
        yield out
    finally:
        for proc in procs:
            with contextlib.suppress(Exception):
                _stop(proc)
        if pg_base is not None:
            with contextlib.suppress(Exception):
                devdb.stop("postgresql", name="peers", base_dir=pg_base)
        shutil.rmtree(tmp, ignore_errors=True)


def postgres_dsn(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg://u:p@h:port/db`` -> the libpq URL psycopg and tooz take."""
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)
