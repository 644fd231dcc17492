"""A protected resource: a store that refuses writes carrying a stale fencing token.

It is what a lock protects in production (a database row, a file, an external API) reduced
to the one rule fencing needs: per key, accept a write only if its token is at least the
highest token seen so far for that key. Every attempt is logged, accepted or not, so the
checker can tell which writes got through after their holder's lock was re-granted.

With ``fencing=False`` the resource accepts everything: the same run then shows what an
unfenced resource would have suffered.

Processes other than the test's reach it over a Unix socket (:meth:`serve`,
:class:`ResourceClient`): one JSON line per write, one line back.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Write:
    t: float
    grant: str
    key: Hashable
    token: int
    accepted: bool


class ProtectedResource:
    def __init__(self, fencing: bool = True) -> None:
        self.fencing = fencing
        self._lock = threading.Lock()
        self._highest: dict[Hashable, int] = {}
        self._log: list[Write] = []
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self.address: str | None = None

    def write(self, grant: str, key: Hashable, token: int) -> bool:
        """One write by `grant` holding `key` with fencing `token`; True when accepted.
        Keys are ints across processes (the socket protocol); in-process any hashable."""
        with self._lock:
            highest = self._highest.get(key)
            accepted = not self.fencing or highest is None or token >= highest
            if highest is None or token > highest:
                self._highest[key] = token
            self._log.append(Write(time.monotonic(), grant, key, token, accepted))
            return accepted

    def highest(self, key: Hashable) -> int | None:
        """The highest token seen for `key` (None before any write to it)."""
        with self._lock:
            return self._highest.get(key)

    @property
    def log(self) -> list[Write]:
        with self._lock:
            return list(self._log)

    def serve(self, path: str | os.PathLike[str]) -> str:
        """Accept writes from other processes on the Unix socket `path` (a daemon thread)."""
        resource = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                # A killed writer resets its connection: that ends the session, quietly.
                with contextlib.suppress(ConnectionError):
                    for line in self.rfile:
                        req = json.loads(line)
                        ok = resource.write(req["grant"], int(req["key"]), int(req["token"]))
                        self.wfile.write(b"1\n" if ok else b"0\n")
                        self.wfile.flush()

        self.address = str(path)
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()
        server = socketserver.ThreadingUnixStreamServer(self.address, Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(
            target=server.serve_forever, args=(0.05,), daemon=True, name="resource"
        ).start()  # a short poll: close() returns at once
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ResourceClient:
    """A process's connection to a served :class:`ProtectedResource`."""

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(address)
        self._file = self._sock.makefile("rwb")
        self._lock = threading.Lock()

    def write(self, grant: str, key: int, token: int) -> bool:
        line = json.dumps({"grant": grant, "key": key, "token": token}).encode() + b"\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            reply = self._file.readline()
        if not reply:
            raise ConnectionError("the protected resource closed the connection")
        return reply == b"1\n"

    def close(self) -> None:
        self._file.close()
        self._sock.close()
