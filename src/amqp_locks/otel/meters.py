"""The metrics of :mod:`amqp_locks.metrics` through the OpenTelemetry meter, fed by the
same events, named in OpenTelemetry's style with units (both may run at once):

=====================================  ==============  =====================================
instrument (unit)                      amqp_locks.metrics  attributes
=====================================  ==============  =====================================
``amqp_locks.acquire.duration`` (s)    acquire_seconds    kind, name, outcome
``amqp_locks.waiters`` ({call})        waiters            kind, name
``amqp_locks.hold.duration`` (s)       hold_seconds       kind, name, hold.end
``amqp_locks.held`` ({lock})           held               kind, name
``amqp_locks.lost`` ({lease})          lost_total         kind, name
``amqp_locks.master`` ({service})      master             locker, name
``amqp_locks.demotions`` ({demotion})  demotions_total    locker, name
``amqp_locks.keep_alive.failures``     keep_alive_        locker, name, keep_alive.result
({failure})                            failures_total
``amqp_locks.connections`` ({conn.})   connections_up     -
``amqp_locks.reconnects`` ({conn.})    reconnects_total   -
=====================================  ==============  =====================================

The up-down counters are observed: their levels are kept here and read at collection, so
an event costs a dict update, not an SDK call. They never go below zero: a lock taken (or
a call begun) before ``instrument()`` and ended after it is not counted at all, as in
amqp_locks.metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from .. import events
from .tracing import END, KIND, LOCKER, NAME, OUTCOME

#: Histogram bucket bounds (seconds): amqp_locks.metrics' buckets.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Recorder:
    """One ``instrument()``'s instruments and the levels of its up-down counters."""

    def __init__(self, meter: Meter, name_attribute: bool) -> None:
        self.name_attribute = name_attribute
        seconds = {"unit": "s", "explicit_bucket_boundaries_advisory": list(BUCKETS)}
        self.acquire = meter.create_histogram(
            "amqp_locks.acquire.duration",
            description="Duration of acquire calls, waiting included",
            **seconds,  # type: ignore[arg-type]
        )
        self.hold = meter.create_histogram(
            "amqp_locks.hold.duration",
            description="How long locks were held",
            **seconds,  # type: ignore[arg-type]
        )
        self.lost = meter.create_counter("amqp_locks.lost", "{lease}", "Leases lost")
        self.demotions = meter.create_counter(
            "amqp_locks.demotions",
            "{demotion}",
            "Masters demoted to standby by a failed keep-alive",
        )
        self.keep_alive_failures = meter.create_counter(
            "amqp_locks.keep_alive.failures",
            "{failure}",
            "Keep-alive checks that did not confirm the lock",
        )
        self.reconnects = meter.create_counter(
            "amqp_locks.reconnects", "{connection}", "Broker connections opened again after a loss"
        )
        self._lock = threading.Lock()
        #: The levels of the up-down counters, by (instrument, attributes): kept here and
        #: observed at collection, so a grant costs a dict update, not an SDK call.
        self._levels: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self._live: dict[str, int] = {}
        levels = (
            ("waiters", "{call}", "Acquire calls in progress (waiting for the lock)"),
            ("held", "{lock}", "Locks held by this process"),
            ("master", "{service}", "1 while this process's service is master"),
            ("connections", "{connection}", "Open broker connections of this process"),
        )
        for which, unit, description in levels:
            meter.create_observable_up_down_counter(
                f"amqp_locks.{which}", [self._observer(which)], unit, description
            )

    def _observer(self, which: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                found = [(a, v) for (w, a), v in self._levels.items() if w == which]
            return [Observation(value, dict(attrs)) for attrs, value in found]

        return observe

    def _attrs(self, first: str, e: events.Event) -> dict[str, str]:
        attrs = {first: e.kind}
        if self.name_attribute:
            attrs[NAME] = e.name
        return attrs

    def _level(self, which: str, attrs: dict[str, str], delta: int) -> None:
        """Move an up-down counter by `delta` unless that takes it below zero."""
        key = (which, tuple(attrs.items()))
        with self._lock:
            value = self._levels.get(key, 0) + delta
            if value >= 0:
                self._levels[key] = value

    def on_event(self, e: events.Event) -> None:
        t = e.type
        if t == "acquiring":
            self._level("waiters", self._attrs(KIND, e), +1)
        elif t == "acquire":
            attrs = self._attrs(KIND, e)
            self._level("waiters", attrs, -1)
            self.acquire.record(e.seconds, {**attrs, OUTCOME: e.detail})
            if e.detail == "granted":
                self._level("held", attrs, +1)
        elif t in ("release", "lost"):
            attrs = self._attrs(KIND, e)
            self.hold.record(e.seconds, {**attrs, END: "released" if t == "release" else "lost"})
            self._level("held", attrs, -1)
            if t == "lost":
                self.lost.add(1, attrs)
        elif t == "state":
            attrs = self._attrs(LOCKER, e)
            key = ("master", tuple(attrs.items()))
            with self._lock:
                self._levels[key] = 1 if e.detail == "master" else 0
        elif t == "demoted":
            self.demotions.add(1, self._attrs(LOCKER, e))
        elif t == "keep_alive":
            if e.detail != "ok":
                attrs = self._attrs(LOCKER, e)
                self.keep_alive_failures.add(1, {**attrs, "amqp_locks.keep_alive.result": e.detail})
        elif t == "connection":
            with self._lock:
                if e.detail.startswith("down"):
                    if not self._live.get(e.name):
                        return
                    self._live[e.name] -= 1
                    delta = -1
                else:
                    self._live[e.name] = self._live.get(e.name, 0) + 1
                    delta = +1
            self._level("connections", {}, delta)
            if e.detail == "reconnected":
                self.reconnects.add(1)
