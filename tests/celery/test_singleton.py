"""Singleton tasks on real prefork and threads workers: one call per key at a time
(overlaps counted exactly from the tasks' own events), every call runs, different keys
run side by side, ``lock_limit=3`` never exceeds 3, skip/retry/timeout as documented."""

from __future__ import annotations

from typing import Any

import pytest
from celery.result import AsyncResult

from amqp_locks.celery import TaskLockTimeout, is_skipped

from .app import hold, impatient, limited, retrier, retrier_short, skipper
from .conftest import Worker, key, max_running

PER_KEY = 12
SECONDS = 0.1


def overlap_of_keys(worker: Worker, a: str, b: str) -> int:
    """How many events of `a` happened while a call of `b` was running."""
    running_b = seen = 0
    events = sorted(worker.events_of(a) + worker.events_of(b), key=lambda e: e.t)
    for e in events:
        if e.key == b:
            running_b += 1 if e.kind == "start" else -1
        elif running_b > 0:
            seen += 1
    return seen


def results(sent: list[AsyncResult], timeout: float = 120) -> list[Any]:  # type: ignore[type-arg]
    return [r.get(timeout=timeout) for r in sent]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_one_call_per_key_every_call_runs_keys_in_parallel(
    pool: str, request: pytest.FixtureRequest
) -> None:
    worker: Worker = request.getfixturevalue(pool)
    a, b = key(), key()
    sent = []
    for _ in range(PER_KEY):
        sent.append(hold.apply_async((a, SECONDS), queue=worker.queue))
        sent.append(hold.apply_async((b, SECONDS), queue=worker.queue))
    out = results(sent)
    assert len(out) == 2 * PER_KEY
    for k in (a, b):
        events = worker.events_of(k)
        assert sum(e.kind == "start" for e in events) == PER_KEY  # every call ran once
        assert max_running(events) == 1  # never two of one key at once
        tokens = [int(e.fields["token"]) for e in events if e.kind == "start"]
        assert tokens == sorted(tokens) and len(set(tokens)) == PER_KEY  # fencing rises
    # The two keys ran side by side: some of a's events happened while b ran.
    assert overlap_of_keys(worker, a, b) > 0
    if pool == "prefork":
        assert len({e.pid for e in worker.events_of(a) + worker.events_of(b)}) > 1


def test_lock_limit_three_never_exceeds_three(prefork: Worker) -> None:
    k = key()
    results([limited.apply_async((k, 0.3), queue=prefork.queue) for _ in range(12)])
    events = prefork.events_of(k)
    assert sum(e.kind == "start" for e in events) == 12
    assert max_running(events) == 3  # reached, never exceeded (4 children compete)


def test_skip_returns_skipped_and_logs(prefork: Worker) -> None:
    k = key()
    holder = hold.apply_async((k, 3.0), queue=prefork.queue)
    prefork.wait_events(k, "start", 1)
    result = skipper.apply_async((k, 0.0), queue=prefork.queue).get(timeout=60)
    assert is_skipped(result)
    assert result["lock"].startswith("celery.key.")
    assert f"skipped: {result['lock']} is held" in prefork.log_text()
    holder.get(timeout=60)
    assert sum(e.kind == "start" for e in prefork.events_of(k)) == 1  # the skipped never ran
    # Free again: the same task runs.
    assert not is_skipped(skipper.apply_async((k, 0.0), queue=prefork.queue).get(timeout=60))


def test_retry_runs_after_the_holder(prefork: Worker) -> None:
    k = key()
    holder = hold.apply_async((k, 1.5), queue=prefork.queue)
    prefork.wait_events(k, "start", 1)
    retried = retrier.apply_async((k, 0.0), queue=prefork.queue)
    holder.get(timeout=60)
    retried.get(timeout=60)
    events = prefork.events_of(k)
    assert [e.kind for e in events] == ["start", "end", "start", "end"]
    assert int(events[2].fields["retries"]) >= 1  # it was retried while held


def _gives_up_while_held(prefork: Worker, task: Any) -> BaseException:
    """Calls ``task`` while ``hold`` runs for 3 s on the same key; returns the
    TaskLockTimeout it fails with (checked by name: it crosses the result backend)."""
    k = key()
    holder = hold.apply_async((k, 3.0), queue=prefork.queue)
    prefork.wait_events(k, "start", 1)
    with pytest.raises(Exception) as raised:
        task.apply_async((k, 0.0), queue=prefork.queue).get(timeout=60)
    assert type(raised.value).__name__ == TaskLockTimeout.__name__
    holder.get(timeout=60)
    return raised.value


def test_retry_gives_up_with_task_lock_timeout(prefork: Worker) -> None:
    _gives_up_while_held(prefork, retrier_short)


def test_wait_gives_up_after_lock_timeout(prefork: Worker) -> None:
    assert "within 0.5 s" in str(_gives_up_while_held(prefork, impatient))
