"""Reference floors: what one round trip costs before any lock logic runs.

- loopback TCP: a 16-byte ping to an echo server in another process on 127.0.0.1; the
  kernel + Python socket floor no broker protocol can beat.
- broker: ``Broker.round_trip()`` (a passive exchange declare), i.e. the caller thread ->
  private I/O thread -> aiormq -> RabbitMQ -> back. Every lock figure is expressed as a
  multiple of this one.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection

from amqp_locks import Broker

PING = b"amqp-locks-bench"  # 16 bytes, about the size of a small AMQP method frame


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("echo peer closed")
        buf += chunk
    return buf


def _echo_server(port_pipe: Connection) -> None:
    """Accept one client and echo fixed-size pings until it closes (runs in a child)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_pipe.send(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    data = _recv_exact(conn, len(PING))
                except ConnectionError:
                    return
                conn.sendall(data)


def loopback_rtt(samples: int, reps: int) -> list[list[float]]:
    """Round trips (seconds) to an echo server in a separate process, ``reps`` times."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_server, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("echo server did not start")
        port = parent.recv()
        out: list[list[float]] = []
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(200):  # warm-up: page in, settle the scheduler
                sock.sendall(PING)
                _recv_exact(sock, len(PING))
            for _ in range(reps):
                rep: list[float] = []
                for _ in range(samples):
                    t0 = time.perf_counter()
                    sock.sendall(PING)
                    _recv_exact(sock, len(PING))
                    rep.append(time.perf_counter() - t0)
                out.append(rep)
        return out
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def broker_rtt(url: str, samples: int, reps: int) -> list[list[float]]:
    """``Broker.round_trip()`` latencies (seconds) on a fresh connection, ``reps`` times."""
    with Broker(url) as broker:
        broker.connect()
        for _ in range(100):
            broker.round_trip()
        out: list[list[float]] = []
        for _ in range(reps):
            rep: list[float] = []
            for _ in range(samples):
                t0 = time.perf_counter()
                broker.round_trip()
                rep.append(time.perf_counter() - t0)
            out.append(rep)
        return out
