"""`Broker`: the connection every lock of a process shares.

:class:`Broker` is the thread-safe sync facade and `amqp_locks.aio.Broker` the asyncio
one; both drive one :class:`~amqp_locks.transport.core.BrokerCore` on the private I/O
thread (core.py). Neither re-implements any protocol step.
"""

from __future__ import annotations

import ssl
from typing import Protocol

from .core import CLOSE_TIMEOUT, SESSION_CLOSE_BOUND, BrokerCore
from .errors import censor
from .holders import default_holder_id
from .urls import UrlSpec

__all__ = [
    "CLOSE_TIMEOUT",
    "SESSION_CLOSE_BOUND",
    "Broker",
    "BrokerBase",
    "BrokerCore",
    "BrokerLike",
]


class BrokerLike(Protocol):
    """What the lock classes need of a broker: its core (both facades have one)."""

    core: BrokerCore


class BrokerBase:
    """What both facades share: the arguments, and the core they drive."""

    def __init__(
        self,
        url: UrlSpec = None,
        heartbeat: float = 10.0,
        *,
        loss_timeout: float | None = None,
        connect_timeout: float = 10.0,
        connection_name: str | None = None,
        cluster: bool | None = None,
        ssl_context: ssl.SSLContext | None = None,
        holder_id: str | None = None,
        net_ticktime: float | None = None,
        quorum_timeout: float | None = None,
        lock_delay: float | None = None,
    ) -> None:
        #: The transport core every lock object of this broker speaks through: its I/O
        #: thread (``run``, ``submit``), its sessions (``session()``) and its mode
        #: (``cluster``). Public so that the package's protocols and integrations (tooz,
        #: Celery, OpenTelemetry) reach it without a private attribute; applications use
        #: the lock classes instead.
        self.core = BrokerCore(
            url,
            heartbeat=heartbeat,
            loss_timeout=loss_timeout,
            connect_timeout=connect_timeout,
            connection_name=connection_name,
            cluster=cluster,
            ssl_context=ssl_context,
            holder_id=holder_id,
            net_ticktime=net_ticktime,
            quorum_timeout=quorum_timeout,
            lock_delay=lock_delay,
        )

    @property
    def url(self) -> str:
        """The URL of the node connected to (or to be tried first), password censored."""
        return censor(self.core.url)

    @property
    def urls(self) -> list[str]:
        """Every node's URL, in the order given, passwords censored."""
        return [censor(u) for u in self.core.urls]

    @property
    def cluster(self) -> bool:
        """Cluster mode (see the class docstring): several URLs, or ``cluster=True``."""
        return self.core.cluster

    @property
    def heartbeat(self) -> float:
        return self.core.heartbeat

    @property
    def net_ticktime(self) -> float:
        """The nodes' Erlang ``net_ticktime`` cluster mode assumes on lines without the
        lock delay (3.10-4.2): as given, else RabbitMQ's default 60 s."""
        return self.core.timing.assumed_ticktime

    @property
    def lock_delay(self) -> float:
        """Cluster mode on RabbitMQ 4.3+: how long a token held through a lost node stays
        ungranted (the lock queues' ``x-consumer-disconnected-timeout``; seconds)."""
        return self.core.timing.lock_delay

    @property
    def quorum_timeout(self) -> float:
        """Cluster mode: seconds without a quorum-confirmed probe before this connection's
        locks are reported lost (transport/quorum_guard.py)."""
        return self.core.timing.quorum_timeout

    @property
    def holder_id(self) -> str:
        """What the holder records of locks held through this Broker say (``holder_id``
        given, else ``host:pid`` of this process)."""
        return self.core.holder_id or default_holder_id()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, heartbeat={self.heartbeat})"


class Broker(BrokerBase):
    """A connection to RabbitMQ, owned by a private I/O thread. Thread-safe.

    ``url`` defaults to ``$AMQP_URL``, then to ``amqp://guest:guest@localhost:5672/`` (the
    library never starts a broker of its own); several nodes
    of a cluster may be given (a list, or one string with comma-separated URLs): the
    Broker connects to the first that answers and, when that connection is lost, to the
    next one (leases held through the lost connection are reported lost). ``cluster``
    (default: whether several URLs were given) says the broker is a cluster whose queue
    leaders can die: fencing tokens are then read by a consumer, because RabbitMQ answers
    a ``basic.get`` on a quorum queue without a leader by closing the whole connection;
    set it for a single URL that fronts a cluster (a load balancer). ``heartbeat``
    (seconds) bounds how long a dead peer goes unnoticed; leases are marked lost after
    ``loss_timeout`` (default: one heartbeat period) without a frame from the broker.

    In cluster mode every connection also proves, every few seconds, that its node is on
    the cluster's majority side (a probe confirmed by a quorum queue): after
    ``quorum_timeout`` seconds without such a proof (default ``lock_delay / 2``) its locks
    are reported lost and it moves to another node. On RabbitMQ 4.3+ the broker grants a
    token held through a lost node again only ``lock_delay`` seconds (default 10) after it
    notices the loss, so the holder is told first whatever the nodes' ``net_ticktime``;
    a crashed process's locks are not delayed. ``net_ticktime`` (the nodes' Erlang setting,
    default RabbitMQ's 60) matters only on 3.10-4.2, where the majority can re-grant
    0.75 x ``net_ticktime`` after a silent cut (docs/cluster.md).

    TLS: an ``amqps://`` URL connects over TLS, verifying the broker's certificate against
    the system's CAs, or against ``?cafile=PATH`` (also ``certfile``, ``keyfile`` for a
    client certificate; aiormq's URL options); or pass ``ssl_context`` (an
    :class:`ssl.SSLContext`) for full control.

    ``holder_id`` (default ``host:pid``) is what readers of this Broker's locks see as
    their holder (``Mutex.holder()``, ``amqp-locks status``): every client of the vhost
    can read it, so it must not be a secret (1-128 printable characters, not a URL).
    """

    def connect(self) -> Broker:
        """Open the connection now (it otherwise opens on first use); raises typed errors."""
        self.core.run(self.core.session())
        return self

    def round_trip(self) -> None:
        """One broker round trip (a passive declare of `amq.direct`'s twin queue check)."""

        async def rt() -> None:
            session = await self.core.session()
            await session.call(None, lambda ch: ch.exchange_declare("amq.direct", passive=True))

        self.core.run(rt())

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the connection. Every thread waiting on this Broker (an acquire, an admin
        call) gets :class:`~amqp_locks.errors.BrokerClosed` at once; releases in flight
        and the leases still held are released first, within `timeout` seconds (then the
        connection's close frees whatever is left). Using the Broker afterwards raises
        BrokerClosed."""
        self.core.close(timeout)

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
