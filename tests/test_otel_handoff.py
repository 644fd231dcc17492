"""Handoff links across processes (amqp_locks/otel/handoff.py): the next holder's acquire
span links the previous holder's hold span, only when what handed the lock on names that
holder; uninstrumented clients and the protocol's other readers are not disturbed; and the
picture of docs/observability.md has the structure of a recorded run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from amqp_locks import Broker, Mutex, QueueNotFound, TokenAdmin, TokenSemaphore
from amqp_locks import waiting as amqp_waiting
from amqp_locks.names import token_queue, wakeup_queue
from amqp_locks.otel import handoff
from amqp_locks.tokens.message import COUNT_HEADER, headers_of
from amqp_locks.transport.wakeups import Waiter
from benchmarks import otel_timeline
from tests.conftest import queue_counts
from tests.test_otel import Telemetry, instrument
from tests.waiting import wait_until


@pytest.fixture
def otel() -> Iterator[Telemetry]:
    yield from instrument()


def test_mutex_handoff_links_the_previous_hold_and_the_picture_is_true(
    amqp_url: str, name: str
) -> None:
    """Three processes contend one mutex (one node): each acquire after the first links
    the previous holder's hold span (carried by the release's wake-up notice), the holds
    do not overlap, and docs/observability.md shows a run of this very structure."""
    order = otel_timeline.contend(amqp_url, name, "mutex")
    rows = otel_timeline.check(order, linked=(False, True, True))
    drawn = otel_timeline.render(rows)
    assert otel_timeline.structure(drawn) == otel_timeline.structure(otel_timeline.documented())
    assert len(otel_timeline.structure(drawn)) == 9
    links = [r for r in rows if r.link]
    assert [(r.process, r.link) for r in links] == [
        ("P2", "P1 hold mutex"),
        ("P3", "P2 hold mutex"),
    ]


def test_token_semaphore_handoff_links_the_previous_hold(amqp_url: str, name: str) -> None:
    """Three processes contend a one-permit token semaphore (classic queue, fencing on):
    the token each release re-publishes carries the releasing hold's context."""
    order = otel_timeline.contend(amqp_url, name, "token")
    otel_timeline.check(order, linked=(False, True, True))


def test_cluster_mode_mutex_is_not_linked(amqp_url: str, name: str) -> None:
    """Cluster mode's mutex is a quorum token returned by `basic.reject` (its headers are
    those of its first publish): no acquire links anything, never a stale holder."""
    order = otel_timeline.contend(amqp_url, name, "mutex", cluster=True)
    otel_timeline.check(order, linked=(False, False, False))


@pytest.mark.parametrize("kind", ["mutex", "token"])
def test_an_uninstrumented_holder_in_between_is_never_skipped(
    amqp_url: str, name: str, kind: str
) -> None:
    """Instrumented, then uninstrumented, then instrumented: the uninstrumented client
    takes and releases the lock as ever (it imports no OpenTelemetry), and the third
    holder links nothing: the token it gets still carries the first holder's header,
    copied on by the plain release, and the binding to the counter rejects it."""
    order = otel_timeline.contend(
        amqp_url, name, kind, instrumented=(True, False, True), together=False
    )
    otel_timeline.check(order, linked=(False, False, False))
    assert [c.instrumented for c in order] == [True, False, True]
    if kind == "token":  # the protocol's other readers: the audit reads every token
        with Broker(amqp_url) as b:
            audit = TokenAdmin(b, name).audit()
        assert audit.ok and audit.seen == (1,), audit


def _token_headers(broker: Broker, name: str) -> dict[str, Any]:
    """The headers of the token a plain acquire gets (then released again)."""
    lease = TokenSemaphore(broker, name).acquire()
    assert lease is not None
    headers = dict(headers_of(lease._state.message))  # type: ignore[attr-defined]
    lease.release(wait=True)
    return headers


def test_token_header_only_while_instrumented(broker: Broker, name: str) -> None:
    """Not instrumented, a release writes no header; instrumented, it writes one bound to
    the counter it writes; a plain release afterwards copies it on with a higher count,
    which no longer matches (so it can never be read as the later holder's)."""
    TokenAdmin(broker, name).setup(1)
    assert handoff.HEADER not in _token_headers(broker, name)
    assert handoff.HEADER not in _token_headers(broker, name)
    session = instrument()
    next(session)
    try:
        lease = TokenSemaphore(broker, name).acquire()
        assert lease is not None
        lease.release(wait=True)
    finally:
        next(session, None)
    written = _token_headers(broker, name)
    found = handoff.parse(written[handoff.HEADER])
    assert found is not None and found[1]["c"] == written[COUNT_HEADER]
    copied = _token_headers(broker, name)
    found = handoff.parse(copied[handoff.HEADER])
    assert found is not None and found[1]["c"] == copied[COUNT_HEADER] - 1


def _consumers(broker: Broker, queue: str) -> int:
    try:
        return queue_counts(broker, queue)[1]
    except QueueNotFound:  # nobody has subscribed yet
        return 0


def test_notice_header_only_while_instrumented(
    amqp_url: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wake-up notice of a plain release has no headers at all (as before); the
    instrumentor's patches are all taken out again by uninstrument()."""
    seen: list[dict[str, Any]] = []
    on_notice = Waiter.on_notice

    async def record(waiter: Waiter, message: Any) -> None:
        seen.append(dict(headers_of(message)))
        await on_notice(waiter, message)

    monkeypatch.setattr(Waiter, "on_notice", record)
    with Broker(amqp_url) as holder, Broker(amqp_url) as waiter:
        lease = Mutex(holder, name).acquire()
        assert lease is not None
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(Mutex(waiter, name).acquire(timeout=30)))
        t.start()
        wait_until(lambda: _consumers(holder, wakeup_queue(name, "mutex")) == 1, 30, "a waiter")
        lease.release()
        t.join(60)
        assert got and got[0] is not None
        got[0].release()
    assert seen == [{}]


def test_uninstrument_takes_every_patch_out() -> None:
    from amqp_locks.lockobject import LockObject
    from amqp_locks.queue_lease import LeaseState
    from amqp_locks.tokens import permit
    from amqp_locks.transport.queue_ops import QueueOps

    places = [
        (LockObject, "acquire_on_loop"),
        (LeaseState, "release"),
        (permit.PermitState, "release"),
        (QueueOps, "notify_soon"),
        (permit, "carrying"),
        (Waiter, "__init__"),
        (Waiter, "on_notice"),
    ]
    before = [vars(owner)[attr] for owner, attr in places]
    session = instrument()
    next(session)
    assert all(vars(o)[a] is not b for (o, a), b in zip(places, before, strict=True))
    next(session, None)
    assert [vars(owner)[attr] for owner, attr in places] == before


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"junk",
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01;f=1;n=1",  # invalid trace id
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01;f=x",
        "01-" + "a" * 32 + "-" + "b" * 16 + "-01",
    ],
)
def test_malformed_headers_are_ignored(value: Any) -> None:
    assert handoff.parse(value) is None


def test_a_header_parses_to_its_context() -> None:
    value = "00-" + "a" * 32 + "-" + "b" * 16 + "-01;f=7;n=2"
    found = handoff.parse(value.encode())
    assert found is not None
    context, bound = found
    assert (context.trace_id, context.span_id, context.is_remote) == (
        int("a" * 32, 16),
        int("b" * 16, 16),
        True,
    )
    assert bound == {"f": 7, "n": 2}
    assert handoff.traceparent(context) == value.split(";")[0]


def _lease(fencing_token: int, number: int) -> Any:
    from amqp_locks.queue_lease import LeaseState

    state = LeaseState.__new__(LeaseState)
    state.fencing_token, state.number = fencing_token, number
    return state


def _permit(headers: dict[str, Any], redelivered: bool) -> Any:
    from types import SimpleNamespace

    from pamqp.commands import Basic

    from amqp_locks.tokens.permit import PermitState

    state = PermitState.__new__(PermitState)
    state.message = SimpleNamespace(  # type: ignore[assignment]
        header=SimpleNamespace(properties=Basic.Properties(headers=headers)),
        delivery=SimpleNamespace(redelivered=redelivered),
    )
    return state


PARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def test_a_notice_links_only_the_grant_right_after_it() -> None:
    """The grant's fencing token must follow the releaser's with no take between (else
    someone held it in between, or the shard moved on), on the announced slot; any notice
    the acquire received may be the one (the newest that matches)."""
    notice = f"{PARENT};f=100;n=2"
    assert handoff.previous_hold(_lease(101, 2), [notice]) is not None
    assert handoff.previous_hold(_lease(102, 2), [notice]) is None  # a grant in between
    assert handoff.previous_hold(_lease(101, 1), [notice]) is None  # another slot
    earlier = f"{PARENT.replace('b', 'c')};f=90;n=2"
    assert handoff.previous_hold(_lease(101, 2), [earlier, notice, "junk"]) is not None
    assert handoff.previous_hold(_lease(91, 2), [earlier, notice]) is not None
    assert handoff.previous_hold(_lease(101, 2), [earlier]) is None
    assert handoff.previous_hold(_lease(101, 2), []) is None  # no notice: first attempt won
    assert handoff.previous_hold(_lease(1, 1), [f"{PARENT};f=0;n=1"]) is None  # no fencing


def test_a_token_links_only_when_it_carries_the_counter_its_header_names() -> None:
    carried = {"amqp-locks-fencing": "carried", "amqp-locks-epoch": 7, "amqp-locks-count": 4}
    header = {handoff.HEADER: f"{PARENT};e=7;c=4"}
    assert handoff.previous_hold(_permit({**carried, **header}, False), []) is not None
    assert handoff.previous_hold(_permit({**carried, **header}, True), []) is None  # returned
    copied = {**carried, "amqp-locks-count": 5, **header}  # a plain release copied it on
    assert handoff.previous_hold(_permit(copied, False), []) is None
    other_epoch = {**carried, "amqp-locks-epoch": 8, **header}
    assert handoff.previous_hold(_permit(other_epoch, False), []) is None
    quorum = {"amqp-locks-fencing": "x-acquired-count", **header}
    assert handoff.previous_hold(_permit(quorum, False), []) is None


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "token"])
def test_asyncio_waiter_links_a_sync_holder(
    otel: Telemetry, amqp_url: str, name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process too, and through amqp_locks.aio: a sync holder's release hands the
    lock (a one-slot persistent semaphore's slot, through its notice) to an asyncio
    waiter, whose acquire span links the holder's hold span."""
    import asyncio

    from amqp_locks import PersistentSemaphore, SemaphoreAdmin, aio

    with Broker(amqp_url) as holder:
        if kind == "token":
            TokenAdmin(holder, name).setup(1)
        elif kind == "semaphore":
            SemaphoreAdmin(holder, name).create(1)
        sync_lock: Any = {"mutex": Mutex, "semaphore": PersistentSemaphore}.get(
            kind, TokenSemaphore
        )(holder, name)
        lease = sync_lock.acquire()
        assert lease is not None
        queue = {
            "mutex": wakeup_queue(name, "mutex"),
            "semaphore": wakeup_queue(name, "sem"),
        }.get(kind, token_queue(name))
        waiting = 1 if kind != "token" else 2  # the token's holder consumes it too
        tried = threading.Semaphore(0)  # the waiter's attempts (a notice kind's)
        attempt = amqp_waiting._attempt

        async def counted(coro: Any) -> Any:
            try:
                return await attempt(coro)
            finally:
                tried.release()

        monkeypatch.setattr(amqp_waiting, "_attempt", counted)

        async def main() -> None:
            async with aio.Broker(amqp_url) as b:
                lock: Any = {"mutex": aio.Mutex, "semaphore": aio.PersistentSemaphore}.get(
                    kind, aio.TokenSemaphore
                )(b, name)
                task = asyncio.ensure_future(lock.acquire(timeout=30))
                await asyncio.to_thread(
                    wait_until, lambda: _consumers(holder, queue) >= waiting, 30, "the waiter"
                )
                if kind != "token":  # its attempt after subscribing failed: it waits
                    for _ in range(2):
                        assert await asyncio.to_thread(tried.acquire, True, 30)
                await asyncio.to_thread(lease.release)
                got = await task
                assert got is not None
                await got.release()

        asyncio.run(main())
    acquires = otel.finished("acquire ")
    holds = otel.finished("hold ")
    assert len(acquires) == len(holds) == 2
    first_hold = min(holds, key=lambda s: s.start_time)
    second = max(acquires, key=lambda s: s.end_time)
    assert [(link.context.span_id, dict(link.attributes or {})) for link in second.links] == [
        (
            first_hold.context.span_id,
            {"amqp_locks.handoff": "token" if kind == "token" else "notice"},
        )
    ]
