"""Prometheus metrics for amqp-locks (extra `metrics`: `pip install amqp-locks[metrics]`).

`enable()` subscribes to :mod:`amqp_locks.events` and records:

- `amqp_locks_acquire_seconds` (histogram; kind, name, outcome): how long acquire calls
  took — the wait for a contended lock included;
- `amqp_locks_waiters` (gauge; kind, name): acquire calls in progress in this process —
  waiting for the lock (an uncontended or non-blocking call counts for its round trips);
- `amqp_locks_hold_seconds` (histogram; kind, name, end=released|lost): how long locks
  were held;
- `amqp_locks_held` (gauge; kind, name): locks held by this process now;
- `amqp_locks_lost_total` (counter; kind, name): leases lost;
- `amqp_locks_master` (gauge; locker, name): 1 while a LockableService is master;
- `amqp_locks_demotions_total` (counter; locker, name): masters demoted to standby by a
  failed keep-alive;
- `amqp_locks_keep_alive_failures_total` (counter; locker, name, reason=failed|error|
  timeout): keep-alive checks that did not confirm the lock;
- `amqp_locks_connections_up` (gauge): broker connections of this process that are open;
- `amqp_locks_reconnects_total` (counter): connections opened again after a loss.

The `name` label has one value per lock name: with many dynamic names (per user, per
job) the series grow without bound. ``enable(name_label=False)`` leaves it out of every
metric (the series are then per kind / locker only).

Serve them with `prometheus_client.start_http_server(port)` or your framework's exporter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import events
from .extras import unavailable

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_unsubscribe: Callable[[], None] | None = None


class _Levels:
    """Gauges that go up and down by events: never below zero (a lock taken, or a call
    begun, before enable() and ended after it is not counted at all)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[int, tuple[str, ...]], int] = {}

    def add(self, gauge: Any, labels: tuple[str, ...], delta: int) -> None:
        with self._lock:
            key = (id(gauge), labels)
            value = self._values.get(key, 0) + delta
            if value < 0:
                return
            self._values[key] = value
            (gauge.labels(*labels) if labels else gauge).set(value)


@dataclass
class _Collectors:
    """The metrics registered in one registry, with one label layout."""

    registry: Any
    name_label: bool
    acquire: Any
    waiters: Any
    hold: Any
    held: Any
    lost: Any
    master: Any
    demotions: Any
    keep_alive_failures: Any
    connections_up: Any
    reconnects: Any
    #: gauge levels, kept across disable()/enable()
    levels: _Levels = field(default_factory=lambda: _Levels())
    #: open connections seen, by connection name (a "down" of another is not counted)
    live: dict[str, int] = field(default_factory=dict)


#: Collectors already registered, one entry per registry: a later enable() reuses them
#: (registering the same names twice raises prometheus_client's "Duplicated timeseries").
_registered: list[_Collectors] = []
_state_lock = threading.Lock()


def _create(reg: Any, name_label: bool) -> _Collectors:
    from prometheus_client import Counter, Gauge, Histogram

    n = ["name"] if name_label else []

    def metric(cls: Any, name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> Any:
        """One collector of `reg`; `labels`: the first, then ``name`` if enabled, the rest."""
        names = [labels[0], *n, *labels[1:]] if labels else []
        return cls(f"amqp_locks_{name}", doc, names, registry=reg, **kw)

    return _Collectors(
        registry=reg,
        name_label=name_label,
        acquire=metric(
            Histogram,
            "acquire_seconds",
            "Duration of acquire calls, waiting included",
            ("kind", "outcome"),
            buckets=_BUCKETS,
        ),
        waiters=metric(
            Gauge, "waiters", "Acquire calls in progress (waiting for the lock)", ("kind",)
        ),
        hold=metric(
            Histogram, "hold_seconds", "How long locks were held", ("kind", "end"), buckets=_BUCKETS
        ),
        held=metric(Gauge, "held", "Locks held by this process", ("kind",)),
        lost=metric(Counter, "lost", "Leases lost", ("kind",)),
        master=metric(Gauge, "master", "1 while this process is master", ("locker",)),
        demotions=metric(
            Counter, "demotions", "Masters demoted to standby by a failed keep-alive", ("locker",)
        ),
        keep_alive_failures=metric(
            Counter,
            "keep_alive_failures",
            "Keep-alive checks that did not confirm the lock",
            ("locker", "reason"),
        ),
        connections_up=metric(Gauge, "connections_up", "Open broker connections of this process"),
        reconnects=metric(Counter, "reconnects", "Broker connections opened again after a loss"),
    )


def _unregister(c: _Collectors) -> None:
    for metric in (
        c.acquire,
        c.waiters,
        c.hold,
        c.held,
        c.lost,
        c.master,
        c.demotions,
        c.keep_alive_failures,
        c.connections_up,
        c.reconnects,
    ):
        c.registry.unregister(metric)


def _collectors(reg: Any, name_label: bool) -> _Collectors:
    """The registry's collectors: reused when their labels fit, else replaced."""
    for c in _registered:
        if c.registry is reg:
            if c.name_label == name_label:
                return c
            _unregister(c)
            _registered.remove(c)
            break
    c = _create(reg, name_label)
    _registered.append(c)
    return c


def enable(registry: Any = None, *, name_label: bool = True) -> None:
    """Start recording (idempotent). `registry` defaults to prometheus_client's global.

    ``name_label=False`` drops the `name` label from every metric: use it when lock
    names are dynamic (one series per name otherwise, without bound). Calling `enable()`
    again after `disable()` goes on with the same metrics (their values are kept);
    another `name_label` re-registers them with the new labels (values start again)."""
    global _unsubscribe
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # the extra is not installed
        raise unavailable("amqp_locks.metrics (Prometheus)", "metrics") from None
    with _state_lock:
        if _unsubscribe is not None:
            return
        reg = registry if registry is not None else REGISTRY
        c = _collectors(reg, name_label)
        _unsubscribe = events.subscribe(_listener(c))


def _listener(c: _Collectors) -> Callable[[events.Event], None]:
    levels = c.levels
    live = c.live
    live_lock = threading.Lock()

    def key(e: events.Event) -> tuple[str, ...]:
        return (e.kind, e.name) if c.name_label else (e.kind,)

    def on_event(e: events.Event) -> None:
        t = e.type
        if t == "acquiring":
            levels.add(c.waiters, key(e), +1)
        elif t == "acquire":
            levels.add(c.waiters, key(e), -1)
            c.acquire.labels(*key(e), e.detail).observe(e.seconds)
            if e.detail == "granted":
                levels.add(c.held, key(e), +1)
        elif t in ("release", "lost"):
            end = "released" if t == "release" else "lost"
            c.hold.labels(*key(e), end).observe(e.seconds)
            levels.add(c.held, key(e), -1)
            if t == "lost":
                c.lost.labels(*key(e)).inc()
        elif t == "state":
            c.master.labels(*key(e)).set(1 if e.detail == "master" else 0)
        elif t == "demoted":
            c.demotions.labels(*key(e)).inc()
        elif t == "keep_alive":
            if e.detail != "ok":
                c.keep_alive_failures.labels(*key(e), e.detail).inc()
        elif t == "connection":
            with live_lock:
                if e.detail.startswith("down"):
                    if not live.get(e.name):
                        return
                    live[e.name] -= 1
                    delta = -1
                else:
                    live[e.name] = live.get(e.name, 0) + 1
                    delta = +1
            levels.add(c.connections_up, (), delta)
            if e.detail == "reconnected":
                c.reconnects.inc()

    return on_event


def disable() -> None:
    """Stop recording (the metrics stay registered, with their last values)."""
    global _unsubscribe
    with _state_lock:
        if _unsubscribe is not None:
            _unsubscribe()
            _unsubscribe = None
