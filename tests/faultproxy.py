"""A TCP proxy on loopback that tests control: pass, blackhole (silent partition), reset.

Used to cut or freeze the connection between a client and the broker without touching
either: `blackhole()` keeps both sockets open but moves no bytes (what a partition looks like
to TCP), `reset()` closes every proxied connection, `heal()` lets bytes flow again.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="faultproxy")
        self._thread.start()

    def url(self, user: str = "guest", password: str = "guest", vhost: str = "%2F") -> str:
        return f"amqp://{user}:{password}@127.0.0.1:{self.port}/{vhost}"

    # --- faults ----------------------------------------------------------------------

    def blackhole(self) -> None:
        """Stop moving bytes in both directions; sockets stay open."""
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def reset(self) -> None:
        """Close every proxied connection (both sides see the TCP connection drop)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    )
                    s.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        self._stop.set()
        self.reset()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(5)

    # --- the pump ----------------------------------------------------------------------

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        sel.register(self._listener, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stop.is_set():
            if not self._flowing.is_set():
                # Frozen: accept nothing, move nothing, keep everything open.
                self._flowing.wait(0.05)
                continue
            with self._lock:
                live = {s for pair in self._pairs for s in pair}
            for s in list(peers):
                if s not in live:
                    with contextlib.suppress(KeyError, ValueError):
                        sel.unregister(s)
                    peers.pop(s, None)
            for a, b in list(self._pairs):
                for x, y in ((a, b), (b, a)):
                    if x not in peers and x.fileno() >= 0:
                        peers[x] = y
                        sel.register(x, selectors.EVENT_READ)
            for key, _ in sel.select(0.05):
                s = key.fileobj
                if s is self._listener:
                    try:
                        client, _addr = self._listener.accept()
                        upstream = socket.create_connection(self.target, timeout=5)
                    except OSError:
                        continue
                    client.setblocking(True)
                    upstream.setblocking(True)
                    with self._lock:
                        self._pairs.append((client, upstream))
                    continue
                assert isinstance(s, socket.socket)
                if not self._flowing.is_set():
                    break
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                other = peers.get(s)
                if not data or other is None:
                    self._drop(s)
                    continue
                try:
                    other.sendall(data)
                except OSError:
                    self._drop(s)
        sel.close()

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            for pair in list(self._pairs):
                if s in pair:
                    self._pairs.remove(pair)
                    for x in pair:
                        with contextlib.suppress(OSError):
                            x.close()
