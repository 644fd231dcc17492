"""A fault-injecting TCP proxy on loopback, in front of any TCP server (a broker, a database).

Tests put it between one client and its server and change what the network does, without
touching either end:

- ``blackhole()`` — a silent partition: both sockets stay open, no byte moves (bytes sent
  meanwhile wait, as TCP retransmissions would, and arrive after ``heal()`` unless the
  connection died first). ``direction="up"`` (client to server) or ``"down"`` cuts one way.
- ``delay(seconds)`` — every chunk arrives that much later, in both directions, in order.
- ``reset()`` — every proxied connection is closed with RST: both ends see it at once.
- ``mute(hold=False)`` — (AMQP only) a broker that keeps the connection alive but answers
  nothing: heartbeat frames (type 8) from the server still pass, every other server->client
  frame is swallowed (``hold=True``: held back, and delivered in order by ``heal()``, as a
  late answer). Client->server bytes flow as usual.
- ``cut_after(n)`` — (AMQP only) forward the next `n` frames clients send (heartbeats not
  counted), then close every proxied connection with RST and refuse new ones until the
  next ``cut_after``/``count_frames``: a client process that dies right after any frame of
  a multi-step path (tests/test_crash_points.py). ``frames_sent`` counts the frames
  clients sent since the last ``count_frames()``. With ``effects_only=True`` the frames
  that change nothing are neither counted nor cut after: ``basic.qos`` (the session's
  pings) and existence probes (a publish with an empty body), so a batch of probes is one
  cut point, before it (tests/test_fence_generations.py).
- ``heal()`` lifts the blackhole and the mute; ``passthrough()`` also removes the delay.

Each connection is two pump threads (one per direction) so a delay adds latency without
throttling the other direction. Faults apply to every connection of the proxy: give each
client its own proxy to fault one client alone.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable
from typing import Literal

Direction = Literal["both", "up", "down"]
_TICK = 0.02


class FaultProxy:
    def __init__(
        self,
        target_host: str,
        target_port: int,
        listen_host: str = "127.0.0.1",
        *,
        amqp: bool = False,
    ) -> None:
        self.target = (target_host, target_port)
        #: The server speaks AMQP 0-9-1: its stream is cut into frames, so `mute` works.
        self.amqp = amqp
        self._listener = socket.create_server((listen_host, 0))
        self.host = listen_host
        self.port: int = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._cut: set[str] = set()  # directions not flowing: "up", "down"
        self._delay = 0.0
        #: mute(): None (off), "swallow" or "hold".
        self._mute: str | None = None
        #: Frames held back by mute(hold=True), per connection, until heal().
        self._held: dict[int, list[bytes]] = {}
        self._down_chunks = 0
        #: cut_after(): frames still to forward before the cut (None: not armed).
        self._cut_after: int | None = None
        #: Client frames (not heartbeats) forwarded since count_frames().
        self._up_frames = 0
        #: Count only frames with an effect (not pings, not probes): see cut_after.
        self._effects_only = False
        #: Queues whose unacknowledged gets are reads (effects_only): see cut_after.
        self._reads: frozenset[str] = frozenset()
        #: cut_after() fired: the client is dead, new connections are refused.
        self._refusing = False
        self._pairs: list[_Pair] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="faultproxy")
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect instead of the target (any protocol)."""
        return (self.host, self.port)

    def url(self, user: str = "guest", password: str = "guest", vhost: str = "%2F") -> str:
        """An AMQP URL through the proxy."""
        return f"amqp://{user}:{password}@{self.host}:{self.port}/{vhost}"

    # --- faults ----------------------------------------------------------------------

    def blackhole(self, direction: Direction = "both") -> None:
        """Stop moving bytes (both ways, or only "up" client->server / "down"); sockets
        stay open."""
        with self._cond:
            self._cut |= {"up", "down"} if direction == "both" else {direction}
            self._cond.notify_all()

    def mute(self, *, hold: bool = False) -> None:
        """From now on pass only the server's AMQP heartbeat frames to the client; swallow
        every other frame (``hold``: keep them for ``heal()``). Frames are cut at their
        boundaries, so the client's stream stays well-formed."""
        if not self.amqp:
            raise RuntimeError("mute() needs FaultProxy(..., amqp=True)")
        with self._cond:
            self._mute = "hold" if hold else "swallow"
            self._cond.notify_all()

    def cut_after(
        self, frames: int, *, effects_only: bool = False, reads: Iterable[str] = ()
    ) -> None:
        """Forward the next `frames` frames clients send (heartbeats are not counted),
        then reset every proxied connection (RST both ways), as the death of the client
        process would. Disarmed once it fired. With `effects_only`, count only frames that
        change the broker (:func:`_has_effect`); an unacknowledged ``basic.get`` on a queue
        in `reads` is a read too (what it took is returned when the connection ends), for
        queues whose messages are not counted by their returns."""
        if not self.amqp:
            raise RuntimeError("cut_after() needs FaultProxy(..., amqp=True)")
        if frames < 0:
            raise ValueError(f"frames must be >= 0, got {frames}")
        with self._cond:
            self._cut_after = frames
            self._up_frames = 0
            self._refusing = False
            self._effects_only = effects_only
            self._reads = frozenset(reads)

    def count_frames(self, *, effects_only: bool = False) -> None:
        """Start counting the frames clients send (:attr:`frames_sent`) from zero."""
        with self._cond:
            self._up_frames = 0
            self._refusing = False
            self._effects_only = effects_only

    @property
    def frames_sent(self) -> int:
        with self._cond:
            return self._up_frames

    @property
    def fired(self) -> bool:
        """Whether the last ``cut_after`` cut a connection."""
        with self._cond:
            return self._cut_after is None

    def heal(self) -> None:
        """Let bytes flow again both ways (a delay set earlier stays); frames a
        ``mute(hold=True)`` held back are delivered first."""
        with self._cond:
            self._cut.clear()
            self._mute = None
            self._cond.notify_all()

    def passthrough(self) -> None:
        """No fault at all: heal and drop any delay."""
        with self._cond:
            self._cut.clear()
            self._delay = 0.0
            self._cond.notify_all()

    def delay(self, seconds: float) -> None:
        """Deliver every chunk `seconds` after it was read, both directions, in order."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0, got {seconds}")
        with self._cond:
            self._delay = float(seconds)
            self._cond.notify_all()

    def reset(self) -> None:
        """Close every proxied connection with RST (both sides see the drop at once)."""
        with self._cond:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close(rst=True)

    def held_methods(self) -> list[tuple[int, int, int]]:
        """(channel, class id, method id) of each method frame ``mute(hold=True)`` holds
        back now, every connection's, in arrival order."""
        with self._cond:
            frames = [f for held in self._held.values() for f in held]
        return [
            (struct.unpack_from("!H", f, 1)[0], *struct.unpack_from("!HH", f, 7))
            for f in frames
            if f[0] == 1 and len(f) >= 12
        ]

    @property
    def blackholed(self) -> bool:
        with self._cond:
            return bool(self._cut)

    @property
    def connections(self) -> int:
        with self._cond:
            self._pairs = [p for p in self._pairs if not p.closed]
            return len(self._pairs)

    def upstream_ports(self) -> list[int]:
        """The local ports of our connections to the target: how the server sees the
        proxied clients (PostgreSQL's ``client_port``, MariaDB's PROCESSLIST host)."""
        with self._cond:
            ups = [p.sockets[1] for p in self._pairs if not p.closed]
        ports = []
        for up in ups:
            with contextlib.suppress(OSError):
                ports.append(up.getsockname()[1])
        return ports

    def wait_downstream(self, timeout: float) -> bool:
        """Wait until the next chunk is forwarded server->client (e.g. a heartbeat): a
        partition started right after it begins the client's silence at a known instant."""
        with self._cond:
            seen = self._down_chunks
            return self._cond.wait_for(lambda: self._down_chunks > seen, timeout)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.passthrough()
        self.reset()
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the pumps -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self._listener], [], [], 0.1)
                if not readable:
                    continue
                client, _addr = self._listener.accept()
            except (OSError, ValueError):
                return
            with self._cond:
                refusing = self._refusing
            if refusing:  # a dead client does not come back
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            with self._cond:
                self._pairs.append(pair)
            for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(
                    target=self._pump, args=(pair, src, dst, way), daemon=True, name=f"pump-{way}"
                ).start()

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket, way: str) -> None:
        pending: collections.deque[tuple[float, bytes]] = collections.deque()
        frames = _Frames() if way == "down" and self.amqp else None
        up_frames = _Frames(header=True) if way == "up" and self.amqp else None
        eof = False
        try:
            while not pair.closed:
                with self._cond:
                    if way in self._cut:
                        self._cond.wait(_TICK)  # partitioned: read nothing, send nothing
                        continue
                if frames is not None and self._held.get(id(pair)):
                    with self._cond:  # healed: the held frames go first
                        held = self._held.pop(id(pair), []) if self._mute is None else []
                    if held:
                        pending.append((time.monotonic() + self._delay, b"".join(held)))
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    try:
                        dst.sendall(pending.popleft()[1])
                    except OSError:
                        # dst's end is gone; the news (an RST) would travel the other way:
                        # while that way is cut, the sender must not learn it.
                        self._wait_open(pair, "up" if way == "down" else "down")
                        raise
                    if way == "down":
                        with self._cond:
                            self._down_chunks += 1
                            self._cond.notify_all()
                if eof:
                    if not pending:
                        break
                    time.sleep(min(_TICK, max(0.0, pending[0][0] - now)))
                    continue
                wait = _TICK if not pending else min(_TICK, max(0.0, pending[0][0] - now))
                readable, _, _ = select.select([src], [], [], wait)
                if not readable or way in self._cut:  # cut while we waited: read nothing
                    continue
                data = src.recv(65536)
                if not data:
                    eof = True
                    continue
                if frames is not None:
                    data = self._filter(id(pair), frames, data)
                    if not data:
                        continue
                cut = False
                if up_frames is not None:
                    data, cut = self._count_up(up_frames, data)
                if data:
                    pending.append((time.monotonic() + self._delay, data))
                if cut:
                    while pending:  # what came before the cut arrives; nothing after it
                        dst.sendall(pending.popleft()[1])
                    self.reset()  # the client process is gone: all its connections
                    break
        except (OSError, ValueError):
            pass
        if frames is not None:
            with self._cond:  # what was held for this connection dies with it
                self._held.pop(id(pair), None)
        pair.close(rst=False)

    def _filter(self, key: int, frames: _Frames, data: bytes) -> bytes:
        """What of `data` (server->client) goes on now: everything when not muted (held
        frames first), else only heartbeat frames; partial frames wait for their rest."""
        out: list[bytes] = []
        with self._cond:
            mute = self._mute
            held = self._held.pop(key, []) if mute is None else []
        out.extend(held)
        for frame in frames.feed(data):
            if mute is None or frame[0] == _HEARTBEAT:
                out.append(frame)
            elif mute == "hold":
                with self._cond:
                    self._held.setdefault(key, []).append(frame)
        return b"".join(out)

    def _count_up(self, frames: _Frames, data: bytes) -> tuple[bytes, bool]:
        """Whole client frames of `data` to forward now, counted; and whether the armed
        ``cut_after`` fired on one of them (then nothing after it goes on)."""
        out: list[bytes] = []
        for frame in frames.feed(data):
            heartbeat = frame[:1] == bytes([_HEARTBEAT]) and len(frame) == 8
            if heartbeat or frame.startswith(b"AMQP"):  # not counted: not the client's steps
                out.append(frame)
                continue
            if self._effects_only and not _has_effect(frames, frame, self._reads):
                out.append(frame)
                continue
            with self._cond:
                if self._cut_after is not None and self._cut_after <= 0:
                    self._cut_after = None
                    self._refusing = True
                    return b"".join(out), True
                self._up_frames += 1
                out.append(frame)
                if self._cut_after is not None:
                    self._cut_after -= 1
                    if self._cut_after == 0:
                        self._cut_after = None
                        self._refusing = True
                        return b"".join(out), True
        return b"".join(out), False

    def _wait_open(self, pair: _Pair, way: str) -> None:
        with self._cond:
            while way in self._cut and not pair.closed and not self._stop.is_set():
                self._cond.wait(_TICK)


_HEARTBEAT = 8
_FRAME_END = 0xCE


_QOS = struct.pack("!HH", 60, 10)  # basic.qos: class 60, method 10
_PUBLISH = struct.pack("!HH", 60, 40)  # basic.publish
_DECLARE = struct.pack("!HH", 50, 10)  # queue.declare
_GET = struct.pack("!HH", 60, 70)  # basic.get
_NO_EFFECT = {
    _QOS,
    struct.pack("!HH", 85, 10),  # confirm.select
    struct.pack("!HH", 20, 10),  # channel.open
    struct.pack("!HH", 20, 40),  # channel.close
    struct.pack("!HH", 20, 41),  # channel.close-ok
}


def _has_effect(frames: _Frames, frame: bytes, reads: frozenset[str] = frozenset()) -> bool:
    """For ``effects_only``: False for frames that leave the broker's state as it was, so
    a cut after them is the cut after the frame before (the same broker state, one more
    run of the path): ``basic.qos``, ``confirm.select``, a channel's open and close, a
    passive ``queue.declare`` (an existence probe), and every frame of an empty-body
    publish (a probe). A publish's method frame is never a cut point of its own (a
    publish cut before its content is dropped by the broker: the cut before it); its
    content header is, unless the body is empty."""
    if frame[0] == 1 and frame[7:11] in _NO_EFFECT:
        return False
    if frame[0] == 1 and frame[7:11] == _DECLARE:
        size = frame[13]  # queue.declare: reserved short, queue shortstr, then the bits
        if frame[14 + size] & 1:  # passive
            return False
    if frame[0] == 1 and frame[7:11] == _GET and reads:
        size = frame[13]  # basic.get: reserved short, queue shortstr, then no-ack
        if frame[14 : 14 + size].decode(errors="replace") in reads and not frame[14 + size] & 1:
            return False
    if frame[0] == 1 and frame[7:11] == _PUBLISH:
        frames.publish_pending = True
        return False
    if frames.publish_pending:
        frames.publish_pending = False
        if frame[0] == 2 and struct.unpack_from("!Q", frame, 11)[0] == 0:
            return False
    return True


class _Frames:
    """Cuts an AMQP 0-9-1 server->client byte stream into whole frames (type, channel,
    size, payload, frame-end), for ``FaultProxy(amqp=True)``. Bytes that turn out not to
    be AMQP framing are passed on as they come."""

    def __init__(self, header: bool = False) -> None:
        self._buf = b""
        #: The client's stream starts with the 8-byte protocol header, not a frame.
        self._header = header
        #: A basic.publish method frame was seen; its content header decides (effects_only).
        self.publish_pending = False

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        if self._header:  # a client's stream may open with the protocol header
            if len(self._buf) < 8 and b"AMQP".startswith(self._buf[:4]):
                return out
            if self._buf.startswith(b"AMQP"):
                out.append(self._buf[:8])
                self._buf = self._buf[8:]
            self._header = False
        while len(self._buf) >= 7:
            size = struct.unpack_from("!I", self._buf, 3)[0]
            if len(self._buf) < 8 + size:
                break
            if self._buf[7 + size] != _FRAME_END:  # not AMQP framing: give up cutting
                out.append(self._buf)
                self._buf = b""
                break
            out.append(self._buf[: 8 + size])
            self._buf = self._buf[8 + size :]
        return out


class _Pair:
    """One proxied connection: the client's socket and ours to the target."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.sockets = (client, upstream)
        self.closed = False
        self._lock = threading.Lock()

    def close(self, *, rst: bool) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in self.sockets:
            with contextlib.suppress(OSError):
                if rst:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
