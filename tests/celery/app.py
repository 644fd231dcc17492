"""The Celery app the tests' workers run: tasks that hold locks and note, in an events
file, when they start and end (one ``O_APPEND`` write each, so the file's order is the
order in which the tasks really started and ended, and overlaps are counted exactly).

Configured by the environment the tests give the worker (and the producers):
``CELERY_TEST_BROKER`` (the test RabbitMQ), ``CELERY_TEST_QUEUE`` (a queue of the test's
own), ``CELERY_TEST_EVENTS`` (the events file), ``CELERY_TEST_READY`` (a file the worker
creates once it consumes) and ``CELERY_TEST_LOCKS_CLUSTER`` (1: the locks in cluster mode).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, signals
from kombu.utils.json import register_type

from amqp_locks.celery import Singleton

app = Celery("amqp_locks_celery_tests", broker=os.environ.get("CELERY_TEST_BROKER"))
app.conf.update(
    result_backend="rpc://",
    task_default_queue=os.environ.get("CELERY_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    result_expires=600,
    worker_lost_wait=1.0,  # a killed child's WorkerLostError reaches the caller sooner
    # CELERY_TEST_LOCKS_CLUSTER=1: the locks in cluster mode (quorum queues, made on first use).
    amqp_locks_cluster=True if os.environ.get("CELERY_TEST_LOCKS_CLUSTER") == "1" else None,
)


def note(event: str, key: str, **fields: Any) -> None:
    """Append one event line: time, event, key, pid, then `fields` (key=value)."""
    path = os.environ.get("CELERY_TEST_EVENTS")
    if not path:
        return
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    line = f"{time.time():.6f} {event} {key} pid={os.getpid()} {extra}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def by_key(key: str, *_: Any, **__: Any) -> str:
    """A lock key shared by several tasks: the `key` argument alone."""
    return key


def _body(task: Singleton, key: str, seconds: float) -> dict[str, Any]:
    lease = task.lock
    assert lease is not None
    note("start", key, id=task.request.id, token=lease.fencing_token, retries=task.request.retries)
    time.sleep(seconds)
    note("end", key, id=task.request.id)
    return {"pid": os.getpid(), "token": lease.fencing_token}


def singleton(**options: Any) -> Any:
    """`app.task` for a bound `Singleton` task: what each task below varies is its options."""
    return app.task(base=Singleton, bind=True, **options)


def _brief_if_redelivered(task: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """The body, run for 0.2 s only when this delivery is a redelivery (after a death)."""
    redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
    return _body(task, key, 0.2 if redelivered else seconds)


#: A task acknowledged after its run and delivered again when its worker dies.
LATE = {"acks_late": True, "reject_on_worker_lost": True}


@singleton(lock_key=by_key, lock_timeout=120)
def hold(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """One call per key at a time, waiting for the lock."""
    return _body(self, key, seconds)


@singleton(lock_key=["key"], lock_limit=3, lock_timeout=120)
def limited(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """At most three calls per key at a time."""
    return _body(self, key, seconds)


@singleton(lock_key=by_key, on_conflict="skip")
def skipper(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """Does not run while `hold` (same key) runs."""
    return _body(self, key, seconds)


@singleton(lock_key=by_key, on_conflict="retry", lock_retry_countdown=0.3, max_retries=100)
def retrier(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """Retries every 0.3 s while `hold` (same key) runs."""
    return _body(self, key, seconds)


@singleton(lock_key=by_key, on_conflict="retry", lock_retry_countdown=0.1, max_retries=1)
def retrier_short(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """Gives up (TaskLockTimeout) after one retry."""
    return _body(self, key, seconds)


@singleton(lock_key=by_key, lock_timeout=0.5)
def impatient(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """Waits half a second at most (TaskLockTimeout)."""
    return _body(self, key, seconds)


@singleton(lock_key=by_key, lock_timeout=120, **LATE)
def durable(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """Delivered again when its worker dies; the second delivery runs briefly."""
    return _brief_if_redelivered(self, key, seconds)


@singleton(once=True, lock_key=["key"])
def once(self: Singleton, key: str, seconds: float, fail: bool = False) -> dict[str, Any]:
    """At most one call per key queued or running."""
    result = _body(self, key, seconds)
    if fail:
        raise RuntimeError("failing on purpose")
    return result


@singleton(once=True, lock_key=["key"], **LATE)
def once_late(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """`once` acknowledged after the run (delivered again when its worker dies)."""
    return _body(self, key, seconds)


@singleton(once=True, lock_key=["key"], **LATE)
def once_redelivered(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """`once`, delivered again when its worker dies; the second delivery runs briefly."""
    return _brief_if_redelivered(self, key, seconds)


@singleton(once=True, lock_key=["key"])
def once_early(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """`once`, acknowledged early; a delivery after a death (the solo pool's) runs briefly."""
    return _brief_if_redelivered(self, key, seconds)


@singleton(once=True, lock_key=["key"], acks_late=True)
def once_late_acked(self: Singleton, key: str, seconds: float) -> dict[str, Any]:
    """`acks_late` without `reject_on_worker_lost`: a killed prefork child's message is
    acknowledged by its parent, never delivered again."""
    return _body(self, key, seconds)


@singleton(once=True, lock_key=["key"], max_retries=1)
def once_retrying(self: Singleton, key: str, countdown: float) -> int:
    """Retries itself once after `countdown` s: the key stays queued meanwhile."""
    note("start", key, id=self.request.id, retries=self.request.retries)
    note("end", key, id=self.request.id)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return int(self.request.retries)


class Item:
    """An object of the tests' own: its key form is its ``repr``, which says its value."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"Item({self.key!r})"


class Opaque(Item):
    """No key form of its own: its ``repr`` is its address."""

    __repr__ = object.__repr__


# Objects as task arguments through kombu's JSON (no pickle, which Celery refuses as root).
register_type(Item, "test-item", lambda i: i.key, Item)
register_type(Opaque, "test-opaque", lambda i: i.key, Opaque)


@app.task(base=Singleton, bind=True, once=True)
def once_item(self: Singleton, item: Item, seconds: float) -> dict[str, Any]:
    """`once` keyed by an object (the default key: all the arguments)."""
    return _body(self, item.key, seconds)


try:  # the comparison with celery-once on Redis (tests/celery/test_celery_once.py)
    from celery_once import QueueOnce
except ImportError:  # only the bench/dev groups install it
    QueueOnce = None

if QueueOnce is not None:
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ.get("CELERY_TEST_REDIS", ""), "default_timeout": 3600},
    }

    @app.task(base=QueueOnce, bind=True, once={"keys": ["key"]})
    def with_celery_once(self: Any, key: str, seconds: float) -> int:
        """celery-once's QueueOnce: locked from apply_async to after_return."""
        note("start", key, id=self.request.id)
        time.sleep(seconds)
        note("end", key, id=self.request.id)
        return os.getpid()


@signals.task_prerun.connect
def _called(task: Any = None, args: Any = None, **_: Any) -> None:
    """A call began in the worker (before its lock is taken): "called" in the events."""
    if args:
        note("called", str(args[0]), id=getattr(task.request, "id", None))


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = os.environ.get("CELERY_TEST_READY")
    if path:
        with open(path, "w") as fh:
            fh.write(str(os.getpid()))
