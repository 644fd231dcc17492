"""What OpenTelemetry instrumentation costs an uncontended acquire + release
(``python -m benchmarks.run otel-overhead``; quoted in docs/observability.md).

One Broker, ``lease = lock.acquire(); lease.release()`` of a mutex and of a one-permit
token semaphore without fencing (the cheapest acquire: the one where a fixed cost shows
most), each timed four ways:
not instrumented; instrumented with the API's no-op providers (known to do nothing, so
nothing is patched); instrumented with the API's global providers while no SDK is set up
(the patch runs, its spans do not record: what ``opentelemetry-instrument`` without an SDK
gives); instrumented with the SDK
(a tracer provider exporting to its in-memory exporter through the simple processor, a
meter provider read by the in-memory reader). The three run in blocks that take turns,
in a rotating order, so that drift of a shared machine falls on all of them alike; the
figures are the medians over blocks of each block's p50 (wall) and CPU per cycle (client).

On a busy machine the broker's round trips vary more than the instrumentation costs, so
:func:`isolated` also times the instrumentation alone: the acquire and release events and
spans of one grant, on an asyncio loop with a stand-in lock and no broker (CPU per cycle,
with the SDK and with the SDK's spans only, beside the same cycle not instrumented), and
:func:`handoff` the handoff links' own work per handoff (otel/handoff.py): the header
written by a release (notice or re-published token, marshalled into its content frame as
aiormq sends it) and read by the next holder (parsed, checked, linked), beside the same
frames without it.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

from benchmarks.stats import percentile

VARIANTS = ("plain", "noop", "api", "sdk")


def _providers(variant: str) -> tuple[dict[str, Any], Any]:
    """The instrument() arguments of `variant`, and its span exporter (None: none)."""
    if variant == "api":
        return {}, None
    if variant == "noop":
        from opentelemetry.metrics import NoOpMeterProvider
        from opentelemetry.trace import NoOpTracerProvider

        return {
            "tracer_provider": NoOpTracerProvider(),
            "meter_provider": NoOpMeterProvider(),
        }, None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    return {"tracer_provider": tracer_provider, "meter_provider": meter_provider}, exporter


def _locks(broker: Any) -> dict[str, Any]:
    from amqp_locks import Mutex, TokenAdmin, TokenSemaphore

    tag = uuid.uuid4().hex[:8]
    TokenAdmin(broker, f"otel-bench-t-{tag}").setup(1)
    return {
        "mutex": Mutex(broker, f"otel-bench-m-{tag}"),
        "token": TokenSemaphore(broker, f"otel-bench-t-{tag}", fencing=False),
    }


def _cleanup(locks: dict[str, Any]) -> None:
    from amqp_locks import TokenAdmin

    TokenAdmin(locks["token"].broker, locks["token"].name).destroy()


def run(url: str, line: str, blocks: int = 30, cycles: int = 100) -> dict[str, Any]:
    """`blocks` rounds of `cycles` acquire + release per lock and variant on `url`."""
    from amqp_locks import Broker
    from amqp_locks.otel import AmqpLocksInstrumentor

    instrumentor = AmqpLocksInstrumentor()
    setups = {v: _providers(v) if v != "plain" else ({}, None) for v in VARIANTS}
    result: dict[str, Any] = {"line": line, "blocks": blocks, "cycles": cycles, "locks": {}}
    with Broker(url) as broker:
        locks = _locks(broker)
        try:
            for kind, lock in locks.items():
                result["locks"][kind] = _measure(instrumentor, setups, lock, blocks, cycles)
        finally:
            _cleanup(locks)
    result["isolated"] = isolated()
    result["handoff"] = handoff()
    return result


def _measure(
    instrumentor: Any, setups: dict[str, Any], lock: Any, blocks: int, cycles: int
) -> dict[str, Any]:
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    spans = 0
    for _ in range(cycles):  # warm up: connection, channels, the name's first use
        lock.acquire().release()
    for block in range(blocks):
        for i in range(len(VARIANTS)):
            variant = VARIANTS[(block + i) % len(VARIANTS)]
            kwargs, exporter = setups[variant]
            if variant != "plain":
                instrumentor.instrument(**kwargs)
            try:
                samples = []
                c0 = time.process_time()
                for _ in range(cycles):
                    t0 = time.perf_counter()
                    lock.acquire().release()
                    samples.append(time.perf_counter() - t0)
                cpu[variant].append((time.process_time() - c0) / cycles)
            finally:
                if variant != "plain":
                    instrumentor.uninstrument()
            wall[variant].append(percentile(samples, 50))
            if exporter is not None:
                spans += len(exporter.get_finished_spans())
                exporter.clear()
    us = {v: statistics.median(wall[v]) * 1e6 for v in VARIANTS}
    cpu_us = {v: statistics.median(cpu[v]) * 1e6 for v in VARIANTS}
    return {
        "sdk_spans": spans,
        "p50_us": us,
        "cpu_us": cpu_us,
        "noop_ratio": us["noop"] / us["plain"],
        "sdk_extra_us": us["sdk"] - us["plain"],
        "api_ratio": us["api"] / us["plain"],
        "api_cpu_ratio": cpu_us["api"] / cpu_us["plain"],
        "noop_cpu_ratio": cpu_us["noop"] / cpu_us["plain"],
        "sdk_cpu_extra_us": cpu_us["sdk"] - cpu_us["plain"],
        "block_p50_us": {v: [x * 1e6 for x in wall[v]] for v in VARIANTS},
        "block_cpu_us": {v: [x * 1e6 for x in cpu[v]] for v in VARIANTS},
    }


def isolated(rounds: int = 7, cycles: int = 2000) -> dict[str, float]:
    """CPU µs per grant + release of the instrumentation alone (see the module docstring):
    ``plain`` (the events of an observed acquire and its release), ``spans`` (the SDK's
    spans added), ``sdk`` (spans and metrics)."""
    import asyncio
    from types import SimpleNamespace

    from opentelemetry import context
    from yarl import URL

    from amqp_locks import events
    from amqp_locks.otel.meters import Recorder
    from amqp_locks.otel.tracing import Tracing

    (kwargs, exporter) = _providers("sdk")
    tracing = Tracing(kwargs["tracer_provider"].get_tracer("bench"), True)
    recorder = Recorder(kwargs["meter_provider"].get_meter("bench"), True)
    core = SimpleNamespace(cluster=False, connection_name="bench")
    lock: Any = SimpleNamespace(kind="token", name="bench", broker=SimpleNamespace(_core=core))
    session = SimpleNamespace(url=URL("amqp://127.0.0.1:5672/"))

    class Held:  # a held state's fields the spans read (weakly referenced, as HeldState)
        fencing_token = 1
        number = 1

    Held.session = session  # type: ignore[attr-defined]

    async def grant() -> Any:
        return Held()

    async def cycles_of(traced: bool) -> None:
        for _ in range(cycles):
            coro = grant()
            if traced:
                now = time.time_ns()
                coro = tracing._acquire(lock, coro, True, None, context.get_current(), now)
            state = await events.observed("token", "bench", coro)
            events.emit(events.Event("release", "token", "bench", 0.001, source=state))
        exporter.clear()

    def on_both(event: events.Event) -> None:
        tracing.on_event(event)
        recorder.on_event(event)

    out: dict[str, list[float]] = {"plain": [], "spans": [], "sdk": []}
    for _ in range(rounds):
        for variant, listener in (("plain", None), ("spans", tracing.on_event), ("sdk", on_both)):
            unsubscribe = events.subscribe(listener) if listener is not None else None
            c0 = time.process_time()
            asyncio.run(cycles_of(listener is not None))
            out[variant].append((time.process_time() - c0) / cycles * 1e6)
            if unsubscribe is not None:
                unsubscribe()
    return {v: statistics.median(xs) for v, xs in out.items()}


def handoff(rounds: int = 7, n: int = 5000) -> dict[str, float]:
    """CPU µs per handoff of the handoff links (see the module docstring): ``notice`` and
    ``token`` the releasing side (the value and the frame carrying it, less the same frame
    without it), ``read_notice`` and ``read_token`` the next holder's (parse, bind, add the
    link to a recording SDK span)."""
    from types import SimpleNamespace

    from pamqp import frame
    from pamqp.commands import Basic
    from pamqp.header import ContentHeader

    from amqp_locks.otel import handoff as h
    from amqp_locks.queue_lease import LeaseState
    from amqp_locks.tokens.message import carrying
    from amqp_locks.tokens.permit import PermitState

    (kwargs, _) = _providers("sdk")
    tracer = kwargs["tracer_provider"].get_tracer("bench")
    hold = tracer.start_span("hold").get_span_context()
    releasing = (h.traceparent(hold), 2**52 + 41, 1)
    base = {"amqp-locks-fencing": "carried", "amqp-locks-epoch": 7, "amqp-locks-count": 3}
    delivered = SimpleNamespace(
        header=SimpleNamespace(properties=Basic.Properties(headers=dict(base))),
        delivery=SimpleNamespace(redelivered=False),
    )
    with_header = h.wrap_carrying(carrying)

    def send(props: Basic.Properties) -> None:
        frame.marshal(ContentHeader(0, 1, props), 1)

    def notice(traced: bool) -> None:
        headers = {h.HEADER: h.notice_value(releasing)} if traced else None
        send(Basic.Properties(delivery_mode=1, headers=headers))

    def token(traced: bool) -> None:
        reset = h.RELEASING.set(releasing if traced else None)
        try:
            send((with_header if traced else carrying)(delivered, 7, 4))
        finally:
            h.RELEASING.reset(reset)

    lease = LeaseState.__new__(LeaseState)
    lease.fencing_token, lease.number = releasing[1] + 1, 1
    notices = [h.notice_value(releasing)]
    permit = PermitState.__new__(PermitState)
    reset = h.RELEASING.set(releasing)
    permit.message = SimpleNamespace(  # type: ignore[assignment]
        header=SimpleNamespace(properties=with_header(delivered, 7, 4)),
        delivery=SimpleNamespace(redelivered=False),
    )
    h.RELEASING.reset(reset)

    def read(state: Any, kinds: list[Any]) -> None:
        span = tracer.start_span("acquire")
        previous = h.previous_hold(state, kinds)
        assert previous is not None
        span.add_link(previous, {"amqp_locks.handoff": "bench"})

    def plain_span(state: Any, kinds: list[Any]) -> None:
        tracer.start_span("acquire")

    jobs: dict[str, tuple[Any, Any]] = {
        "notice": (lambda: notice(True), lambda: notice(False)),
        "token": (lambda: token(True), lambda: token(False)),
        "read_notice": (lambda: read(lease, notices), lambda: plain_span(lease, notices)),
        "read_token": (lambda: read(permit, []), lambda: plain_span(permit, [])),
    }
    out: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(rounds):
        for key, (traced, plain) in jobs.items():
            cost = []
            for job in (traced, plain):
                c0 = time.process_time()
                for _ in range(n):
                    job()
                cost.append((time.process_time() - c0) / n * 1e6)
            out[key].append(cost[0] - cost[1])
    return {k: statistics.median(xs) for k, xs in out.items()}


def table(r: dict[str, Any]) -> str:
    rows = [
        "| lock | variant | acquire + release p50 (µs) | client CPU per cycle (µs) |",
        "|---|---|---|---|",
    ]
    notes = []
    for kind, m in r["locks"].items():
        for v in VARIANTS:
            rows.append(f"| {kind} | {v} | {m['p50_us'][v]:.0f} | {m['cpu_us'][v]:.0f} |")
        notes.append(
            f"{kind}: no-op {100 * (m['noop_ratio'] - 1):+.1f}% wall, "
            f"{100 * (m['noop_cpu_ratio'] - 1):+.1f}% CPU (target within 5%); "
            f"API without SDK {100 * (m['api_ratio'] - 1):+.1f}% wall, "
            f"{100 * (m['api_cpu_ratio'] - 1):+.1f}% CPU; "
            f"SDK {m['sdk_extra_us']:+.0f} µs wall, {m['sdk_cpu_extra_us']:+.0f} µs CPU "
            "(target within 50 µs)"
        )
    if "isolated" in r:
        i = r["isolated"]
        notes.append(
            f"instrumentation alone (no broker), CPU per grant + release: "
            f"{i['plain']:.1f} µs not instrumented, {i['spans']:.1f} µs with the SDK's spans, "
            f"{i['sdk']:.1f} µs with spans and metrics"
        )
    if "handoff" in r:
        x = r["handoff"]
        notes.append(
            f"handoff links alone (no broker), CPU per handoff beside the same without: "
            f"release {x['notice']:.1f} µs (notice), {x['token']:.1f} µs (token); "
            f"next holder {x['read_notice']:.1f} µs (notice), {x['read_token']:.1f} µs (token)"
        )
    notes.append(
        f"{r['blocks']} blocks of {r['cycles']} cycles per lock and variant, RabbitMQ {r['line']}"
    )
    return "\n".join([*rows, "", *notes])
