"""Enqueue-time deduplication (``once=True``) across two producer processes: one call per
key queued or running; the key is freed when the call finishes, fails, is revoked or its
worker is killed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks import Broker
from amqp_locks.celery import AlreadyQueued, UnidentifiableKey
from amqp_locks.celery.once import busy
from amqp_locks_dev import devbroker

from .app import Item, Opaque, app, hold, limited, once, once_item, once_retrying
from .conftest import ROOT, Worker, key, max_running, wait_until


def key_free(broker: Broker, k: str, seconds: float) -> Callable[[], bool]:
    """Whether the key is free: its claim exchange is gone (one passive declare)."""
    name = once.lock_name((k, seconds))
    return lambda: not busy(broker, name)


def enqueue_when_free(worker: Worker, k: str, seconds: float, timeout: float = 20) -> Any:
    """Enqueue `once(k, seconds)` as soon as the key is free (graceful tries, polled);
    the result of the call."""
    sent = wait_until(
        f"{k} to be free",
        lambda: once.apply_async((k, seconds), queue=worker.queue, once_graceful=True),
        timeout,
    )
    return sent.get(timeout=30)


def produce(
    worker: Worker, k: str, seconds: float, tries: int, interval: float = 0.0, task: str = "once"
) -> list[dict[str, Any]]:
    """Two producer processes try `tries` enqueues each of `task`, starting at the same
    moment, one every `interval` seconds (0: back to back)."""
    start_at = time.time() + 2.0
    argv = [sys.executable, "-m", "tests.celery.produce", k, str(seconds), str(tries)]
    procs = [
        subprocess.Popen([*argv, str(start_at), str(interval), task], cwd=ROOT, env=worker.env,
                         text=True, stdout=subprocess.PIPE)
        for _ in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=60 + tries * interval)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def in_run_order(claims: list[tuple[str, float]], events: list[Any]) -> list[tuple[str, float]]:
    """The claims (task id, wall-clock time by which the claim had returned) in the order
    their calls started on the worker. Not in the order of those times: a producer can be
    descheduled between its claim's answer and reading the clock (rehearsal 11, load 13: a
    claim recorded 0.28 s before the end of a call that, by this order, had run after it),
    so a recorded time is only an upper bound of when the claim was made. Each call runs
    after the one before it, so its claim must have come after that call's end."""
    start_of = {e.fields["id"]: e.t for e in events if e.kind == "start"}
    return sorted(claims, key=lambda c: start_of[c[0]])


def test_two_producers_one_call_queued_or_running(prefork: Worker, broker: Broker) -> None:
    """Two producer processes try at the same moment, 5 times each, twice. Whatever the
    timing, no call may be claimed while another call of the key is queued or running:
    every claim after the first returns after the previous call's end (its events). (A
    refused try is usually a millisecond, but may take up to the library's one-second
    non-blocking grace when the broker's ready count lags: the rounds need not all fall
    in one call's run.)"""
    k = key()
    claims: list[tuple[str, float]] = []
    refused = 0
    for _round in range(2):
        out = produce(prefork, k, 1.0, 5)
        claims += [(i, float(t)) for o in out for i, t in o["sent"]]
        refused += sum(int(o["refused"]) for o in out)
        prefork.wait_events(k, "end", len(claims))
        wait_until("the key to be free", key_free(broker, k, 1.0), 10)
    assert refused > 0 and len(claims) >= 2  # at least one per round
    events = prefork.events_of(k)
    end_of = {e.fields["id"]: e.t for e in events if e.kind == "end"}
    for (earlier, _), (_, claimed_by) in itertools.pairwise(in_run_order(claims, events)):
        # The claim returned by `claimed_by`: had it come before the earlier call's end,
        # it would have been granted while that call was queued or running.
        assert claimed_by > end_of[earlier], "claimed while a call of the key was running"
    assert len(events) == 2 * len(claims)  # every claimed call ran, one at a time
    assert max_running(events) == 1


def test_failure_frees_the_key(prefork: Worker, broker: Broker) -> None:
    k = key()
    first = once.apply_async((k, 0.0, True), queue=prefork.queue)
    with pytest.raises(RuntimeError):
        first.get(timeout=30)
    # Released in the task's `finally`; the broker has it back within milliseconds.
    enqueue_when_free(prefork, k, 0.0)


def test_revoked_call_frees_the_key(prefork: Worker, broker: Broker) -> None:
    k = key()
    queued = once.apply_async((k, 0.0), queue=prefork.queue, countdown=2)
    with pytest.raises(AlreadyQueued):
        once.apply_async((k, 0.0), queue=prefork.queue)
    app.control.revoke(queued.id)
    # The worker discards it when it comes due, and frees its key.
    enqueue_when_free(prefork, k, 0.0)
    events = prefork.events_of(k)
    assert len(events) == 2 and events[0].fields["id"] != queued.id  # the revoked never ran


def test_killed_worker_frees_the_key(prefork: Worker, broker: Broker) -> None:
    k = key()
    once.apply_async((k, 60.0), queue=prefork.queue)
    victim = prefork.wait_events(k, "start", 1)[0].pid
    assert once.apply_async((k, 60.0), queue=prefork.queue, once_graceful=True) is None
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    sent = wait_until(
        "the killed call's key to be free",
        lambda: once.apply_async((k, 0.0), queue=prefork.queue, once_graceful=True),
        10,
    )
    print(f"\nonce: SIGKILL -> key free again: {(time.monotonic() - killed_at) * 1000:.0f} ms")
    sent.get(timeout=30)


def test_a_retry_keeps_the_key_queued(prefork: Worker, broker: Broker) -> None:
    k = key()
    first = once_retrying.apply_async((k, 2.0), queue=prefork.queue)
    prefork.wait_events(k, "end", 1)
    name = once_retrying.lock_name((k, 2.0))
    # The first run ended and handed its key to the retry: the claim stays.
    assert busy(broker, name)
    with pytest.raises(AlreadyQueued):
        once_retrying.apply_async((k, 2.0), queue=prefork.queue)
    assert first.get(timeout=30) == 1  # the retry ran, then freed the key:
    # The starts so far (the call that the wait below enqueues may start before we read).
    starts = [e.fields.get("retries") for e in prefork.events_of(k) if e.kind == "start"]
    wait_until(
        "the key to be free after the retry",
        lambda: once_retrying.apply_async((k, 0.0), queue=prefork.queue, once_graceful=True),
        10,
    )
    assert starts == ["0", "1"]


def test_an_object_key_dedups_by_value_or_is_refused(prefork: Worker, broker: Broker) -> None:
    """An object whose repr says its value keys by that value, in the producer and in the
    worker alike: an equal object is refused while the call runs, and the key is free
    once it ended. One whose repr is its address is refused at enqueue, never sent."""
    k = key()
    with pytest.raises(UnidentifiableKey, match="argument 'item'"):
        once_item.apply_async((Opaque(k), 0.0), queue=prefork.queue)
    first = once_item.apply_async((Item(k), 2.0), queue=prefork.queue)
    prefork.wait_events(k, "start", 1)
    with pytest.raises(AlreadyQueued):
        once_item.apply_async((Item(k), 2.0), queue=prefork.queue)  # equal, not the same
    first.get(timeout=30)
    second = wait_until(
        "the key to be free after its run",
        lambda: once_item.apply_async((Item(k), 0.0), queue=prefork.queue, once_graceful=True),
        10,
    )
    second.get(timeout=30)
    ids = [e.fields["id"] for e in prefork.events_of(k) if e.kind == "start"]
    assert ids == [first.id, second.id]  # the opaque call was never sent


def test_what_a_key_leaves_on_the_broker(
    prefork: Worker, broker: Broker, node: devbroker.NodeInfo
) -> None:
    """The queues docs/celery.md lists per key, exactly, once the key's call ran: a mutex
    key, a `lock_limit` key, a `once` key (free again)."""
    k = key()
    hold.apply_async((k, 0.0), queue=prefork.queue).get(timeout=30)
    limited.apply_async((k, 0.0), queue=prefork.queue).get(timeout=30)
    once.apply_async((k, 0.0), queue=prefork.queue).get(timeout=30)
    wait_until("the once key to be free", key_free(broker, k, 0.0), 10)
    out = devbroker.rabbitmqctl(
        node, "list_queues", "-q", "--formatter", "json", "name", "durable", "arguments"
    )
    queues = json.loads(out)

    def left(name: str) -> dict[str, str]:
        """Suffix -> "expires" (a helper queue RabbitMQ deletes after 60 s unused, by its
        x-expires) or "stays" (a durable queue nothing deletes)."""
        return {
            str(q["name"])[len(name) :]: "expires"
            if any(a[0] == "x-expires" for a in q["arguments"])
            else "stays"
            for q in queues
            if str(q["name"]).startswith(name) and q["durable"]
        }

    mutex = {"-mutex-watch": "expires"}  # its fence is a shared shard
    assert left(hold.lock_name((k, 0.0))) == mutex
    # A lock_limit key: its token queue, made on first use, expiring (no ledger, no fence).
    assert left(limited.lock_name((k, 0.0))) == {".semaphore": "expires"}
    # A once key: its run mutex's, and nothing of its claim once free (an exchange).
    assert left(once.lock_name((k, 0.0))) == mutex
    assert not busy(broker, once.lock_name((k, 0.0)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.fixture(scope="module")
def solo(node: devbroker.NodeInfo, celery_home: Path, celery_app: Any) -> Iterator[Worker]:
    """A solo-pool worker (the worker process runs the task)."""
    worker = Worker(node.url, celery_home, "solo", 1)
    yield worker
    worker.stop()


@pytest.mark.parametrize(
    ("pool", "task"),
    [("prefork", "once"), ("prefork", "once_late"), ("solo", "once"), ("solo", "once_late")],
)
def test_two_producers_hammering_one_key(
    request: pytest.FixtureRequest, broker: Broker, pool: str, task: str
) -> None:
    """Two producers try one key every 200 ms for 8 s, on a task that runs 0.3 s: no claim
    while a call of the key is queued or running, every claimed call runs exactly once, and
    the key is claimed again after each run (counted). How long refusals and claims took
    is printed as figures, not asserted."""
    worker: Worker = request.getfixturevalue(pool)
    k = key()
    out = produce(worker, k, 0.3, 40, interval=0.2, task=task)
    claims = [(i, float(t)) for o in out for i, t in o["sent"]]
    worker.wait_events(k, "end", len(claims))
    events = worker.events_of(k)
    claims = in_run_order(claims, events)
    end_of = {e.fields["id"]: e.t for e in events if e.kind == "end"}
    for (earlier, _), (_, claimed_by) in itertools.pairwise(claims):
        assert claimed_by > end_of[earlier], "claimed while a call of the key was running"
    assert len(events) == 2 * len(claims) and max_running(events) == 1
    assert sorted(end_of) == sorted(i for i, _ in claims)  # each claimed call ran once
    refused = [t * 1000 for o in out for t in o["took"]["refused"]]
    sent = [t * 1000 for o in out for t in o["took"]["sent"]]
    # From a run's end to the next claim's return (the tries come every 100 ms on average).
    idle = [(c - end_of[e]) * 1000 for (e, _), (_, c) in itertools.pairwise(claims)]
    print(
        f"\nhammering {pool}/{task} (2 producers, every 200 ms for 8 s, 0.3 s task): "
        f"{len(claims)} runs; refused {len(refused)}: p50 {percentile(refused, 0.5):.1f} ms, "
        f"p95 {percentile(refused, 0.95):.1f} ms, max {max(refused):.1f} ms; "
        f"sent {len(sent)}: p50 {percentile(sent, 0.5):.1f} ms, max {max(sent):.1f} ms; "
        f"end -> next claim: p50 {percentile(idle, 0.5):.0f} ms, max {max(idle):.0f} ms"
    )
    assert len(claims) >= 5  # before the fix: 2 (each collision stalled the key 5-10 s)


def test_a_call_that_cannot_be_sent_frees_its_key(prefork: Worker, broker: Broker) -> None:
    """The claim runs while Celery builds the message: a message that fails to build (an
    argument JSON cannot carry, outside the key) is never sent, and the key it claimed is
    free again when apply_async raises."""
    from kombu.exceptions import EncodeError

    k = key()
    with pytest.raises(EncodeError):
        once.apply_async((k, 0.0, object()), queue=prefork.queue)
    assert not busy(broker, once.lock_name((k, 0.0)))
    once.apply_async((k, 0.0), queue=prefork.queue).get(timeout=30)


def test_a_call_not_sent_whose_key_cannot_be_freed(
    prefork: Worker, broker: Broker, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The lock broker gone too when the claimed key is to be freed: the send's own error
    is raised (not the free's), the pooled producer goes back to the pool (kombu's exit:
    none kept dirty, so a pool is never drained by such calls), and the log says the key
    stays busy and how to free it."""
    from kombu.exceptions import EncodeError

    from amqp_locks import ConnectionLost
    from amqp_locks.celery import once as once_claims

    def gone(*args: Any, **kwargs: Any) -> bool:
        raise ConnectionLost("the lock broker went away too (test)")

    pool = once.app.producer_pool
    dirty = len(pool._dirty)
    k = key()
    with monkeypatch.context() as patch:
        patch.setattr(once_claims, "forget", gone)
        with pytest.raises(EncodeError):
            once.apply_async((k, 0.0, object()), queue=prefork.queue)
        assert len(pool._dirty) == dirty
    assert f"its key {once.lock_name((k, 0.0))} could not be freed" in caplog.text
    assert busy(broker, once.lock_name((k, 0.0)))
    assert once.forget_once((k, 0.0), force=True)
    once.apply_async((k, 0.0), queue=prefork.queue).get(timeout=30)


def test_two_calls_of_a_key_on_one_connection(threads: Worker, broker: Broker) -> None:
    """A copy sent around the dedup (`send_task`) waits for the run mutex in another
    thread of the same worker, so both calls bind through one connection: each holds its
    own binding, and the first one's end leaves the key busy while the second runs."""
    k = key()
    name = once.lock_name((k, 0.5))
    first = once.apply_async((k, 1.0), queue=threads.queue)
    threads.wait_events(k, "start", 1)
    second = app.send_task(once.name, (k, 0.5), queue=threads.queue)
    threads.wait_called(k, 2)
    first.get(timeout=30)
    threads.wait_events(k, "start", 2)
    assert busy(broker, name)  # the second call runs: its binding holds the claim
    second.get(timeout=30)
    wait_until("the key to be free", lambda: not busy(broker, name), 10)
    assert max_running(threads.events_of(k)) == 1


def test_forget_once_leaves_a_running_key_unless_forced(prefork: Worker, broker: Broker) -> None:
    """forget_once frees a key only when no call of it is bound to its claim: a running
    call's key stays busy (False) unless forced; forced, the key is free at once, and the
    running call's end then finds nothing left to free."""
    k = key()
    name = once.lock_name((k, 1.0))
    first = once.apply_async((k, 1.0), queue=prefork.queue)
    prefork.wait_events(k, "start", 1)
    assert once.forget_once((k, 1.0)) is False and busy(broker, name)
    assert once.forget_once((k, 1.0), force=True) is True and not busy(broker, name)
    first.get(timeout=30)
    assert not busy(broker, name)
    assert once.forget_once((k, 1.0)) is False  # nothing to free


def test_the_claim_goes_on_the_producers_connection(
    prefork: Worker, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the locks on Celery's own broker, a claim is sent on the producer's
    connection: with the lock connection's path made to fail, a new key is still
    accepted and a busy one refused, and both run through the producer."""
    from amqp_locks.celery import once as claims

    def not_here(*_: Any, **__: Any) -> Any:
        raise AssertionError("claimed on the lock connection")

    monkeypatch.setattr(claims, "claim_soon", not_here)
    k = key()
    first = once.apply_async((k, 0.5), queue=prefork.queue)
    with pytest.raises(AlreadyQueued):
        once.apply_async((k, 0.5), queue=prefork.queue)
    first.get(timeout=30)
    wait_until("the key to be free", key_free(broker, k, 0.5), 10)
    once.apply_async((k, 0.5), queue=prefork.queue).get(timeout=30)


def test_locks_on_another_url_claim_on_the_lock_connection(
    prefork: Worker, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``amqp_locks_url`` set: the locks' broker may not be Celery's, so the claim goes
    on the lock connection, never on the producer's."""
    from amqp_locks.celery import once as claims

    def not_here(*_: Any, **__: Any) -> Any:
        raise AssertionError("claimed on the producer's connection")

    monkeypatch.setattr(claims, "claim_on", not_here)
    monkeypatch.setitem(app.conf, "amqp_locks_url", app.conf.broker_url)
    k = key()
    # Runs 3 s: a call that ran at once could end (and free its key) before the second
    # call on a loaded machine (CI, 3.10.8 lane: DID NOT RAISE).
    first = once.apply_async((k, 3.0), queue=prefork.queue)
    with pytest.raises(AlreadyQueued):
        once.apply_async((k, 0.0), queue=prefork.queue)
    first.get(timeout=30)


def test_a_refusal_read_by_another_call_is_not_raised_there(celery_app: Any) -> None:
    """A refused claim closes its own channel. Whoever reads the connection first gets
    that close (Celery declaring its queue on another channel, say): it must not raise
    there, and the claim still answers False; the next claim has an open channel."""
    from kombu import Producer

    from amqp_locks.celery.once import _claim_channels, claim_on, forget

    name, other = f"test.{key()}", f"test.{key()}"
    with celery_app.connection_for_write() as conn:
        producer = Producer(conn)
        raw = conn.connection
        try:
            assert claim_on(producer, name)() is True
            refused = claim_on(producer, name)
            assert refused is not None
            channel = _claim_channels[raw]
            reader = raw.channel()
            reads = 0
            while channel.closed_with is None:  # each passive declare reads what came
                reader.exchange_declare("amq.direct", "direct", passive=True)
                reads += 1
                assert reads < 1000, "the refusal never arrived"
            assert refused() is False and refused() is False
            assert _claim_channels[raw].is_open
            assert claim_on(producer, other)() is True
        finally:
            with Broker(conn.as_uri(include_password=True)) as b:
                forget(b, name, force=True)
                forget(b, other, force=True)
