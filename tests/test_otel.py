"""amqp_locks.otel: spans and metrics of every primitive, sync and asyncio, read with the
OpenTelemetry SDK's in-memory exporter and metric reader against the test broker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from amqp_locks import (
    AmqpLocker,
    Broker,
    LockableService,
    Mutex,
    PersistentSemaphore,
    ReadWriteLock,
    SemaphoreAdmin,
    SemaphoreNotFound,
    TokenAdmin,
    TokenSemaphore,
    aio,
    events,
)
from amqp_locks.otel import AmqpLocksInstrumentor
from tests.faultproxy import FaultProxy

ROOT = Path(__file__).resolve().parent.parent


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer = self.tracer_provider.get_tracer("test")

    def finished(self, prefix: str = "") -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name.startswith(prefix)]

    def one(self, name: str) -> ReadableSpan:
        found = self.finished(name)
        assert len(found) == 1, [s.name for s in self.spans.get_finished_spans()]
        return found[0]

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        out: list[Any] = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == metric:
                        out.extend(m.data.data_points)
        return out


def instrument(name_attribute: bool = True) -> Iterator[Telemetry]:
    t = Telemetry()
    AmqpLocksInstrumentor().instrument(
        tracer_provider=t.tracer_provider,
        meter_provider=t.meter_provider,
        name_attribute=name_attribute,
    )
    try:
        yield t
    finally:
        AmqpLocksInstrumentor().uninstrument()


@pytest.fixture
def otel() -> Iterator[Telemetry]:
    yield from instrument()


#: Each primitive: a lock object of `name` on `broker` (setting up what needs it).
def _mutex(b: Any, name: str) -> Any:
    return Mutex(b, name)


def _semaphore(b: Any, name: str) -> Any:
    SemaphoreAdmin(b, name).create(2)
    return PersistentSemaphore(b, name)


def _token(b: Any, name: str) -> Any:
    TokenAdmin(b, name).setup(2)
    return TokenSemaphore(b, name)


def _read(b: Any, name: str) -> Any:
    return ReadWriteLock(b, name).read_lock


def _write(b: Any, name: str) -> Any:
    return ReadWriteLock(b, name).write_lock


PRIMITIVES: dict[str, tuple[Callable[[Any, str], Any], str]] = {
    "mutex": (_mutex, "mutex"),
    "semaphore": (_semaphore, "semaphore"),
    "token": (_token, "token"),
    "read": (_read, "rwlock"),
    "write": (_write, "rwlock"),
}


def _check_pair(otel: Telemetry, parent: Any, kind: str, name: str, token: int) -> None:
    """One acquire and one hold span, both children of `parent`, with the grant's facts."""
    acquire = otel.one(f"acquire {kind}")
    hold = otel.one(f"hold {kind}")
    for span in (acquire, hold):
        assert span.parent is not None and span.parent.span_id == parent.span_id
        assert span.context.trace_id == parent.trace_id
        assert span.attributes["amqp_locks.lock.kind"] == kind
        assert span.attributes["amqp_locks.lock.name"] == name
        assert span.attributes["amqp_locks.mode"] == "single_node"
        assert span.attributes["amqp_locks.fencing_token"] == token
        assert span.attributes["server.address"] == "127.0.0.1"
    assert acquire.attributes["amqp_locks.outcome"] == "granted"
    assert acquire.attributes["amqp_locks.reconnects"] == 0
    assert 0 <= acquire.attributes["amqp_locks.wait"] < 30
    assert hold.attributes["amqp_locks.hold.end"] == "released"
    assert hold.status.status_code is StatusCode.UNSET
    assert [link.context.span_id for link in hold.links] == [acquire.context.span_id]
    assert hold.start_time >= acquire.start_time


@pytest.mark.parametrize("primitive", list(PRIMITIVES))
def test_sync_spans(otel: Telemetry, broker: Broker, name: str, primitive: str) -> None:
    make, kind = PRIMITIVES[primitive]
    lock = make(broker, name)
    otel.spans.clear()
    with otel.tracer.start_as_current_span("caller") as caller, lock as lease:
        token = lease.fencing_token
        assert otel.finished("hold") == []  # open while held
    _check_pair(otel, caller.get_span_context(), kind, name, token)
    if kind == "rwlock":
        access = "read" if primitive == "read" else "write"
        assert otel.one("hold rwlock").attributes["amqp_locks.lock.access"] == access


@pytest.mark.parametrize("primitive", list(PRIMITIVES))
def test_asyncio_spans(otel: Telemetry, amqp_url: str, name: str, primitive: str) -> None:
    make, kind = PRIMITIVES[primitive]
    with Broker(amqp_url) as sync_broker:
        make(sync_broker, name)  # what needs setting up

    async def main() -> tuple[Any, int]:
        async with aio.Broker(amqp_url) as b:
            lock: Any
            if primitive in ("read", "write"):
                rw = aio.ReadWriteLock(b, name)
                lock = rw.read_lock if primitive == "read" else rw.write_lock
            else:
                lock = {"mutex": aio.Mutex, "semaphore": aio.PersistentSemaphore}.get(
                    primitive, aio.TokenSemaphore
                )(b, name)
            otel.spans.clear()
            with otel.tracer.start_as_current_span("caller") as caller:
                async with lock as lease:
                    token = lease.fencing_token
            return caller.get_span_context(), token

    caller, token = asyncio.run(main())
    _check_pair(otel, caller, kind, name, token)


def test_cluster_mode_is_said(otel: Telemetry, amqp_url: str, name: str) -> None:
    """Cluster mode (one node with ``cluster=True``: the mutex is a quorum token)."""
    with Broker(amqp_url, cluster=True) as b, Mutex(b, name) as lease:
        token = lease.fencing_token
    for span in (otel.one("acquire mutex"), otel.one("hold mutex")):
        assert span.attributes["amqp_locks.mode"] == "cluster"
        assert span.attributes["amqp_locks.fencing_token"] == token


def test_outcomes_timeout_refused_error(otel: Telemetry, broker: Broker, name: str) -> None:
    mutex = Mutex(broker, name)
    with mutex:
        assert Mutex(broker, name).acquire(blocking=False) is None
        assert Mutex(broker, name).acquire(timeout=0.2) is None
    with pytest.raises(SemaphoreNotFound):
        PersistentSemaphore(broker, f"{name}-none").acquire(blocking=False)
    outcomes = [s.attributes["amqp_locks.outcome"] for s in otel.finished("acquire")]
    assert sorted(outcomes) == ["error", "granted", "refused", "timeout"]
    timed_out = next(
        s for s in otel.finished("acquire") if s.attributes["amqp_locks.outcome"] == "timeout"
    )
    assert timed_out.attributes["amqp_locks.wait"] >= 0.2
    assert timed_out.attributes["amqp_locks.timeout"] == 0.2
    error = next(s for s in otel.finished("acquire semaphore"))
    assert error.status.status_code is StatusCode.ERROR
    assert error.attributes["error.type"] == "SemaphoreNotFound"
    assert len(otel.finished("hold")) == 1  # only the grant held anything


def test_cancelled_asyncio_acquire(otel: Telemetry, amqp_url: str, name: str) -> None:
    waiting = threading.Event()
    calls: list[str] = []

    def on_event(e: events.Event) -> None:
        if e.type == "acquiring" and e.name == name:
            calls.append(e.type)
            if len(calls) == 2:
                waiting.set()

    unsubscribe = events.subscribe(on_event)

    async def main() -> None:
        async with aio.Broker(amqp_url) as b, aio.Mutex(b, name):
            waiter = asyncio.ensure_future(aio.Mutex(b, name).acquire())
            assert await asyncio.to_thread(waiting.wait, 10)  # the second call waits
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter

    try:
        asyncio.run(main())
    finally:
        unsubscribe()
    outcomes = sorted(s.attributes["amqp_locks.outcome"] for s in otel.finished("acquire"))
    assert outcomes == ["cancelled", "granted"]


def test_loss_ends_the_hold_span_with_an_error(
    otel: Telemetry, proxy: FaultProxy, name: str
) -> None:
    with Broker(proxy.url(), heartbeat=1.0) as b:
        lease = Mutex(b, name).acquire()
        assert lease is not None
        told = threading.Event()
        lease.on_lost(lambda _: told.set())  # runs after the "lost" event
        proxy.reset()  # the holder's connection is dropped
        assert told.wait(20)
        hold = otel.one("hold mutex")
        assert hold.attributes["amqp_locks.hold.end"] == "lost"
        assert hold.status.status_code is StatusCode.ERROR
        [event] = hold.events
        assert event.name == "amqp_locks.lost"
        assert event.attributes["amqp_locks.lost.reason"] == lease.lost_reason
        lease.release()  # counted once, as lost
    [lost] = otel.points("amqp_locks.lost")
    assert lost.value == 1
    assert lost.attributes == {"amqp_locks.lock.kind": "mutex", "amqp_locks.lock.name": name}


def test_metrics(otel: Telemetry, broker: Broker, name: str) -> None:
    sem = _semaphore(broker, name)
    with sem:
        held = {p.value for p in otel.points("amqp_locks.held")}
        assert held == {1}
    assert Mutex(broker, name + "m").acquire(timeout=5).release() is None  # type: ignore[union-attr]
    acquires = {
        (p.attributes["amqp_locks.lock.kind"], p.attributes["amqp_locks.outcome"]): p.count
        for p in otel.points("amqp_locks.acquire.duration")
    }
    assert acquires == {("semaphore", "granted"): 1, ("mutex", "granted"): 1}
    assert {p.value for p in otel.points("amqp_locks.held")} == {0}
    assert {p.value for p in otel.points("amqp_locks.waiters")} == {0}
    ends = [  # (the admin mutex that created the semaphore has a hold too: not ours)
        (p.attributes["amqp_locks.lock.kind"], p.attributes["amqp_locks.hold.end"], p.count)
        for p in otel.points("amqp_locks.hold.duration")
        if (p.attributes["amqp_locks.lock.kind"], p.attributes["amqp_locks.lock.name"])
        in (("semaphore", name), ("mutex", name + "m"))
    ]
    assert sorted(ends) == [("mutex", "released", 1), ("semaphore", "released", 1)]


def test_name_attribute_off(broker: Broker, name: str) -> None:
    for t in instrument(name_attribute=False):
        with Mutex(broker, name):
            pass
        spans = t.finished()
        assert {s.name for s in spans} == {"acquire mutex", "hold mutex"}
        assert all("amqp_locks.lock.name" not in s.attributes for s in spans)
        points = t.points("amqp_locks.acquire.duration") + t.points("amqp_locks.held")
        assert points and all("amqp_locks.lock.name" not in p.attributes for p in points)


def test_tooz_locks_are_read_write_lock_halves(otel: Telemetry, amqp_url: str) -> None:
    from tooz import coordination

    coordinator = coordination.get_coordinator(amqp_url.replace("amqp://", "rabbit://", 1), b"m")
    coordinator.start()
    try:
        lock = coordinator.get_lock(b"otel-tooz")
        assert lock.acquire(blocking=5)
        assert lock.release()
    finally:
        coordinator.stop()
    acquire, hold = otel.one("acquire rwlock"), otel.one("hold rwlock")
    assert acquire.attributes["amqp_locks.outcome"] == "granted"
    assert hold.attributes["amqp_locks.lock.access"] == "write"
    assert hold.attributes["amqp_locks.hold.end"] == "released"


def test_celery_singleton_lock(otel: Telemetry, amqp_url: str) -> None:
    from celery import Celery

    from amqp_locks.celery import Singleton
    from amqp_locks.celery.config import close_all

    app = Celery("otel", broker=amqp_url, set_as_current=False)

    @app.task(base=Singleton, bind=True, shared=False)
    def task(self: Singleton) -> int:
        return self.lock.fencing_token if self.lock is not None else -1

    try:
        with otel.tracer.start_as_current_span("task") as span:
            token = task()  # in-process: the lock is taken and released through the broker
    finally:
        close_all()
    hold = otel.one("hold mutex")
    assert hold.attributes["amqp_locks.fencing_token"] == token > 0
    assert hold.parent is not None and hold.parent.span_id == span.get_span_context().span_id


def test_admin_spans(otel: Telemetry, broker: Broker, amqp_url: str, name: str) -> None:
    with otel.tracer.start_as_current_span("caller") as caller:
        TokenAdmin(broker, name).setup(3)
    SemaphoreAdmin(broker, name + "s").create(2)

    async def main() -> None:
        async with aio.Broker(amqp_url) as b:
            await aio.TokenAdmin(b, name).add_permits(1)

    asyncio.run(main())
    setup = otel.one("setup token")
    assert setup.attributes["amqp_locks.operation"] == "setup"
    assert setup.attributes["amqp_locks.lock.name"] == name
    assert setup.parent is not None and setup.parent.span_id == caller.get_span_context().span_id
    assert otel.one("add_permits token").attributes["amqp_locks.lock.kind"] == "token"
    assert otel.one("create semaphore").attributes["amqp_locks.lock.kind"] == "semaphore"


def test_election_term_span(otel: Telemetry, broker: Broker, name: str) -> None:
    mastered = threading.Event()
    service = LockableService(
        AmqpLocker(broker, name), lambda stop: (mastered.set(), stop.wait(10))
    )
    with otel.tracer.start_as_current_span("caller") as caller:
        service.start()
    assert mastered.wait(20)
    service.stop(10)
    term = otel.one("master AmqpLocker")
    assert term.attributes["amqp_locks.term.end"] == "stopped"
    assert term.parent is not None and term.parent.span_id == caller.get_span_context().span_id
    acquires = otel.finished("acquire mutex")
    assert acquires and acquires[-1].attributes["amqp_locks.outcome"] == "granted"
    [points] = [otel.points("amqp_locks.master")]
    assert {p.value for p in points} == {0}


def test_uninstrument_restores_the_library(broker: Broker, name: str) -> None:
    from amqp_locks.lockobject import LockObject

    original = LockObject.acquire_on_loop
    session = instrument()
    t = next(session)
    assert LockObject.acquire_on_loop is not original
    next(session, None)  # uninstrument
    assert LockObject.acquire_on_loop is original
    with Mutex(broker, name):
        pass
    assert t.finished() == []


def test_noop_providers_patch_nothing(broker: Broker, name: str) -> None:
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    from amqp_locks.events import _listeners
    from amqp_locks.lockobject import LockObject

    original, listeners = LockObject.acquire_on_loop, list(_listeners)
    instrumentor = AmqpLocksInstrumentor()
    instrumentor.instrument(
        tracer_provider=NoOpTracerProvider(), meter_provider=NoOpMeterProvider()
    )
    try:
        assert instrumentor.is_instrumented_by_opentelemetry
        assert LockObject.acquire_on_loop is original and _listeners == listeners
        with Mutex(broker, name):
            pass
    finally:
        instrumentor.uninstrument()


def _run(code: str, *, env: dict[str, str] | None = None, argv: list[str] | None = None) -> str:
    proc = subprocess.run(
        argv or [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_nothing_imported_until_asked(amqp_url: str, name: str) -> None:
    out = _run(
        f"""
        import sys
        from amqp_locks import Broker, Mutex
        with Broker({amqp_url!r}) as b, Mutex(b, {name!r}):
            pass
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    assert out.strip() == "[]"


def test_without_the_extra_the_error_names_it() -> None:
    out = _run(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if the extra were not installed
        from amqp_locks.errors import FeatureUnavailable
        try:
            import amqp_locks.otel
        except FeatureUnavailable as exc:
            print(exc)
        """
    )
    assert "'otel' extra" in out and "amqp-locks[otel]" in out


SCRIPT = """
import os
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from amqp_locks import Broker, Mutex

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # the instrumentor's tracer follows the global one
with Broker(os.environ["AMQP_URL"]) as b, Mutex(b, os.environ["LOCK_NAME"]):
    pass
print(sorted(s.name for s in exporter.get_finished_spans()))
"""


def test_opentelemetry_instrument_finds_the_instrumentor(
    amqp_url: str, name: str, tmp_path: Path
) -> None:
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    exe = Path(sys.executable).with_name("opentelemetry-instrument")
    env = {"AMQP_URL": amqp_url, "LOCK_NAME": name, "OTEL_METRICS_EXPORTER": "none"}
    out = _run("", env=env, argv=[str(exe), sys.executable, str(script)])
    assert out.strip() == "['acquire mutex', 'hold mutex']"
    # The same script without the wrapper: the library is not instrumented.
    out = _run("", env=env, argv=[sys.executable, str(script)])
    assert out.strip() == "[]"
