"""The fault proxy in front of a plain TCP echo server (as it fronts a database port)."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from .proxy import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):
            while data := self.request.recv(65536):
                self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server.server_address[:2]  # type: ignore[misc]
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[FaultProxy]:
    with FaultProxy(*echo) as p:
        yield p


def _connect(proxy: FaultProxy) -> socket.socket:
    s = socket.create_connection(proxy.address, timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _round_trip(s: socket.socket, payload: bytes = b"ping") -> float:
    start = time.monotonic()
    s.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = s.recv(65536)
        assert chunk, "connection closed"
        got += chunk
    assert got == payload
    return time.monotonic() - start


def test_passes_bytes_and_counts_connections(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        assert _round_trip(s, b"x" * 200_000) < 1.0
        assert proxy.connections == 1
    deadline = time.monotonic() + 5
    while proxy.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.connections == 0


def test_delay_is_added_each_way_and_removed_by_passthrough(proxy: FaultProxy) -> None:
    # A delay long against scheduling noise on a loaded machine (four thread wake-ups per
    # round trip): the floor is exact, the ceilings only tell one delay from two or three.
    delay = 1.0
    with _connect(proxy) as s:
        assert _round_trip(s) < delay  # no delay yet
        proxy.delay(delay)
        assert 2 * delay <= _round_trip(s) < 3 * delay  # once up + once down
        proxy.passthrough()
        assert _round_trip(s) < delay  # gone again


def test_blackhole_keeps_the_socket_open_and_heal_delivers_what_waited(
    proxy: FaultProxy,
) -> None:
    with _connect(proxy) as s:
        _round_trip(s)
        proxy.blackhole()
        s.sendall(b"held")
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(10)  # silence, not EOF or reset
        assert proxy.connections == 1
        proxy.heal()
        s.settimeout(5)
        assert s.recv(10) == b"held"


def test_one_way_blackhole_cuts_only_that_way(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        proxy.blackhole("down")  # the server gets our bytes; its answers wait
        s.sendall(b"a")
        s.settimeout(0.4)
        with pytest.raises(TimeoutError):
            s.recv(10)
        proxy.heal()
        s.settimeout(5)
        assert s.recv(10) == b"a"


def test_reset_is_seen_by_the_client_at_once(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        _round_trip(s)
        proxy.reset()
        s.settimeout(5)
        start = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(10) == b""
        assert time.monotonic() - start < 1.0
        assert proxy.connections == 0


def test_wait_downstream_sees_the_next_server_chunk(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        assert not proxy.wait_downstream(0.2)  # nothing flows by itself
        threading.Timer(0.1, lambda: s.sendall(b"z")).start()
        assert proxy.wait_downstream(5)


def test_a_closed_end_is_not_reported_across_a_cut(proxy: FaultProxy) -> None:
    """The client dies while the way up is cut: its RST could not reach the server, so
    the server's side stays open until the cut heals."""
    s = _connect(proxy)
    _round_trip(s)
    proxy.blackhole("up")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()  # RST to the proxy
    time.sleep(0.3)  # the scenario: the server keeps talking into the void meanwhile
    assert proxy.connections == 1
    proxy.heal()
    deadline = time.monotonic() + 5
    while proxy.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.connections == 0


def _frame(kind: int, payload: bytes) -> bytes:
    """An AMQP 0-9-1 frame on channel 1 (the echo server sends it back, server->client)."""
    return struct.pack("!BHI", kind, 1, len(payload)) + payload + b"\xce"


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        assert chunk, "connection closed"
        got += chunk
    return got


@pytest.fixture
def amqp_proxy(echo: tuple[str, int]) -> Iterator[FaultProxy]:
    with FaultProxy(*echo, amqp=True) as p:
        yield p


def test_mute_passes_heartbeat_frames_only(amqp_proxy: FaultProxy) -> None:
    method, heartbeat = _frame(1, b"m" * 300), _frame(8, b"")
    with _connect(amqp_proxy) as s:
        s.settimeout(5)
        s.sendall(method)
        assert _recv_exactly(s, len(method)) == method  # not muted yet: everything passes
        amqp_proxy.mute()
        s.sendall(method[:9])  # a frame cut across chunks is still recognised
        s.sendall(method[9:] + heartbeat + method)
        assert _recv_exactly(s, len(heartbeat)) == heartbeat
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(10)  # both method frames were swallowed
        amqp_proxy.heal()
        s.settimeout(5)
        s.sendall(method)
        assert _recv_exactly(s, len(method)) == method  # swallowed ones stay gone


def test_mute_with_hold_delivers_the_frames_late_on_heal(amqp_proxy: FaultProxy) -> None:
    first, second, heartbeat = _frame(1, b"a"), _frame(3, b"b" * 70_000), _frame(8, b"")
    with _connect(amqp_proxy) as s:
        s.settimeout(5)
        amqp_proxy.mute(hold=True)
        s.sendall(first + heartbeat + second)
        assert _recv_exactly(s, len(heartbeat)) == heartbeat
        amqp_proxy.heal()
        assert _recv_exactly(s, len(first + second)) == first + second  # in order


def test_mute_needs_an_amqp_proxy(proxy: FaultProxy) -> None:
    with pytest.raises(RuntimeError):
        proxy.mute()


def test_effects_only_counts_the_frames_that_change_the_broker() -> None:
    """``cut_after(n, effects_only=True)``: a passive declare, a channel's open and close,
    qos and confirm.select leave the broker as it was (a cut after them is the cut before
    them); a real declaration, a get, a delete and a publish with a body do not."""
    from pamqp import commands
    from pamqp.frame import marshal

    from .proxy import _Frames, _has_effect

    def effect(*methods: object) -> list[bool]:
        frames = _Frames()
        return [_has_effect(frames, marshal(m, 1)) for m in methods]  # type: ignore[arg-type]

    assert (
        effect(
            commands.Channel.Open(),
            commands.Basic.Qos(prefetch_count=1),
            commands.Confirm.Select(),
            commands.Queue.Declare(queue="q", passive=True),
            commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0),
            commands.Channel.CloseOk(),
        )
        == [False] * 6
    )
    assert (
        effect(
            commands.Queue.Declare(queue="q", durable=True),
            commands.Queue.Declare(queue="a-longer-queue-name", passive=False, nowait=True),
            commands.Basic.Get(queue="q"),
            commands.Queue.Delete(queue="q"),
        )
        == [True] * 4
    )
    reads = frozenset({"hints"})
    frames = _Frames()
    assert [
        _has_effect(frames, marshal(m, 1), reads)
        for m in (
            commands.Basic.Get(queue="hints"),
            commands.Basic.Get(queue="hints", no_ack=True),
            commands.Basic.Get(queue="counter"),
        )
    ] == [False, True, True]
    header = commands.Basic.Publish(exchange="", routing_key="q")
    from pamqp.header import ContentHeader

    assert effect(header, ContentHeader(body_size=3)) == [False, True]
    assert effect(header, ContentHeader(body_size=0)) == [False, False]
