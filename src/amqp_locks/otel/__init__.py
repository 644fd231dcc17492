"""OpenTelemetry traces and metrics for amqp-locks (extra `otel`: ``pip install
amqp-locks[otel]``; docs/observability.md).

``AmqpLocksInstrumentor().instrument(tracer_provider=..., meter_provider=...)`` patches
the one place every acquire goes through (``LockObject.acquire_on_loop``: mutex, persistent and
token semaphores, both halves of the read-write lock, sync and asyncio alike, and what
Celery, tooz and the lockers build on them) and the administration cores, and subscribes
to :mod:`amqp_locks.events`; ``uninstrument()`` puts everything back. Until then nothing
of OpenTelemetry is imported by the library and no lock call pays for it.

``instrument(name_attribute=False)`` leaves the lock name out of every span and metric
(names can be unbounded or private): the same switch as
``amqp_locks.metrics.enable(name_label=False)``. ``opentelemetry-instrument python
app.py`` finds the instrumentor by its ``opentelemetry_instrumentor`` entry point.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ..extras import unavailable

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
        BaseInstrumentor,
    )
except ImportError:  # the extra is not installed
    raise unavailable("amqp_locks.otel (OpenTelemetry)", "otel") from None

from .. import __version__, events
from .meters import Recorder
from .tracing import Tracing

#: What the instrumentor instruments (opentelemetry-instrumentation checks it is installed).
_instruments = ("amqp-locks",)

__all__ = ["AmqpLocksInstrumentor"]


class AmqpLocksInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Spans for every acquire, hold, election term and administration call, and the
    metrics of :mod:`amqp_locks.metrics` through the OpenTelemetry meter.

    Keyword arguments of :meth:`instrument`: ``tracer_provider`` and ``meter_provider``
    (default: the global ones), ``name_attribute`` (default True: the lock name on spans
    and metrics)."""

    _tracing: Tracing | None = None
    _unsubscribe: Callable[[], None] | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        name_attribute = bool(kwargs.get("name_attribute", True))
        tracer = _trace.get_tracer(
            "amqp_locks.otel", __version__, tracer_provider=kwargs.get("tracer_provider")
        )
        meter = _metrics.get_meter(
            "amqp_locks.otel", __version__, meter_provider=kwargs.get("meter_provider")
        )
        # A provider known to do nothing (the API's no-op ones) costs nothing at all: no
        # patch for its tracer, no listener for its meter.
        tracing = None if isinstance(tracer, _trace.NoOpTracer) else Tracing(tracer, name_attribute)
        recorder = (
            None if isinstance(meter, _metrics.NoOpMeter) else Recorder(meter, name_attribute)
        )
        listeners = [x.on_event for x in (tracing, recorder) if x is not None]
        if tracing is not None:
            tracing.patch()
        self._tracing = tracing
        if len(listeners) == 1:
            self._unsubscribe = events.subscribe(listeners[0])
        elif listeners:
            trace_event, record_event = listeners

            def on_event(event: events.Event) -> None:
                trace_event(event)
                record_event(event)

            self._unsubscribe = events.subscribe(on_event)

    def _uninstrument(self, **kwargs: Any) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._tracing is not None:
            self._tracing.unpatch()
            self._tracing = None
