"""What the private development servers share (`devbroker`, `devdb`): process liveness,
a per-server file lock, free loopback ports, atomic state files, log tails."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


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


def write_state(base_dir: Path, data: dict[str, Any]) -> None:
    """Write `node.json` atomically (a reader never sees half a file)."""
    tmp = base_dir / "node.json.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(base_dir / "node.json")


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"
