"""A private Redis server on 127.0.0.1, for comparing with Redis-based lock libraries
(celery-once in ``benchmarks/celery_overhead.py`` and ``tests/celery``).

Like :mod:`amqp_locks_dev.devdb`, the server lives entirely in its own ``base_dir``
(config, log, pid file, ``node.json`` state), listens on loopback only, on a free port,
runs as the invoking user and is started and stopped by us (no system service). Redis
comes from Debian's package ``redis-server``, installed when missing (as root) with its
service kept from starting. Nothing is persisted (``save ""``, no AOF): a lock store for
benchmarks and tests, not a database.

CLI: ``python -m amqp_locks_dev.devredis start|stop|status|restart|url|kill [--name NAME]``.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .localserver import (
    HOST,
    Commands,
    Launch,
    OnePortInfo,
    OnePortServer,
    apt_install,
    cli,
    home,
    resolve_dir,
)

__all__ = [
    "DEFAULT_NAME",
    "DevRedisError",
    "RedisInfo",
    "ensure_installed",
    "kill",
    "ledger_server",
    "main",
    "start",
    "status",
    "stop",
    "url",
]

DEFAULT_NAME = "amqplocks"
_SEARCH = ("/usr/bin/redis-server", "/usr/local/bin/redis-server", "/usr/sbin/redis-server")


class DevRedisError(RuntimeError):
    """The private Redis could not be installed, started or stopped."""


@dataclass(frozen=True)
class RedisInfo(OnePortInfo):
    """Where a private Redis lives and listens."""

    port: int
    base_dir: Path

    @property
    def url(self) -> str:
        """redis-py's URL of database 0."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid_file(self) -> Path:
        return self.base_dir / "redis.pid"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "redis.log"

    @property
    def config_file(self) -> Path:
        return self.base_dir / "redis.conf"


def _server_binary() -> Path | None:
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    return next((Path(p) for p in _SEARCH if Path(p).exists()), None)


def ensure_installed() -> Path:
    """``redis-server`` from Debian's packages if missing (no service started); its path."""
    exe = _server_binary()
    if exe is None:
        apt_install("redis-server", DevRedisError, "amqp_locks_dev.devredis")
        exe = _server_binary()
    if exe is None:
        raise DevRedisError("redis-server was installed but is not on PATH nor in /usr/bin")
    return exe


def ping(port: int, timeout: float = 1.0) -> bool:
    """Redis answers ``PING`` with ``+PONG`` on `port`."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class _Redis(OnePortServer[RedisInfo]):
    """How a private Redis is launched, probed and stopped (see LocalServer)."""

    error = DevRedisError
    stop_grace = 20.0

    def decode(self, base_dir: Path, raw: dict[str, Any]) -> RedisInfo | None:
        return RedisInfo(int(raw["port"]), base_dir) if raw.get("kind") == "redis" else None

    def encode(self, info: RedisInfo) -> dict[str, Any]:
        return {"kind": "redis", "port": info.port}

    def describe(self, info: RedisInfo) -> str:
        return f"Redis server in {info.base_dir}"

    def answers(self, info: RedisInfo) -> bool:
        return ping(info.port)

    def ledger_id(self) -> str:
        """This module's name even when it runs as ``python -m`` (``__main__``)."""
        return "amqp_locks_dev.devredis"

    def needles(self, info: RedisInfo) -> tuple[str, ...]:
        """Redis retitles itself ``redis-server HOST:PORT`` (its argv no longer names the
        config file in ``base_dir``)."""
        return (f"{HOST}:{info.port}",)

    def prepare(self, info: RedisInfo) -> Launch:
        """A config on loopback without persistence; ready once it answers PING. Redis
        runs in the foreground (``daemonize no``) so the Popen's pid is the server's."""
        exe = ensure_installed()
        info.config_file.write_text(
            "\n".join(
                [
                    f"bind {HOST}",
                    f"port {info.port}",
                    "protected-mode yes",
                    "daemonize no",
                    f"pidfile {info.pid_file}",
                    f"logfile {info.log_file}",
                    f"dir {info.base_dir}",
                    'save ""',
                    "appendonly no",
                    "",
                ]
            )
        )
        return Launch(
            [str(exe), str(info.config_file)], {"PATH": "/usr/bin:/bin"}, lambda _: ping(info.port)
        )


@functools.cache
def _server() -> _Redis:
    return _Redis()


def ledger_server(kind: str | None) -> _Redis:
    """The lifecycle the server ledger's ``amqp_locks_dev.devredis`` entries name
    (``scripts/test`` stops the Redis servers a run started)."""
    return _server()


def _resolve(name: str, base_dir: Path | None) -> Path:
    """``base_dir``, else ``$AMQP_LOCKS_HOME/redis/<name>``."""
    return resolve_dir(name, base_dir, lambda: home() / "redis" / name, DevRedisError)


def start(
    name: str = DEFAULT_NAME,
    base_dir: Path | None = None,
    port: int | None = None,
    wait: float = 30.0,
) -> RedisInfo:
    """The running server, started first if needed (idempotent; the previous port when
    still free, so URLs stay valid)."""
    ensure_installed()
    base = _resolve(name, base_dir)
    return _server().start(RedisInfo(0, base), (port,), wait)


def stop(name: str = DEFAULT_NAME, base_dir: Path | None = None) -> bool:
    """Stop the server if it runs; whether one was stopped (idempotent)."""
    return _server().stop(_resolve(name, base_dir))


def kill(name: str = DEFAULT_NAME, base_dir: Path | None = None) -> bool:
    """SIGKILL the server (a crash); True if it ran."""
    return _server().kill(_resolve(name, base_dir))


def status(name: str = DEFAULT_NAME, base_dir: Path | None = None) -> RedisInfo | None:
    """The running server (answering PING), or None."""
    return _server().status(_resolve(name, base_dir))


def restart(
    name: str = DEFAULT_NAME, base_dir: Path | None = None, wait: float = 30.0
) -> RedisInfo:
    """Stop and start on the same port."""
    ensure_installed()
    base = _resolve(name, base_dir)
    return _server().restart(base, lambda prev: RedisInfo(0, base), wait)


def url(name: str = DEFAULT_NAME, base_dir: Path | None = None) -> str:
    """The server's URL, starting it if it is not running."""
    return start(name, base_dir).url


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; ``start``/``url`` print only the URL so ``$(...)`` captures it."""
    parser = argparse.ArgumentParser(
        prog="python -m amqp_locks_dev.devredis", description="Private Redis on 127.0.0.1."
    )
    commands = Commands(
        start=lambda a: start(a.name, a.base_dir, a.port, a.wait),
        restart=lambda a: restart(a.name, a.base_dir, a.wait),
        stop=lambda a: stop(a.name, a.base_dir),
        status=lambda a: status(a.name, a.base_dir),
        kill=lambda a: kill(a.name, a.base_dir),
    )
    return cli(argv, parser, commands, DevRedisError, default_name=DEFAULT_NAME, what="Redis")


if __name__ == "__main__":
    sys.exit(main())
