"""Where a Celery app's locks live, and one :class:`~amqp_locks.Broker` per process.

The locks go to the RabbitMQ the app already uses (``broker_url``, with Celery's failover
list and ``broker_use_ssl``) unless ``amqp_locks_url`` says otherwise, so a Celery user
needs no second server. A Broker is made in the process that uses it: a prefork child
makes its own after the fork (``worker_process_init``), so a child's locks live and die
with the child's own connection, which is what frees them when the child is killed.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlencode

from celery import Celery
from kombu import Connection

from ..errors import ConfigurationError
from ..transport import Broker

log = logging.getLogger("amqp_locks.celery")

#: Celery's names for AMQP transports (kombu's aliases of py-amqp and librabbitmq).
AMQP_TRANSPORTS = frozenset({"amqp", "amqps", "pyamqp", "py-amqp", "librabbitmq"})

#: The settings read from ``app.conf`` (all optional), with their defaults.
DEFAULTS: dict[str, Any] = {
    # URL, comma-separated URLs or a list (several: a cluster); default: broker_url.
    "amqp_locks_url": None,
    "amqp_locks_heartbeat": 10.0,
    # Cluster mode (Broker's `cluster`); None: when several URLs are given.
    "amqp_locks_cluster": None,
    # The cluster's Erlang net_ticktime (cluster mode; None: RabbitMQ's default, 60).
    "amqp_locks_net_ticktime": None,
    # Queue type of the token semaphores (lock_limit > 1, once): True quorum, False
    # classic, None: quorum in cluster mode only.
    "amqp_locks_quorum": None,
    # `once` claims survive a broker restart (a disk write per claim); False: faster
    # claims, lost (the keys of queued calls freed) when the broker restarts.
    "amqp_locks_once_durable": True,
}


def setting(app: Celery, name: str) -> Any:
    """``app.conf[name]``, or its default from :data:`DEFAULTS`."""
    value = app.conf.get(name)
    return DEFAULTS[name] if value is None else value


def _not_amqp(transport: str) -> ConfigurationError:
    return ConfigurationError(
        f"Celery's broker_url uses the {transport!r} transport, not AMQP: "
        "set app.conf.amqp_locks_url to the RabbitMQ URL the locks should use"
    )


def _amqp_url(url: str, use_ssl: Any) -> str:
    """One kombu broker URL as the AMQP URL amqp-locks takes (kombu's defaults filled in:
    ``amqp://guest@localhost//`` is user guest, password guest, vhost ``/``).

    A URL of another transport is refused by its scheme before kombu loads the transport:
    loading it imports that transport's client (redis-py, and ``packaging``), whose
    absence would otherwise surface as an ImportError instead of what to configure."""
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in url else "amqp"
    if scheme not in AMQP_TRANSPORTS:
        raise _not_amqp(scheme)
    try:
        conn = Connection(url, ssl=use_ssl)
    except ImportError as exc:  # an AMQP transport whose client is missing (librabbitmq)
        raise ConfigurationError(
            f"Celery's broker_url transport {scheme!r} could not be loaded ({exc}): "
            "set app.conf.amqp_locks_url to the RabbitMQ URL the locks should use"
        ) from exc
    try:
        if conn.transport_cls not in AMQP_TRANSPORTS:
            raise _not_amqp(conn.transport_cls)
        info = conn.info()
    finally:
        conn.release()
    tls = bool(info.get("ssl")) or conn.transport_cls == "amqps"
    query: dict[str, str] = {}
    if isinstance(info.get("ssl"), dict):
        names = {"ca_certs": "cafile", "certfile": "certfile", "keyfile": "keyfile"}
        query = {
            ours: str(info["ssl"][theirs])
            for theirs, ours in names.items()
            if info["ssl"].get(theirs)
        }
    user = quote(str(info.get("userid") or "guest"), safe="")
    password = quote(str(info.get("password") or "guest"), safe="")
    port = info.get("port") or (5671 if tls else 5672)
    vhost = quote(str(info.get("virtual_host") or "/"), safe="")
    text = f"{'amqps' if tls else 'amqp'}://{user}:{password}@{info['hostname']}:{port}/{vhost}"
    return f"{text}?{urlencode(query)}" if query else text


def lock_urls(app: Celery) -> list[str]:
    """The node URLs the app's locks use: ``amqp_locks_url``, else ``broker_url`` (its
    failover list too) when that is AMQP."""
    explicit = setting(app, "amqp_locks_url")
    if explicit:
        if isinstance(explicit, str):
            return [u.strip() for u in explicit.split(",") if u.strip()]
        return [str(u) for u in explicit]
    raw = app.conf.broker_write_url or app.conf.broker_url or "amqp://guest:guest@localhost//"
    urls: Sequence[str] = raw.split(";") if isinstance(raw, str) else list(raw)
    return [_amqp_url(u.strip(), app.conf.broker_use_ssl) for u in urls if u.strip()]


def make_broker(app: Celery) -> Broker:
    """A new Broker for `app`'s locks (no I/O yet: it connects on first use)."""
    return Broker(
        lock_urls(app),
        heartbeat=float(setting(app, "amqp_locks_heartbeat")),
        cluster=setting(app, "amqp_locks_cluster"),
        net_ticktime=setting(app, "amqp_locks_net_ticktime"),
    )


_lock = threading.Lock()
#: id(app) -> (pid that made it, the app, its Broker): a child never uses its parent's.
_brokers: dict[int, tuple[int, Celery, Broker]] = {}


def broker_for(app: Celery) -> Broker:
    """This process's Broker for `app`'s locks, made on first use (thread-safe)."""
    pid = os.getpid()
    app = getattr(app, "_get_current_object", lambda: app)()  # a proxy's id is not the app's
    with _lock:
        entry = _brokers.get(id(app))
        if entry is not None and entry[0] == pid:
            return entry[2]
        broker = make_broker(app)
        _brokers[id(app)] = (pid, app, broker)
        return broker


def forget_inherited() -> None:
    """In a fork child: drop the parent's Brokers without closing them (their connections
    are the parent's; the library already keeps the child off them)."""
    pid = os.getpid()
    with _lock:
        for key in [k for k, (owner, _, _) in _brokers.items() if owner != pid]:
            del _brokers[key]


def close_all() -> None:
    """Close this process's Brokers: the broker frees every lock still held through them."""
    pid = os.getpid()
    with _lock:
        mine = [(k, b) for k, (owner, _, b) in _brokers.items() if owner == pid]
        for key, _ in mine:
            del _brokers[key]
    for _, broker in mine:
        try:
            broker.close()
        except Exception:
            log.debug("closing the lock broker failed", exc_info=True)


atexit.register(close_all)
