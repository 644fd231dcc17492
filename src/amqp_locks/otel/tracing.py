"""The spans: acquire (the call to its outcome), hold (the grant to the release or the
loss), master (an election term) and one per administration call.

Every acquire goes through ``LockObject.acquire_on_loop`` (the sync lock objects, their asyncio
twins, the read-write lock's halves, and whatever is built on them). Its coroutine is
*made* in the caller's thread or task and *run* on the Broker's private I/O thread, where
the caller's context is not current: the patched method captures the context (and the
start time) when it is called and hands both to the coroutine, so the spans are children
of the caller's current span wherever the work runs. A hold span ends on the "release" or
"lost" event of its own held state (:attr:`amqp_locks.events.Event.source`).

Handoff links (otel/handoff.py): the wrapped releases say whose hold is being released
while the release writes its notice or re-publishes its token; the wrapped acquire
collects the notices its waiters receive and, on a grant, links the previous holder's
hold span when what handed the lock on names it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Link, Span, Status, StatusCode, Tracer

from .. import events
from ..lockobject import LockObject
from ..queue_lease import LeaseState
from ..semaphore.admin import SemaphoreAdminCore
from ..service import LockableService
from ..tokens import permit
from ..tokens.admin import TokenAdminCore
from ..tokens.permit import PermitState
from ..transport.queue_ops import QueueOps
from ..transport.wakeups import Waiter
from . import handoff

# Attribute keys (no OpenTelemetry semantic convention covers locks; ours are namespaced).
KIND = "amqp_locks.lock.kind"
NAME = "amqp_locks.lock.name"
ACCESS = "amqp_locks.lock.access"  # read-write lock: "read" | "write"
MODE = "amqp_locks.mode"  # "single_node" | "cluster"
BLOCKING = "amqp_locks.blocking"
TIMEOUT = "amqp_locks.timeout"
OUTCOME = "amqp_locks.outcome"  # granted | timeout | refused | cancelled | error
WAIT = "amqp_locks.wait"  # seconds from the call to its outcome
RECONNECTS = "amqp_locks.reconnects"
TOKEN = "amqp_locks.fencing_token"
NUMBER = "amqp_locks.lock.number"  # slot / permit id (1 for a mutex)
END = "amqp_locks.hold.end"  # released | lost
REASON = "amqp_locks.lost.reason"
LOCKER = "amqp_locks.locker"
OPERATION = "amqp_locks.operation"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
#: On the acquire span's link to the previous holder's hold span.
HANDOFF = "amqp_locks.handoff"  # "notice" | "token": what carried the context

#: The administration cores (sync and asyncio admin objects both drive them) and their
#: coroutine methods that get a span: (class, lock kind, method names).
ADMIN: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (
        TokenAdminCore,
        "token",
        ("setup", "add_permits", "remove_permits", "audit", "repair", "destroy"),
    ),
    (
        SemaphoreAdminCore,
        "semaphore",
        ("create", "destroy", "add_slots", "remove_slots", "repair_fence"),
    ),
)


def _fail(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.set_attribute(ERROR_TYPE, type(exc).__qualname__)


class Tracing:
    """The spans of one ``instrument()`` (see the module docstring)."""

    def __init__(self, tracer: Tracer, name_attribute: bool) -> None:
        self.tracer = tracer
        self.name_attribute = name_attribute
        #: Open hold spans by held state (a state gone without an event: span dropped).
        self._holds: weakref.WeakKeyDictionary[Any, Span] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        #: Reconnections seen, by connection name (an acquire reads the difference).
        self._reconnects: collections.Counter[str] = collections.Counter()
        #: Open election-term spans by (locker class, name).
        self._terms: dict[tuple[str, str], Span] = {}
        self._patched: list[tuple[Any, str, Any]] = []

    # --- patching ------------------------------------------------------------------------

    def _patch(self, cls: Any, attr: str, make: Callable[[Any], Any]) -> None:
        original = cls.__dict__[attr]
        self._patched.append((cls, attr, original))
        setattr(cls, attr, functools.wraps(original)(make(original)))

    def patch(self) -> None:
        self._patch(LockObject, "acquire_on_loop", self._wrap_acquire)
        for cls, kind, methods in ADMIN:
            for method in methods:
                self._patch(cls, method, functools.partial(self._wrap_admin, kind, method))
        self._patch(LockableService, "start", self._wrap_start)
        self._patch(LockableService, "run", self._wrap_run)
        # Handoff links (otel/handoff.py): the releasing side writes the header ...
        self._patch(LeaseState, "release", self._wrap_release)
        self._patch(PermitState, "release", self._wrap_release)
        self._patch(QueueOps, "notify_soon", handoff.wrap_notify)
        self._patch(QueueOps, "delete_and_notify", handoff.wrap_delete_and_notify)
        self._patch(permit, "carrying", handoff.wrap_carrying)
        # ... and the waiting side reads it.
        self._patch(Waiter, "__init__", handoff.wrap_waiter_init)
        self._patch(Waiter, "on_notice", handoff.wrap_on_notice)

    def unpatch(self) -> None:
        """Put the originals back; end what is still open (its end is not known)."""
        for cls, attr, original in reversed(self._patched):
            setattr(cls, attr, original)
        self._patched.clear()
        with self._lock:
            spans = [*self._holds.values(), *self._terms.values()]
            self._holds.clear()
            self._terms.clear()
        for span in spans:
            span.end()

    # --- acquire and hold ----------------------------------------------------------------

    def _wrap_acquire(self, original: Any) -> Any:
        def _acquire(
            lock: LockObject, blocking: bool, timeout: float | None
        ) -> Coroutine[Any, Any, Any]:
            # In the caller's thread/task: its context and the call's start.
            return self._acquire(
                lock,
                original(lock, blocking, timeout),
                blocking,
                timeout,
                otel_context.get_current(),
                time.time_ns(),
            )

        return _acquire

    def _lock_attributes(self, kind: str, name: str) -> dict[str, Any]:
        attrs: dict[str, Any] = {KIND: kind}
        if self.name_attribute:
            attrs[NAME] = name
        return attrs

    async def _acquire(
        self,
        lock: LockObject,
        coro: Coroutine[Any, Any, Any],
        blocking: bool,
        timeout: float | None,
        parent: otel_context.Context,
        start: int,
    ) -> Any:
        core = lock.broker.core
        attrs = self._lock_attributes(lock.kind, lock.name)
        attrs[MODE] = "cluster" if core.cluster else "single_node"
        shared = getattr(lock, "shared", None)
        if shared is not None:
            attrs[ACCESS] = "read" if shared else "write"
        span = self.tracer.start_span(
            f"acquire {lock.kind}",
            context=parent,
            attributes={**attrs, BLOCKING: blocking}
            | ({} if timeout is None else {TIMEOUT: float(timeout)}),
            start_time=start,
        )
        connection = core.connection_name
        reconnects = self._reconnects[connection]
        outcome = "error"
        notices: list[Any] = []  # handoff headers its waiters received (handoff.py)
        notices_reset = handoff.NOTICES.set(notices)
        try:
            state = await coro
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except BaseException as exc:
            _fail(span, exc)
            raise
        else:
            if state is None:
                outcome = "timeout" if blocking and timeout != 0 else "refused"
            else:
                outcome = "granted"
                previous = handoff.previous_hold(state, notices)
                if previous is not None:
                    how = "token" if isinstance(state, PermitState) else "notice"
                    span.add_link(previous, {HANDOFF: how})
                self._hold(state, span, parent, attrs)
            return state
        finally:
            handoff.NOTICES.reset(notices_reset)
            if span.is_recording():
                span.set_attributes(
                    {
                        OUTCOME: outcome,
                        WAIT: (time.time_ns() - start) / 1e9,
                        RECONNECTS: self._reconnects[connection] - reconnects,
                    }
                )
            span.end()

    def _wrap_release(self, original: Any) -> Any:
        async def release(state: Any) -> None:
            # While the hold span is open (the release's event ends it), say whose it is.
            span = self._holds.get(state)
            context = None if span is None else span.get_span_context()
            if context is None or not context.is_valid:
                return await original(state)  # type: ignore[no-any-return]
            releasing = (handoff.traceparent(context), state.fencing_token, state.number)
            reset = handoff.RELEASING.set(releasing)
            try:
                return await original(state)  # type: ignore[no-any-return]
            finally:
                handoff.RELEASING.reset(reset)

        return release

    def _hold(
        self, state: Any, acquire: Span, parent: otel_context.Context, attrs: dict[str, Any]
    ) -> None:
        """Start the hold span of a grant (a sibling of its acquire span, linked to it)."""
        granted = {TOKEN: state.fencing_token, NUMBER: state.number}
        url = state.session.url
        if url.host:
            granted[SERVER_ADDRESS] = url.host
            granted[SERVER_PORT] = url.port or 5672
        if acquire.is_recording():
            acquire.set_attributes(granted)
        hold = self.tracer.start_span(
            f"hold {attrs[KIND]}",
            context=parent,
            attributes={**attrs, **granted},
            links=[Link(acquire.get_span_context())],
        )
        with self._lock:
            self._holds[state] = hold

    def _end_hold(self, event: events.Event) -> None:
        with self._lock:
            span = self._holds.pop(event.source, None)
        if span is None:
            return
        if event.type == "lost":
            span.set_attribute(END, "lost")
            span.set_attribute(REASON, event.detail)
            span.add_event("amqp_locks.lost", {REASON: event.detail})
            span.set_status(Status(StatusCode.ERROR, f"lock lost: {event.detail}"))
        else:
            span.set_attribute(END, "released")
        span.end()

    # --- election ------------------------------------------------------------------------

    def _wrap_start(self, original: Any) -> Any:
        def start(service: LockableService) -> Any:
            # run() goes on on a new thread: take the caller's context along.
            service.__dict__["_otel_parent"] = otel_context.get_current()
            return original(service)

        return start

    def _wrap_run(self, original: Any) -> Any:
        def run(service: LockableService) -> Any:
            parent = service.__dict__.pop("_otel_parent", None)
            token = otel_context.attach(parent) if parent is not None else None
            try:
                return original(service)
            finally:
                if token is not None:
                    otel_context.detach(token)

        return run

    def _on_service(self, event: events.Event) -> None:
        key = (event.kind, event.name)
        if event.type == "state":
            with self._lock:
                span = self._terms.pop(key, None)
            if span is not None:
                span.set_attribute("amqp_locks.term.end", event.detail)
                span.end()
            if event.detail == "master":
                attrs: dict[str, Any] = {LOCKER: event.kind}
                if self.name_attribute:
                    attrs[NAME] = event.name
                term = self.tracer.start_span(f"master {event.kind}", attributes=attrs)
                with self._lock:
                    self._terms[key] = term
            return
        with self._lock:
            span = self._terms.get(key)
        if span is None:
            return
        if event.type == "demoted":
            span.add_event("amqp_locks.demoted")
            span.set_status(Status(StatusCode.ERROR, "demoted: the keep-alive failed"))
        elif event.type == "keep_alive" and event.detail != "ok":
            span.add_event("amqp_locks.keep_alive", {"amqp_locks.keep_alive.result": event.detail})

    # --- administration ------------------------------------------------------------------

    def _wrap_admin(self, kind: str, method: str, original: Any) -> Any:
        def call(admin: Any, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
            return self._admin(
                kind,
                method,
                admin.name,
                original(admin, *args, **kwargs),
                otel_context.get_current(),
                time.time_ns(),
            )

        return call

    async def _admin(
        self,
        kind: str,
        method: str,
        name: str,
        coro: Coroutine[Any, Any, Any],
        parent: otel_context.Context,
        start: int,
    ) -> Any:
        attrs = self._lock_attributes(kind, name)
        attrs[OPERATION] = method
        span = self.tracer.start_span(
            f"{method} {kind}", context=parent, attributes=attrs, start_time=start
        )
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            _fail(span, exc)
            raise
        finally:
            span.end()

    # --- events --------------------------------------------------------------------------

    def on_event(self, event: events.Event) -> None:
        t = event.type
        if t in ("release", "lost"):
            if event.source is not None:
                self._end_hold(event)
        elif t == "connection":
            if event.detail == "reconnected":
                self._reconnects[event.name] += 1
        elif t in ("state", "demoted", "keep_alive"):
            self._on_service(event)
