"""The Erlang port mapper daemons (epmd) our private nodes leave behind.

A node boots an epmd on its line's port when none listens there (4369 for the host's
3.10.8, 4370 and 4371 for the 4.x roots: :mod:`amqp_locks_dev.devbroker`), and that epmd
outlives the node: a test run that said "none left running" left up to three. A script
that starts nodes notes which epmds ran before it (:func:`running`) and, once its nodes
are stopped, stops the others that no node is registered with any more (:func:`sweep`):
an epmd that ran before it, or that serves anyone's node (a user's `scripts/broker` node,
a system RabbitMQ), is left alone. Spoken in epmd's own protocol (NAMES_REQ, KILL_REQ; a
kill is accepted from loopback only), so no line's epmd binary is needed.

    python -m amqp_locks_dev.epmd running              # the lines' ports with an epmd now
    python -m amqp_locks_dev.epmd sweep [--keep PORTS]  # stop the unused ones, but PORTS
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
from collections.abc import Iterable, Sequence

from .devbroker import _EPMD_PORT, ROOT_LINES
from .localserver import HOST

#: Every port a line's nodes register on.
PORTS: tuple[int, ...] = (_EPMD_PORT, *sorted(line.epmd_port for line in ROOT_LINES.values()))
TIMEOUT = 2.0


def _ask(port: int, request: bytes) -> bytes | None:
    """epmd's whole answer to `request` (it closes the connection after answering); None
    when nothing listens on `port` or it does not answer within TIMEOUT."""
    try:
        with socket.create_connection((HOST, port), TIMEOUT) as s:
            s.settimeout(TIMEOUT)
            s.sendall(struct.pack(">H", len(request)) + request)
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
    except OSError:
        return None
    return b"".join(chunks)


def names(port: int) -> list[str] | None:
    """The nodes registered with the epmd on `port` (None: no epmd there)."""
    reply = _ask(port, b"n")
    if reply is None or len(reply) < 4:  # its own port number comes first
        return None
    lines = reply[4:].decode("utf-8", "replace").splitlines()
    return [line.split()[1] for line in lines if line.startswith("name ")]


def running(ports: Iterable[int] = PORTS) -> list[int]:
    return [port for port in ports if names(port) is not None]


def sweep(keep: Iterable[int] = (), ports: Iterable[int] = PORTS) -> list[int]:
    """Stop each epmd on `ports` but `keep` that has no node registered; the ports whose
    epmd stopped."""
    kept = set(keep)
    stopped = []
    for port in ports:
        if port not in kept and names(port) == [] and _ask(port, b"k") == b"OK":
            stopped.append(port)
    return stopped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amqp_locks_dev.epmd", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["running", "sweep"])
    parser.add_argument("--keep", default="", help="sweep: ports to leave (space-separated)")
    args = parser.parse_args(argv)
    if args.command == "running":
        print(" ".join(str(port) for port in running()))
        return 0
    stopped = sweep(int(port) for port in args.keep.split())
    if stopped:
        print(f"stopped the epmd our nodes left on port {', '.join(map(str, stopped))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
