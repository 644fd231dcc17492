"""A worker killed mid-run while producers keep enqueueing the same ``once`` key.

When the killed call's message comes back (``acks_late`` with ``reject_on_worker_lost``
on prefork; ``acks_late`` on threads; always on solo, whose early acknowledgement is not
sent before the call ends) the key must stay refused until that delivery ran; when it
does not (early acknowledgement on prefork and threads, ``acks_late`` without
``reject_on_worker_lost`` on prefork) the key must be free at once. Either way: every
accepted enqueue runs to its end exactly once, no enqueue is accepted while another call
of the key is queued or running, and no two runs overlap. Counted exactly from the tasks'
events; times are printed, not asserted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks_dev import devbroker

from .app import once, once_early, once_late_acked, once_redelivered
from .conftest import Event, Worker, key, wait_until

#: How often the producer tries (seconds); how long each accepted call runs.
TRY_EVERY = 0.01
RUN_SECONDS = 0.3
#: Accepted calls to see run after the kill before the producer stops.
AFTER = 3


class Producer(threading.Thread):
    """Tries `task(k, RUN_SECONDS)` every TRY_EVERY s until stopped: (task id, wall-clock
    time the claim returned) of each accepted call, and the times of refusals."""

    def __init__(self, task: Any, k: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.task, self.k, self.queue = task, k, queue
        self.accepted: list[tuple[str, float]] = []
        self.refused: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.wait(TRY_EVERY):
                sent = self.task.apply_async(
                    (self.k, RUN_SECONDS), queue=self.queue, once_graceful=True
                )
                now = time.time()
                if sent is None:
                    self.refused.append(now)
                else:
                    self.accepted.append((sent.id, now))
        except BaseException as exc:  # reported by the test
            self.error = exc


def _check(events: list[Event], first: str, accepted: list[tuple[str, float]], again: bool) -> None:
    """Exactly one finished run per accepted call (the killed one started once more if
    its message came back), no claim before the previous call's end, no overlap."""
    ids = [first] + [i for i, _ in accepted]
    starts = Counter(e.fields["id"] for e in events if e.kind == "start")
    ends = Counter(e.fields["id"] for e in events if e.kind == "end")
    if again:
        assert ends == Counter(ids), "each accepted call ran to its end exactly once"
        assert starts == Counter(ids) + Counter([first]), "the killed call started twice"
    else:
        assert ends == Counter(ids[1:]), "each accepted call after the killed one ran once"
        assert starts == Counter(ids), "the killed call was not run again"
    end_of = {e.fields["id"]: e.t for e in events if e.kind == "end"}
    previous = first
    for task_id, claimed_at in accepted:
        if previous in end_of:
            assert claimed_at > end_of[previous], "accepted while a call of the key was queued"
        previous = task_id
    running: set[str] = set()
    for e in events:  # the killed run's start has no end: it stops counting at the kill
        if e.kind == "start":
            running.discard(first)
            running.add(e.fields["id"])
            assert len(running) == 1, "two calls of the key ran at once"
        else:
            running.discard(e.fields["id"])


def _through_a_kill(
    worker: Worker, task: Any, kill: Callable[[int], Worker], again: bool
) -> tuple[list[Event], str, Producer, float]:
    """Start a long call of a new key, start producing, SIGKILL its process (`kill`
    returns the worker that runs what is left), and produce until AFTER more calls ran."""
    k = key()
    first = task.apply_async((k, 60.0), queue=worker.queue)
    victim = worker.wait_events(k, "start", 1)[0].pid
    producer = Producer(task, k, worker.queue)
    producer.start()
    try:
        time.sleep(0.3)  # refusals while it runs
        killed_at = time.time()
        runner = kill(victim)
        if again:
            wait_until("the killed call delivered again", lambda: first.id in {
                e.fields["id"] for e in runner.events_of(k) if e.kind == "end"
            }, 60)  # fmt: skip
        wait_until(
            f"{AFTER} more calls accepted",
            lambda: len(producer.accepted) >= AFTER or producer.error is not None,
            60,
        )
    finally:
        producer.stop.set()
        producer.join(30)
    assert producer.error is None, producer.error
    runner.wait_events(k, "end", len(producer.accepted) + int(again), timeout=60)
    time.sleep(0.5)  # a duplicate run, were there one, would show by now
    return runner.events_of(k), first.id, producer, killed_at


def _report(label: str, events: list[Event], first: str, p: Producer, killed_at: float) -> None:
    redelivered = [e.t for e in events if e.kind == "end" and e.fields["id"] == first]
    claims = [t for _, t in p.accepted]
    refused_after = sum(t > killed_at for t in p.refused)
    print(
        f"\n{label}: SIGKILL -> first claim accepted {(claims[0] - killed_at) * 1000:.0f} ms"
        + (f" (the delivered-again call ended at {(redelivered[0] - killed_at) * 1000:.0f} ms)"
           if redelivered else "")
        + f"; {len(claims)} accepted, {refused_after} refused after the kill"
    )  # fmt: skip


@pytest.fixture(scope="module")
def prefork_worker(
    node: devbroker.NodeInfo, celery_home: Path, celery_app: object
) -> Iterator[Worker]:
    worker = Worker(node.url, celery_home, "prefork", 4)
    yield worker
    worker.stop()


@pytest.mark.parametrize(
    ("task", "again"),
    [(once_redelivered, True), (once_late_acked, False), (once, False)],
    ids=["acks_late+reject_on_worker_lost", "acks_late", "early_ack"],
)
def test_prefork_child_killed_while_producing(
    prefork_worker: Worker, task: Any, again: bool
) -> None:
    def kill(pid: int) -> Worker:
        os.kill(pid, signal.SIGKILL)
        return prefork_worker

    events, first, producer, killed_at = _through_a_kill(prefork_worker, task, kill, again)
    _check(events, first, producer.accepted, again)
    if again:  # refused until the delivered-again call ended
        end = next(e.t for e in events if e.kind == "end" and e.fields["id"] == first)
        assert producer.accepted[0][1] > end
        assert sum(t > killed_at for t in producer.refused) > 0
    _report(f"prefork/{task.name.rsplit('.', 1)[-1]}", events, first, producer, killed_at)


@pytest.mark.parametrize(
    ("pool", "task", "again"),
    [
        ("solo", once_redelivered, True),
        ("solo", once_early, True),
        ("threads", once_redelivered, True),
        ("threads", once_early, False),
    ],
    ids=["solo-acks_late", "solo-early_ack", "threads-acks_late", "threads-early_ack"],
)
def test_worker_process_killed_while_producing(
    node: devbroker.NodeInfo,
    celery_home: Path,
    celery_app: object,
    pool: str,
    task: Any,
    again: bool,
) -> None:
    """The solo and threads pools: the worker process dies with the call. A message that
    comes back keeps its key refused while no worker runs (it waits in the queue) and
    until the next worker ran it; one that does not frees the key at once. On the solo
    pool Celery's early acknowledgement does not reach the broker before the call ends:
    its message comes back even without acks_late (on the threads pool it does not)."""
    workers = [Worker(node.url, celery_home, pool, 1)]

    def kill(pid: int) -> Worker:
        os.kill(workers[0].pid, signal.SIGKILL)
        workers[0].proc.wait(10)
        workers.append(Worker(node.url, celery_home, pool, 1, queue=workers[0].queue))
        return workers[-1]

    try:
        events, first, producer, killed_at = _through_a_kill(workers[0], task, kill, again)
        _check(events, first, producer.accepted, again)
        if again:
            end = next(e.t for e in events if e.kind == "end" and e.fields["id"] == first)
            assert producer.accepted[0][1] > end
        _report(f"{pool}/{task.name.rsplit('.', 1)[-1]}", events, first, producer, killed_at)
    finally:
        for w in workers:
            w.stop()
