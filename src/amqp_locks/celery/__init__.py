"""Celery integration: tasks that hold a lock of their key while they run, with the lock
on the RabbitMQ Celery already uses (``pip install amqp-locks[celery]``, docs/celery.md).

.. code-block:: python

    from amqp_locks.celery import Singleton

    @app.task(base=Singleton, lock_key=["report_id"], on_conflict="skip")
    def build_report(report_id): ...

    @app.task(base=Singleton, lock_key=lambda *a, **k: "partner-api", lock_limit=3)
    def call_partner(order_id): ...

    @app.task(base=Singleton, once=True)           # apply_async raises AlreadyQueued
    def reindex(index): ...                        # while reindex(index) is queued/running

A thin layer over the public API (Broker, Mutex, TokenSemaphore, Lease): a killed worker's
locks are freed by its connection's death, not by a timeout.
"""

from __future__ import annotations

from typing import Any

from ..extras import unavailable

try:
    from celery import signals
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise unavailable("amqp_locks.celery (Celery tasks with locks)", "celery") from exc

from . import config, once
from .config import broker_for, lock_urls
from .keys import UnidentifiableKey, lock_name
from .once import ClaimLost
from .task import AlreadyQueued, Singleton, TaskLockTimeout, is_skipped, skipped

__all__ = [
    "AlreadyQueued",
    "ClaimLost",
    "Singleton",
    "TaskLockTimeout",
    "UnidentifiableKey",
    "broker_for",
    "is_skipped",
    "lock_name",
    "lock_urls",
    "skipped",
]


def _uses_locks(app: Any) -> bool:
    return any(isinstance(t, Singleton) for t in app.tasks.values())


@signals.worker_process_init.connect(weak=False)
def _child_started(**_: Any) -> None:
    """A prefork child: its own Broker, connected now so the first task does not pay for
    the connection (a broker that does not answer is logged; tasks will raise)."""
    from celery._state import get_current_app

    config.forget_inherited()
    once.IN_POOL_CHILD = True  # a killed child's message comes back only if its parent rejects it
    app = get_current_app()
    if not _uses_locks(app):
        return
    try:
        broker_for(app).connect()
    except Exception as exc:  # the worker must start anyway; tasks report it
        config.log.warning("amqp-locks: could not connect the lock broker: %s", exc)


@signals.worker_init.connect(weak=False)
def _worker_starting(sender: Any = None, **_: Any) -> None:
    """Note a solo-pool worker: a killed solo worker's calls come back (once.py)."""
    pool = getattr(sender, "pool_cls", None)
    name = pool if isinstance(pool, str) else f"{getattr(pool, '__module__', '')}"
    once.SOLO_WORKER = name == "solo" or name.endswith("concurrency.solo")


@signals.worker_process_shutdown.connect(weak=False)
@signals.worker_shutdown.connect(weak=False)
def _process_ending(**_: Any) -> None:
    """Close this process's Brokers: locks still held are freed with the connection."""
    config.close_all()


@signals.task_revoked.connect(weak=False)
def _revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A ``once`` task revoked (or expired) before it ran, or terminated: free its key
    (its keeper, then the claim unless another call of the key is bound to it)."""
    if not isinstance(sender, Singleton) or not sender.once or request is None:
        return
    try:
        sender.forget_once(request.args or (), request.kwargs or {}, task_id=request.id)
    except Exception:
        config.log.warning(
            "amqp-locks: could not free the key of revoked task %s",
            getattr(request, "id", "?"),
            exc_info=True,
        )
