"""amqp_locks_dev.epmd: a script stops the epmd its nodes left, and never one that serves a
node or ran before it. Against a real epmd of the host's Erlang on a port of the test's
own (never the lines' ports, which the suite's nodes use)."""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator

import pytest

from amqp_locks_dev import epmd
from amqp_locks_dev.localserver import HOST

from . import waiting

BINARY = shutil.which("epmd") or "/usr/bin/epmd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def mapper() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = _free_port()
    proc = subprocess.Popen([BINARY, "-port", str(port), "-address", HOST])
    try:
        waiting.wait_until(lambda: epmd.names(port) is not None, 10, "epmd to listen")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _register(port: int, name: str) -> socket.socket:
    """Register node `name` as a node does (ALIVE2_REQ); it stays while the socket is open."""
    s = socket.create_connection((HOST, port), 5)
    node = name.encode()
    body = struct.pack(">BHBBHHH", 120, 30000, 77, 0, 6, 5, len(node)) + node + b"\0\0"
    s.sendall(struct.pack(">H", len(body)) + body)
    reply = s.recv(16)
    assert reply[:1] in (b"y", b"v") and reply[1] == 0, reply  # ALIVE2_(X_)RESP, result 0
    return s


def test_an_unused_epmd_is_stopped_unless_kept(mapper: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = mapper
    assert epmd.names(port) == []
    assert epmd.running([port]) == [port]
    assert epmd.sweep(keep=[port], ports=[port]) == []  # it ran before the script
    assert proc.poll() is None
    assert epmd.sweep(ports=[port]) == [port]
    assert proc.wait(10) == 0
    assert epmd.names(port) is None and epmd.running([port]) == []
    assert epmd.sweep(ports=[port]) == []  # nothing there: nothing to do


def test_an_epmd_serving_a_node_stays(mapper: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = mapper
    with _register(port, "someone-else"):
        assert epmd.names(port) == ["someone-else"]
        assert epmd.sweep(ports=[port]) == []
        assert proc.poll() is None
    waiting.wait_until(lambda: epmd.names(port) == [], 10, "the node to unregister")
    assert epmd.sweep(ports=[port]) == [port]
    assert proc.wait(10) == 0
