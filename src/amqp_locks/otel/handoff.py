"""Handoff links: the releasing holder's trace context travels with what hands the lock
on, and the next holder's acquire span links the previous holder's hold span.

Only while instrumented: everything here is patched in by :class:`Tracing` and taken out
again by ``uninstrument()``; the library's own code never looks for the header.

The carrier is one message header, :data:`HEADER`, whose value is the hold span's W3C
``traceparent`` followed by what *binds* it to the one handoff it describes:

- **Wake-up notice** (single-node mutex and persistent semaphore: the release publishes
  one to ``N-mutex-wakeups`` / ``N-sem-wakeups``): ``<traceparent>;f=<fencing token>;
  n=<slot>``. A waiter that received it (before or during the attempt that won) links
  it only if its grant is that slot with the fencing token right after the releaser's
  (same fence shard, no take in between). Any grant in between (a process that took and
  released the lock between the release and the woken waiter's attempt, or any lock
  sharing the fence shard) breaks the adjacency: no link, never a link to a holder that
  was not the previous one. The notice comes from this lock's own wake-up queue, so the
  grant just before ours on the shard, of this lock, is the previous hold.
- **Token re-published by a fencing release** (token semaphore on a classic queue):
  ``<traceparent>;e=<epoch>;c=<count>``, the counter the release writes into the token.
  The next holder links it only if the token was not redelivered and still carries that
  counter. A release that copies the headers on (``tokens/message.py: carrying`` copies
  them; so does an amqp-locks without this module, or not instrumented) raises the count,
  so a header it did not write never matches.

A token returned by ``basic.reject`` (quorum and first-use tokens, ``fencing=False``,
read-write lock tokens and turns) or by the broker (a holder's connection died) keeps the
headers it was published with and is flagged redelivered: it is never linked.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable
from typing import Any

from opentelemetry.trace import SpanContext, TraceFlags

from ..queue_lease import LeaseState
from ..tokens.message import (
    CARRIED,
    COUNT_HEADER,
    EPOCH_HEADER,
    FENCING_HEADER,
    headers_of,
    int_header,
    text,
)
from ..tokens.permit import PermitState
from ..transport.session import Session
from ..transport.wire import Basic

#: The header (a name of our own: a messaging instrumentation reading ``traceparent``
#: would take the lock's previous holder for the producer of the message).
HEADER = "amqp-locks-handoff"

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")

#: Set while an instrumented hold is being released: (traceparent, fencing token, number).
RELEASING: contextvars.ContextVar[tuple[str, int, int] | None] = contextvars.ContextVar(
    "amqp_locks_otel_releasing", default=None
)
#: Set by an instrumented acquire: the handoff headers of the notices its waiters received
#: (a ``Waiter`` made during the acquire keeps the list; its notice handler appends).
NOTICES: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "amqp_locks_otel_notices", default=None
)


def traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def parse(value: Any) -> tuple[SpanContext, dict[str, int]] | None:
    """A header's span context and bindings; None for anything else."""
    value = text(value)
    if not isinstance(value, str):
        return None
    head, *parts = value.split(";")
    match = _TRACEPARENT.fullmatch(head)
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    bound: dict[str, int] = {}
    for part in parts:
        key, _, number = part.partition("=")
        if not number.isdigit():
            return None
        bound[key] = int(number)
    context = SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(match[3], 16))
    )
    return context, bound


# --- the releasing side ------------------------------------------------------------------


def notice_value(releasing: tuple[str, int, int]) -> str:
    parent, fencing_token, number = releasing
    return f"{parent};f={fencing_token};n={number}"


def wrap_notify(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Session.notify_soon``: a release's single notice carries the releasing hold's
    header (published as ``notify_soon`` publishes, with the header added)."""

    def notify_soon(session: Session, wakeup_queue: str, slots: Any = (0,)) -> Any:
        releasing = RELEASING.get()
        if releasing is None or len(slots) != 1 or not session.alive:
            return original(session, wakeup_queue, slots)
        return original(session, wakeup_queue, slots, headers={HEADER: notice_value(releasing)})

    return notify_soon


def wrap_delete_and_notify(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Session.delete_and_notify``: a release's notice carries the releasing hold's
    header, as :func:`wrap_notify`'s does."""

    async def delete_and_notify(
        session: Session, queue: str, wakeup_queue: str, slot: int = 0
    ) -> Any:
        releasing = RELEASING.get()
        if releasing is None:
            return await original(session, queue, wakeup_queue, slot)
        headers = {HEADER: notice_value(releasing)}
        return await original(session, queue, wakeup_queue, slot, headers=headers)

    return delete_and_notify


def wrap_carrying(original: Callable[..., Basic.Properties]) -> Callable[..., Basic.Properties]:
    """``tokens.permit.carrying``: the re-published token carries the releasing hold's
    header, bound to the counter written beside it (a copied stale one is replaced)."""

    def carrying(message: Any, epoch: int, count: int) -> Basic.Properties:
        props = original(message, epoch, count)
        releasing = RELEASING.get()
        headers = props.headers
        if isinstance(headers, dict):
            headers.pop(HEADER, None)
            if releasing is not None:
                headers[HEADER] = f"{releasing[0]};e={epoch};c={count}"
        return props

    return carrying


# --- the waiting side --------------------------------------------------------------------


def wrap_waiter_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Waiter.__init__`` (made by the acquire's wait, in its context): keep the
    acquire's list of notices, which the notice handler fills."""

    def __init__(waiter: Any, *args: Any, **kwargs: Any) -> None:
        original(waiter, *args, **kwargs)
        waiter.__dict__["_otel_notices"] = NOTICES.get()

    return __init__


def wrap_on_notice(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Waiter.on_notice``: note a notice's handoff header (a sentinel has none)."""

    async def on_notice(waiter: Any, message: Any) -> None:
        notices = waiter.__dict__.get("_otel_notices")
        value = headers_of(message).get(HEADER)
        if notices is not None and value is not None:
            notices.append(value)
        await original(waiter, message)

    return on_notice


def previous_hold(state: Any, notices: list[Any]) -> SpanContext | None:
    """The previous holder's hold span, when what handed this grant on names it and is
    bound to this very handoff (see the module docstring); else None."""
    if isinstance(state, PermitState):
        headers = headers_of(state.message)
        if getattr(state.message.delivery, "redelivered", False):
            return None
        found = parse(headers.get(HEADER))
        if found is None or text(headers.get(FENCING_HEADER)) != CARRIED:
            return None
        context, bound = found
        epoch, count = int_header(headers, EPOCH_HEADER), int_header(headers, COUNT_HEADER)
        if epoch is None or bound.get("e") != epoch or bound.get("c") != count:
            return None
        return context
    if isinstance(state, LeaseState):
        for value in reversed(notices):
            found = parse(value)
            if found is None:
                continue
            context, bound = found
            previous = bound.get("f", 0)
            if (
                previous > 0
                and state.fencing_token == previous + 1
                and bound.get("n") == state.number
            ):
                return context
    return None
