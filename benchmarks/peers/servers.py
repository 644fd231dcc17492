"""Private Redis (``amqp_locks_dev.devredis``), ZooKeeper (Debian's package) and PostgreSQL
(``amqp_locks_dev.devdb``) on loopback for the peers, in a temporary directory removed at
the end; a server that cannot start is reported and its peers are not measured.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amqp_locks_dev import devdb, devredis
from amqp_locks_dev.localserver import HOST, free_ports, tail

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


def _srvr(port: int) -> str:
    """ZooKeeper's `srvr` answer (`ruok` answers before the server serves; this does not)."""
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1.0) as s:
        s.sendall(b"srvr")
        return b"".join(iter(lambda: s.recv(4096), b"")).decode(errors="replace")
    return ""


def _zookeeper(base: Path, stops: list[Callable[[], Any]]) -> tuple[str, str]:
    java = shutil.which("java")
    if java is None or not all(Path(j).exists() for j in ZK_JARS):
        raise RuntimeError("zookeeper or a JRE is not installed (scripts/bench installs them)")
    port = free_ports(1)[0]
    (base / "data").mkdir(parents=True)
    (base / "zoo.cfg").write_text(
        f"tickTime={ZK_TICK_MS}\ndataDir={base / 'data'}\nclientPort={port}\n"
        f"clientPortAddress={HOST}\nminSessionTimeout={ZK_MIN_SESSION_MS}\n"
        "maxClientCnxns=0\nadmin.enableServer=false\n4lw.commands.whitelist=srvr\n"
        "forceSync=no\n"  # benchmark data need not survive a host crash (as devdb's fsync=off)
    )
    cmd = [java, "-Xmx512m", "-XX:+UseSerialGC", "-cp", ":".join(ZK_JARS)]
    cmd += ["org.apache.zookeeper.server.quorum.QuorumPeerMain", str(base / "zoo.cfg")]
    log = base / "zookeeper.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=base)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    stops.append(stop)
    deadline = time.monotonic() + 60
    while not (answer := _srvr(port)).startswith("Zookeeper version"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ZooKeeper did not start (exit {proc.poll()}):\n{tail(log)}")
        time.sleep(0.1)  # polling a starting server: there is nothing to await
    return f"{HOST}:{port}", answer.partition("\n")[0].partition(":")[2].strip().split("-")[0]


@contextlib.contextmanager
def running(kinds: set[str], log: Callable[[str], None] = print) -> Iterator[Servers]:
    """Start the servers named in ``kinds`` ("redis", "zookeeper", "postgresql")."""
    out = Servers()
    tmp = devdb.db_fixture_base("amqp-locks-peers-")  # PostgreSQL's user must traverse it
    stops: list[Callable[[], Any]] = []

    def redis() -> None:
        import redis as client

        info = devredis.start("peers", base_dir=tmp / "redis")
        stops.append(lambda: devredis.stop("peers", base_dir=tmp / "redis"))
        out.urls["redis"] = info.url
        out.versions["Redis"] = str(client.Redis.from_url(info.url).info()["redis_version"])
        out.settings["redis"] = "no persistence (--save '' --appendonly no)"

    def zookeeper() -> None:
        out.urls["zookeeper"], out.versions["ZooKeeper"] = _zookeeper(tmp / "zookeeper", stops)
        out.settings["zookeeper"] = (
            f"tickTime {ZK_TICK_MS} ms, minSessionTimeout {ZK_MIN_SESSION_MS} ms, "
            "forceSync=no, standalone"
        )

    def postgresql() -> None:
        info = devdb.start("postgresql", name="peers", base_dir=tmp / "postgresql")
        stops.append(lambda: devdb.stop("postgresql", name="peers", base_dir=tmp / "postgresql"))
        out.urls["postgresql"] = info.url
        out.settings["postgresql"] = "amqp_locks_dev.devdb private server (fsync=off)"

    try:
        for kind, start in (("redis", redis), ("zookeeper", zookeeper), ("postgresql", postgresql)):
            try:
                if kind in kinds:
                    start()
            except Exception as exc:
                out.missing[kind] = str(exc)
                log(f"  {kind} not started: {str(exc).splitlines()[0]}")
        yield out
    finally:
        for stop in reversed(stops):
            with contextlib.suppress(Exception):
                stop()
        shutil.rmtree(tmp, ignore_errors=True)
