"""Every lock compared: ours and the peers, with their default and tuned settings.

``default`` is what a user gets by constructing the lock with no arguments; ``tuned`` is
what we set to make a crashed holder's lock come free sooner (None: nothing to tune, the
defaults already do what tuning would). ``wait`` says how a blocked acquire learns that
the lock is free, ``crash`` what frees a crashed holder's lock: both are read from the
libraries' code (versions in the report) and the measurements show them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .adapters import (
    Adapter,
    FileLockLock,
    KazooLock,
    OursLock,
    PgAdvisoryLock,
    RedisLockLock,
    RedisPyLock,
    SlotsOfLocks,
    ToozLock,
)
from .servers import postgres_dsn


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

# fmt: off
KINDS: dict[str, Kind] = {k.key: k for k in (
    Kind("ours_token", "amqp-locks TokenSemaphore",
         wait="pushed (the broker delivers the released token to a waiting consumer)",
         crash="the broker requeues the unacked token when the connection drops",
         native_slots=True, **_OURS),
    Kind("ours_mutex", "amqp-locks Mutex", wait=_NOTICE,
         crash="the broker deletes the exclusive queue when the connection drops", **_OURS),
    Kind("ours_semaphore", "amqp-locks PersistentSemaphore", wait=_NOTICE,
         crash="the broker deletes the exclusive holder queue when the connection drops",
         native_slots=True, **_OURS),
    Kind("redis_py", "redis-py Lock", "redis", "redis", "polls every `sleep` (0.1 s; tuned 0.01 s)",
         "key expiry after `timeout`; default timeout=None: the key never expires",
         {"timeout": None, "sleep": 0.1}, {"timeout": 1.0, "sleep": 0.01, "renew": 0.3},
         expiry=(None, 1.0), slots_recipe=True),
    Kind("redis_lock", "python-redis-lock", "python-redis-lock", "redis",
         "pushed (BLPOP on a signal list the releaser LPUSHes)",
         "key expiry after `expire`; default expire=None: the key never expires",
         {"expire": None, "auto_renewal": False}, {"expire": 1, "auto_renewal": True},
         expiry=(None, 1.0), slots_recipe=True),
    Kind("tooz_redis", "tooz (redis driver)", "tooz", "redis",
         "polls every 0.1 s (redis-py Lock's sleep)",
         "key expiry after `lock_timeout` (default 30 s), renewed by the heart thread",
         {"lock_timeout": 30}, {"lock_timeout": 2}, expiry=(30.0, 2.0), slots_recipe=True),
    Kind("tooz_pg", "tooz (postgresql driver)", "tooz", "postgresql", _PUSH_PG, _PG_CRASH, {},
         slots_recipe=True),
    Kind("tooz_zk", "tooz (zookeeper driver)", "tooz", "zookeeper",
         "pushed (kazoo Lock: watch on the predecessor znode)",
         "ZooKeeper expires the session after `timeout` (default 10 s)",
         {"timeout": 10}, {"timeout": 2}, expiry=(10.0, 2.0), slots_recipe=True),
    Kind("tooz_file", "tooz (file driver)", "tooz", None,
         "polls (fasteners: 0.01 s rising to 0.1 s)",
         "the kernel drops a dead process's fcntl lock", {}, slots_recipe=True),
    Kind("kazoo_lock", "kazoo Lock", "kazoo", "zookeeper",
         "pushed (watch on the predecessor znode)", _ZK_CRASH, **_ZK),
    Kind("kazoo_semaphore", "kazoo Semaphore", "kazoo", "zookeeper",
         "pushed (watches on the lease and lock znodes)", _ZK_CRASH, native_slots=True, **_ZK),
    Kind("pg_advisory", "PostgreSQL pg_advisory_lock (psycopg)", "psycopg", "postgresql",
         _PUSH_PG, _PG_CRASH, {}, slots_recipe=True),
    Kind("filelock", "filelock (single host)", "filelock", None,
         "polls every `poll_interval` (0.05 s; tuned 0.005 s)",
         "the kernel drops a dead process's flock",
         {"poll_interval": 0.05}, {"poll_interval": 0.005}, slots_recipe=True),
)}
# fmt: on


def make(
    kind: str, name: str, slots: int, targets: dict[str, str], group: str = "default"
) -> Adapter:
    """The adapter of ``kind`` for lock ``name`` with ``slots`` slots (in this process)."""
    k = KINDS[kind]
    st = k.settings(group)
    if slots > 1 and k.slots_recipe:
        return SlotsOfLocks(lambda n: make(kind, n, 1, targets, group), name, slots)
    if slots > 1 and not k.native_slots:
        raise ValueError(f"{k.label} has no semaphore")
    if k.ours:
        return OursLock(kind, targets["amqp"], name, st)
    if kind == "redis_py":
        return RedisPyLock(targets["redis"], name, st)
    if kind == "redis_lock":
        return RedisLockLock(targets["redis"], name, st)
    if kind == "tooz_redis":
        url = targets["redis"].rsplit("/", 1)[0]
        return ToozLock(f"{url}?lock_timeout={st['lock_timeout']}", name)
    if kind == "tooz_pg":
        return ToozLock(postgres_dsn(targets["postgresql"]), name)
    if kind == "tooz_zk":
        return ToozLock(f"zookeeper://{targets['zookeeper']}?timeout={st['timeout']}", name)
    if kind == "tooz_file":
        return ToozLock(f"file://{os.path.join(targets['files'], 'tooz')}", name)
    if kind in ("kazoo_lock", "kazoo_semaphore"):
        return KazooLock(targets["zookeeper"], name, slots, st, sem=kind == "kazoo_semaphore")
    if kind == "pg_advisory":
        return PgAdvisoryLock(postgres_dsn(targets["postgresql"]), name)
    if kind == "filelock":
        return FileLockLock(os.path.join(targets["files"], "filelock"), name, st)
    raise ValueError(kind)


def available(targets: dict[str, str]) -> list[str]:
    """Kinds whose server is running."""
    return [k for k, v in KINDS.items() if v.server is None or v.server in targets]


def supports(kind: str, slots: int) -> bool:
    k = KINDS[kind]
    return slots == 1 or k.native_slots or k.slots_recipe
