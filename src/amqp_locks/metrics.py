"""Prometheus metrics for amqp-locks (extra `metrics`: `pip install amqp-locks[metrics]`).

`enable()` subscribes to :mod:`amqp_locks.events` and records:

- `amqp_locks_acquire_seconds` (histogram; kind, name, outcome): how long acquire calls
  took — the wait for a contended lock included;
- `amqp_locks_hold_seconds` (histogram; kind, name, end=released|lost): how long locks
  were held;
- `amqp_locks_held` (gauge; kind, name): locks held by this process now;
- `amqp_locks_lost_total` (counter; kind, name): leases lost;
- `amqp_locks_master` (gauge; locker, name): 1 while a LockableService is master.

Serve them with `prometheus_client.start_http_server(port)` or your framework's exporter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import events

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_unsubscribe: Callable[[], None] | None = None


def enable(registry: Any = None) -> None:
    """Start recording (idempotent). `registry` defaults to prometheus_client's global."""
    global _unsubscribe
    if _unsubscribe is not None:
        return
    try:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError("amqp_locks.metrics needs: pip install 'amqp-locks[metrics]'") from exc
    reg = registry if registry is not None else REGISTRY
    acquire = Histogram(
        "amqp_locks_acquire_seconds",
        "Duration of acquire calls, waiting included",
        ["kind", "name", "outcome"],
        buckets=_BUCKETS,
        registry=reg,
    )
    hold = Histogram(
        "amqp_locks_hold_seconds",
        "How long locks were held",
        ["kind", "name", "end"],
        buckets=_BUCKETS,
        registry=reg,
    )
    held = Gauge("amqp_locks_held", "Locks held by this process", ["kind", "name"], registry=reg)
    lost = Counter("amqp_locks_lost", "Leases lost", ["kind", "name"], registry=reg)
    master = Gauge(
        "amqp_locks_master", "1 while this process is master", ["locker", "name"], registry=reg
    )

    def on_event(e: events.Event) -> None:
        if e.type == "acquire":
            acquire.labels(e.kind, e.name, e.detail).observe(e.seconds)
            if e.detail == "granted":
                held.labels(e.kind, e.name).inc()
        elif e.type in ("release", "lost"):
            end = "released" if e.type == "release" else "lost"
            hold.labels(e.kind, e.name, end).observe(e.seconds)
            held.labels(e.kind, e.name).dec()
            if e.type == "lost":
                lost.labels(e.kind, e.name).inc()
        elif e.type == "state":
            master.labels(e.kind, e.name).set(1 if e.detail == "master" else 0)

    _unsubscribe = events.subscribe(on_event)


def disable() -> None:
    """Stop recording (the metrics stay registered)."""
    global _unsubscribe
    if _unsubscribe is not None:
        _unsubscribe()
        _unsubscribe = None
