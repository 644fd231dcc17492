"""Every lock compared, ours and the peers', and one ``acquire(blocking) -> bool`` /
``release()`` / ``close()`` interface over them (:func:`make`, in the process that uses it).

``default`` settings are a user's with no arguments; ``tuned`` free a crashed holder's lock
sooner (None: nothing to tune). ``wait`` and ``crash`` are read from the libraries' code.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    key: str
    label: str
    library: str  # distribution name, for its version
    server: str | None  # target needed: amqp, redis, zookeeper, postgresql, or None (files)
    wait: str
    crash: str
    default: dict[str, Any]
    tuned: dict[str, Any] | None = None
    #: Seconds until a crashed holder's lock is free at most (None: never), per settings.
    expiry: tuple[float | None, float | None] = (0.0, 0.0)
    native_slots: bool = False  # has a semaphore of its own
    slots_recipe: bool = False  # locks only: N slots as N locks (SlotsOfLocks)
    ours: bool = False

    @property
    def polls(self) -> bool:
        return self.wait.startswith("polls")

    def settings(self, group: str) -> dict[str, Any]:
        return dict(self.default if group == "default" or self.tuned is None else self.tuned)


_PUSH_PG = "pushed (pg_advisory_lock blocks in the server)"
_PG_CRASH = "the server ends the dead client's session (socket closed)"
_ZK_CRASH = "ZooKeeper expires the session after its timeout (default 10 s)"
_ZK: dict[str, Any] = {
    "default": {"session_timeout": 10.0},
    "tuned": {"session_timeout": 2.0},
    "expiry": (10.0, 2.0),
}
_NOTICE = "pushed (release notice; a crashed holder's sentinel)"
_OURS: dict[str, Any] = {"library": "amqp-locks", "server": "amqp", "default": {}, "ours": True}


KINDS: dict[str, Kind] = {
    k.key: k
    for k in (
        Kind(
            "ours_token",
            "amqp-locks TokenSemaphore",
            wait="pushed (the broker delivers the released token to a waiting consumer)",
            crash="the broker requeues the unacked token when the connection drops",
            native_slots=True,
            **_OURS,
        ),
        Kind(
            "ours_mutex",
            "amqp-locks Mutex",
            wait=_NOTICE,
            crash="the broker deletes the exclusive queue when the connection drops",
            **_OURS,
        ),
        Kind(
            "ours_semaphore",
            "amqp-locks PersistentSemaphore",
            wait=_NOTICE,
            crash="the broker deletes the exclusive holder queue when the connection drops",
            native_slots=True,
            **_OURS,
        ),
        Kind(
            "redis_py",
            "redis-py Lock",
            "redis",
            "redis",
            "polls every `sleep` (0.1 s; tuned 0.01 s)",
            "key expiry after `timeout`; default timeout=None: the key never expires",
            {"timeout": None, "sleep": 0.1},
            {"timeout": 1.0, "sleep": 0.01, "renew": 0.3},
            expiry=(None, 1.0),
            slots_recipe=True,
        ),
        Kind(
            "redis_lock",
            "python-redis-lock",
            "python-redis-lock",
            "redis",
            "pushed (BLPOP on a signal list the releaser LPUSHes)",
            "key expiry after `expire`; default expire=None: the key never expires",
            {"expire": None, "auto_renewal": False},
            {"expire": 1, "auto_renewal": True},
            expiry=(None, 1.0),
            slots_recipe=True,
        ),
        Kind(
            "tooz_redis",
            "tooz (redis driver)",
            "tooz",
            "redis",
            "polls every 0.1 s (redis-py Lock's sleep)",
            "key expiry after `lock_timeout` (default 30 s), renewed by the heart thread",
            {"lock_timeout": 30},
            {"lock_timeout": 2},
            expiry=(30.0, 2.0),
            slots_recipe=True,
        ),
        Kind(
            "tooz_pg",
            "tooz (postgresql driver)",
            "tooz",
            "postgresql",
            _PUSH_PG,
            _PG_CRASH,
            {},
            slots_recipe=True,
        ),
        Kind(
            "tooz_zk",
            "tooz (zookeeper driver)",
            "tooz",
            "zookeeper",
            "pushed (kazoo Lock: watch on the predecessor znode)",
            "ZooKeeper expires the session after `timeout` (default 10 s)",
            {"timeout": 10},
            {"timeout": 2},
            expiry=(10.0, 2.0),
            slots_recipe=True,
        ),
        Kind(
            "tooz_file",
            "tooz (file driver)",
            "tooz",
            None,
            "polls (fasteners: 0.01 s rising to 0.1 s)",
            "the kernel drops a dead process's fcntl lock",
            {},
            slots_recipe=True,
        ),
        Kind(
            "kazoo_lock",
            "kazoo Lock",
            "kazoo",
            "zookeeper",
            "pushed (watch on the predecessor znode)",
            _ZK_CRASH,
            **_ZK,
        ),
        Kind(
            "kazoo_semaphore",
            "kazoo Semaphore",
            "kazoo",
            "zookeeper",
            "pushed (watches on the lease and lock znodes)",
            _ZK_CRASH,
            native_slots=True,
            **_ZK,
        ),
        Kind(
            "pg_advisory",
            "PostgreSQL pg_advisory_lock (psycopg)",
            "psycopg",
            "postgresql",
            _PUSH_PG,
            _PG_CRASH,
            {},
            slots_recipe=True,
        ),
        Kind(
            "filelock",
            "filelock (single host)",
            "filelock",
            None,
            "polls every `poll_interval` (0.05 s; tuned 0.005 s)",
            "the kernel drops a dead process's flock",
            {"poll_interval": 0.05},
            {"poll_interval": 0.005},
            slots_recipe=True,
        ),
    )
}

#: Our one-permit locks as the report's own sections name them: (kind, settings).
OURS = {
    "token": ("ours_token", {}),
    "token_nofence": ("ours_token", {"fencing": False}),
    "token_quorum": ("ours_token", {"quorum": True}),
    "mutex": ("ours_mutex", {}),
    "semaphore": ("ours_semaphore", {}),
}


class Adapter:
    """A lock object whose ``acquire(blocking=)`` / ``release()`` fit, and what closes it."""

    def __init__(self, lock: Any, *closers: Callable[[], Any]) -> None:
        self.lock, self.closers = lock, closers

    def acquire(self, blocking: bool = True) -> bool:
        return bool(self.lock.acquire(blocking=blocking))

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        for close in self.closers:
            with contextlib.suppress(Exception):
                close()


class _Ours(Adapter):
    """Our lock: ``acquire`` returns the lease (slot number, fencing token), which releases."""

    lease: Any = None

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        self.lease = self.lock.acquire(blocking=blocking, timeout=timeout)
        return self.lease is not None

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


def _ours(kind: str, url: str, name: str, st: dict[str, Any]) -> Adapter:
    from amqp_locks import Broker, Mutex, PersistentSemaphore, TokenSemaphore

    broker = Broker(url, connection_name=f"amqp-locks bench {kind} {os.getpid()}").connect()
    cls = {"ours_token": TokenSemaphore, "ours_mutex": Mutex}.get(kind, PersistentSemaphore)
    return _Ours(cls(broker, name, **st), broker.close)


def _redis(url: str, name: str, st: dict[str, Any], kind: str) -> Adapter:
    """redis-py's ``Lock`` (no lease renewal: ``renew``, tuned, re-acquires on a thread), or
    python-redis-lock's, whose client gets ``socket_timeout=None``: redis-py 8's default 5 s
    cuts the library's ``BLPOP`` of an unexpiring lock (timeout 0, "for ever")."""
    import redis
    from redis.exceptions import LockError

    if kind == "redis_lock":
        import redis_lock

        client = redis.Redis.from_url(url, socket_timeout=None)
        lk = redis_lock.Lock(client, f"bench:{name}", st["expire"], auto_renewal=st["auto_renewal"])
        return Adapter(lk, client.close)
    client = redis.Redis.from_url(url)
    lock = client.lock(
        f"bench:{name}", timeout=st["timeout"], sleep=st["sleep"], thread_local=False
    )
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(st["renew"]):
            with contextlib.suppress(LockError):  # raised at once when not held
                lock.reacquire()

    if st.get("renew"):
        threading.Thread(target=renew, daemon=True).start()
    return Adapter(lock, stop.set, client.close)


def _tooz(backend_url: str, name: str) -> Adapter:
    """tooz's lock of one driver; the coordinator's heart thread renews (redis) locks."""
    from tooz import coordination

    member = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}".encode()
    coord = coordination.get_coordinator(backend_url, member)
    coord.start(start_heart=True)
    return Adapter(coord.get_lock(f"bench-{name}".encode()), coord.stop)


def _kazoo(hosts: str, name: str, slots: int, st: dict[str, Any], sem: bool) -> Adapter:
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts, timeout=st["session_timeout"])
    client.start(timeout=30)
    path = f"/bench/{name}"
    lock = client.Semaphore(path, max_leases=slots) if sem else client.Lock(path)
    return Adapter(lock, client.stop, client.close)


class _PgAdvisory(Adapter):
    """``pg_advisory_lock`` on a session of its own: the server queues blocked waiters."""

    def __init__(self, dsn: str, name: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)
        digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
        self.key = int.from_bytes(digest, "big", signed=True)
        super().__init__(None, self.conn.close)

    def acquire(self, blocking: bool = True) -> bool:
        call = "pg_advisory_lock" if blocking else "pg_try_advisory_lock"
        row = self.conn.execute(f"SELECT {call}(%s)", (self.key,)).fetchone()
        return blocking or bool(row and row[0])

    def release(self) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))


class _FileLock(Adapter):
    """filelock's ``FileLock`` (flock; a blocked acquire polls every ``poll_interval``)."""

    def __init__(self, directory: str, name: str, st: dict[str, Any]) -> None:
        from filelock import FileLock

        os.makedirs(directory, exist_ok=True)
        lock = FileLock(os.path.join(directory, f"{name}.lock"))
        super().__init__(lock, lambda: lock.release(force=True))
        self.poll = st["poll_interval"]

    def acquire(self, blocking: bool = True) -> bool:
        from filelock import Timeout

        with contextlib.suppress(Timeout):
            return bool(self.lock.acquire(timeout=-1 if blocking else 0, poll_interval=self.poll))
        return False


class SlotsOfLocks(Adapter):
    """``slots`` locks as one semaphore, the way users build one from a lock library: try
    every lock without blocking in random order, else block on a random one."""

    def __init__(self, make: Callable[[str], Adapter], name: str, slots: int) -> None:
        self.locks = [make(f"{name}-{i}") for i in range(slots)]
        self.held: Adapter | None = None
        self.rng = random.Random(os.getpid())
        super().__init__(None, *(lock.close for lock in self.locks))

    def acquire(self, blocking: bool = True) -> bool:
        order = self.rng.sample(self.locks, len(self.locks))
        self.held = next((lock for lock in order if lock.acquire(blocking=False)), None)
        if self.held is None and blocking and order[0].acquire(blocking=True):
            self.held = order[0]
        return self.held is not None

    def release(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.release()


def make(
    kind: str, name: str, slots: int, targets: dict[str, str], group: str = "default"
) -> Adapter:
    """The adapter of ``kind`` (a key of KINDS or OURS) for lock ``name`` with ``slots`` slots."""
    if kind in OURS:
        return _ours(OURS[kind][0], targets["amqp"], name, OURS[kind][1])
    k, files = KINDS[kind], targets.get("files", "")
    st = k.settings(group)
    if slots > 1 and k.slots_recipe:
        return SlotsOfLocks(lambda n: make(kind, n, 1, targets, group), name, slots)
    if slots > 1 and not k.native_slots:
        raise ValueError(f"{k.label} has no semaphore")
    pg = targets.get("postgresql", "").replace("postgresql+psycopg://", "postgresql://", 1)
    redis, zk = targets.get("redis", ""), targets.get("zookeeper", "")
    factories: dict[str, Callable[[], Adapter]] = {
        "redis_py": lambda: _redis(redis, name, st, kind),
        "redis_lock": lambda: _redis(redis, name, st, kind),
        "tooz_redis": lambda: _tooz(
            f"{redis.rsplit('/', 1)[0]}?lock_timeout={st.get('lock_timeout')}", name
        ),
        "tooz_pg": lambda: _tooz(pg, name),
        "tooz_zk": lambda: _tooz(f"zookeeper://{zk}?timeout={st.get('timeout')}", name),
        "tooz_file": lambda: _tooz(f"file://{os.path.join(files, 'tooz')}", name),
        "kazoo_lock": lambda: _kazoo(zk, name, slots, st, sem=False),
        "kazoo_semaphore": lambda: _kazoo(zk, name, slots, st, sem=True),
        "pg_advisory": lambda: _PgAdvisory(pg, name),
        "filelock": lambda: _FileLock(os.path.join(files, "filelock"), name, st),
    }
    return _ours(kind, targets["amqp"], name, st) if k.ours else factories[kind]()


def available(targets: dict[str, str]) -> list[str]:
    """Kinds whose server is running."""
    return [k for k, v in KINDS.items() if v.server is None or v.server in targets]


def supports(kind: str, slots: int) -> bool:
    k = KINDS[kind]
    return slots == 1 or k.native_slots or k.slots_recipe
