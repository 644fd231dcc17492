"""One lock interface over our primitives and every peer library, so one harness measures all.

An adapter is made inside the worker process that uses it (its own connection), and
offers ``acquire(blocking) -> bool``, ``release()`` and ``close()``. Nothing here waits
on anything but the library's own acquire: how a blocked acquire learns the lock is free
(pushed, or polled at some interval) is the library's, with the settings of
:mod:`benchmarks.peers.kinds`.

A lock with several slots is the library's own semaphore where it has one (ours, kazoo's
``Semaphore``); a peer with locks only gets the recipe users write: ``slots`` locks, try
each without blocking in random order, else block on a random one (:class:`SlotsOfLocks`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import uuid
from collections.abc import Callable
from typing import Any, Protocol


class Adapter(Protocol):
    def acquire(self, blocking: bool = True) -> bool: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


class _LibraryLock:
    """A library lock object whose ``acquire(blocking=)`` / ``release()`` already fit."""

    lock: Any

    def acquire(self, blocking: bool = True) -> bool:
        return bool(self.lock.acquire(blocking=blocking))

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._disconnect()

    def _disconnect(self) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------ ours


class OursLock:
    """A mutex, token semaphore or persistent semaphore on its own Broker (connection)."""

    def __init__(self, kind: str, url: str, name: str, settings: dict[str, Any]) -> None:
        from amqp_locks import Broker, Mutex, PersistentSemaphore
        from amqp_locks.tokens import TokenSemaphore

        self.broker = Broker(url, connection_name=f"amqp-locks bench {kind} {os.getpid()}")
        self.broker.connect()
        lock: Any
        if kind == "ours_token":
            lock = TokenSemaphore(self.broker, name, **settings)
        elif kind == "ours_mutex":
            lock = Mutex(self.broker, name, **settings)
        else:
            lock = PersistentSemaphore(self.broker, name, **settings)
        self.lock = lock
        self.lease: Any = None

    def acquire(self, blocking: bool = True) -> bool:
        self.lease = self.lock.acquire(blocking=blocking)
        return self.lease is not None

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def close(self) -> None:
        self.broker.close()


# ----------------------------------------------------------------------------- redis


class RedisPyLock:
    """redis-py's ``Lock`` (SET NX PX; a blocked acquire polls every ``sleep`` seconds).

    redis-py has no lease renewal: with a ``timeout`` the holder must ``reacquire()``
    before it lapses, which ``renew`` (seconds, tuned settings) does on a thread.
    """

    def __init__(self, url: str, name: str, settings: dict[str, Any]) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.lock = self.client.lock(
            f"bench:{name}",
            timeout=settings["timeout"],
            sleep=settings["sleep"],
            thread_local=False,
        )
        self.held = False
        self._stop = threading.Event()
        if settings.get("renew"):
            threading.Thread(target=self._renew, args=(settings["renew"],), daemon=True).start()

    def _renew(self, every: float) -> None:
        from redis.exceptions import LockError

        while not self._stop.wait(every):
            if self.held:
                with contextlib.suppress(LockError):
                    self.lock.reacquire()

    def acquire(self, blocking: bool = True) -> bool:
        self.held = bool(self.lock.acquire(blocking=blocking))
        return self.held

    def release(self) -> None:
        self.held = False
        self.lock.release()

    def close(self) -> None:
        self._stop.set()
        self.client.close()


class RedisLockLock(_LibraryLock):
    """python-redis-lock: SET NX EX; a release LPUSHes a signal a blocked BLPOP wakes on.

    Its client gets ``socket_timeout=None``: redis-py 8 defaults to 5 s, which cuts the
    library's ``BLPOP`` of an unexpiring lock (timeout 0, "for ever") with TimeoutError.
    """

    def __init__(self, url: str, name: str, settings: dict[str, Any]) -> None:
        import redis
        import redis_lock

        self.client = redis.Redis.from_url(url, socket_timeout=None)
        self.lock = redis_lock.Lock(
            self.client,
            f"bench:{name}",
            expire=settings["expire"],
            auto_renewal=settings["auto_renewal"],
        )

    def _disconnect(self) -> None:
        self.client.close()


# ------------------------------------------------------------------------------ tooz


class ToozLock(_LibraryLock):
    """tooz's lock of one driver; the coordinator's heart thread renews (redis) locks."""

    def __init__(self, backend_url: str, name: str) -> None:
        from tooz import coordination

        member = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}".encode()
        self.coord = coordination.get_coordinator(backend_url, member)
        self.coord.start(start_heart=True)
        self.lock = self.coord.get_lock(f"bench-{name}".encode())

    def _disconnect(self) -> None:
        self.coord.stop()


# ----------------------------------------------------------------------------- kazoo


class KazooLock(_LibraryLock):
    """kazoo's ``Lock`` or ``Semaphore``: sequential ephemeral znodes, woken by watches."""

    def __init__(self, hosts: str, name: str, slots: int, settings: dict[str, Any], sem: bool):
        from kazoo.client import KazooClient

        self.client = KazooClient(hosts=hosts, timeout=settings["session_timeout"])
        self.client.start(timeout=30)
        path = f"/bench/{name}"
        if sem:
            self.lock: Any = self.client.Semaphore(path, max_leases=slots)
        else:
            self.lock = self.client.Lock(path)

    def _disconnect(self) -> None:
        self.client.stop()
        self.client.close()


# ------------------------------------------------------------------------ PostgreSQL


def advisory_key(name: str) -> int:
    """A stable signed 64-bit key for ``pg_advisory_lock(bigint)``."""
    return int.from_bytes(
        hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True
    )


class PgAdvisoryLock:
    """``pg_advisory_lock`` on a session of its own: the server queues blocked waiters and
    wakes one when the lock is freed (by unlock, or by the holder's session ending)."""

    def __init__(self, dsn: str, name: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)
        self.key = advisory_key(name)

    def acquire(self, blocking: bool = True) -> bool:
        if blocking:
            self.conn.execute("SELECT pg_advisory_lock(%s)", (self.key,))
            return True
        row = self.conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
        return bool(row and row[0])

    def release(self) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


# -------------------------------------------------------------------------- filelock


class FileLockLock:
    """filelock's ``FileLock`` (flock; a blocked acquire polls every ``poll_interval``)."""

    def __init__(self, directory: str, name: str, settings: dict[str, Any]) -> None:
        from filelock import FileLock

        os.makedirs(directory, exist_ok=True)
        self.lock = FileLock(os.path.join(directory, f"{name}.lock"))
        self.poll = settings["poll_interval"]

    def acquire(self, blocking: bool = True) -> bool:
        from filelock import Timeout

        try:
            self.lock.acquire(timeout=-1 if blocking else 0, poll_interval=self.poll)
        except Timeout:
            return False
        return True

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.lock.release(force=True)


# ---------------------------------------------------------------------------- slots


class SlotsOfLocks:
    """``slots`` locks as one semaphore, the way users build one from a lock library:
    try every lock without blocking in random order, else block on a random one."""

    def __init__(self, make: Callable[[str], Adapter], name: str, slots: int) -> None:
        self.locks = [make(f"{name}-{i}") for i in range(slots)]
        self.held: Adapter | None = None
        self.rng = random.Random(os.getpid())

    def acquire(self, blocking: bool = True) -> bool:
        order = self.rng.sample(self.locks, len(self.locks))
        for lock in order:
            if lock.acquire(blocking=False):
                self.held = lock
                return True
        if not blocking:
            return False
        lock = order[0]
        if lock.acquire(blocking=True):
            self.held = lock
            return True
        return False

    def release(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.release()

    def close(self) -> None:
        for lock in self.locks:
            lock.close()
