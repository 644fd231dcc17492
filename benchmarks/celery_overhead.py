"""What a lock costs a Celery task (docs/celery.md): p50 of an empty task's round trip
(``apply_async`` then ``get``) without a lock, with ``amqp_locks.celery.Singleton`` and with
celery-once's ``QueueOnce`` on a private Redis, one solo-pool worker, calls interleaved
across the variants (drift hits all alike); a ``once`` call refused because its key is not
free yet is retried at once and counted.

Then what enqueue-time dedup costs the producer alone (issue 31, item 2): ``apply_async``
of a new key each call, plain against ``once=True`` and celery-once (p50, interleaved),
and a burst of back-to-back calls of new keys per variant (calls per second, and the
ratio to plain). These go to a queue no worker consumes, so the worker's runs do not
compete with the producer; the queue is deleted and the keys freed afterwards.
"""

from __future__ import annotations

import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from celery import Celery, signals
from celery_once import QueueOnce

from amqp_locks.celery import Singleton
from amqp_locks.celery.config import close_all
from benchmarks.stats import percentile

ROOT = Path(__file__).resolve().parents[1]

# The client runs this module as benchmarks.run's import, the worker as its -A app.
app = Celery("celery_overhead", broker=os.environ.get("BENCH_BROKER"))
app.conf.update(
    result_backend="rpc://",
    task_default_queue=os.environ.get("BENCH_QUEUE", "celery-bench"),
    broker_connection_retry_on_startup=True,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ.get("BENCH_REDIS", ""), "default_timeout": 3600},
    },
)


def _same(*_: Any, **__: Any) -> str:
    return "bench-same-key"


def _echo(i: int) -> int:
    return i


_SAME, _NEW = "same key", "new key each call"
#: (label, library, how the key varies, task name, base, options); without ``lock_key`` a
#: Singleton's key is the task's name and its argument: a new key every call.
_TASKS: list[tuple[str, str, str, str, Any, dict[str, Any]]] = [
    ("no lock", "-", "-", "plain", app.Task, {}),
    ("Singleton (mutex)", "amqp-locks", _SAME, "mutex_same", Singleton, {"lock_key": _same}),
    ("Singleton (mutex)", "amqp-locks", _NEW, "mutex_new", Singleton, {}),
    (
        "Singleton lock_limit=3",
        "amqp-locks",
        _SAME,
        "token3_same",
        Singleton,
        {"lock_key": _same, "lock_limit": 3},
    ),
    (
        "Singleton once=True",
        "amqp-locks",
        _SAME,
        "once_same",
        Singleton,
        {"once": True, "lock_key": _same},
    ),
    ("Singleton once=True", "amqp-locks", _NEW, "once_new", Singleton, {"once": True}),
    (
        "Singleton once=True, once_durable=False",
        "amqp-locks",
        _NEW,
        "once_transient_new",
        Singleton,
        {"once": True, "once_durable": False},
    ),
    (
        "QueueOnce",
        "celery-once",
        _SAME,
        "celery_once_same",
        QueueOnce,
        {"once": {"graceful": True, "keys": []}},
    ),
    ("QueueOnce", "celery-once", _NEW, "celery_once_new", QueueOnce, {"once": {"graceful": True}}),
]
#: (label, task, library, how the key varies)
VARIANTS = [
    (label, app.task(base=base, name=f"bench.{name}", **opts)(_echo), library, key)
    for label, library, key, name, base, opts in _TASKS
]


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    if path := os.environ.get("BENCH_READY"):
        Path(path).write_text(str(os.getpid()))


def _call(task: Any, i: int) -> tuple[float, int]:
    """One round trip; refusals of a key not yet freed are retried at once and counted."""
    refused, t0 = 0, time.perf_counter()
    graceful = {"once_graceful": True} if getattr(task, "once", None) is True else {}
    while not getattr(result := task.apply_async((i,), **graceful), "id", None):
        refused += 1
    result.get(timeout=60)
    return time.perf_counter() - t0, refused


#: (label, library, task name) of the enqueue measurements: new keys every call.
_ENQUEUE = [
    ("no lock", "-", "bench.plain"),
    ("Singleton once=True", "amqp-locks", "bench.once_new"),
    ("Singleton once=True, once_durable=False", "amqp-locks", "bench.once_transient_new"),
    ("QueueOnce", "celery-once", "bench.celery_once_new"),
]


def _enqueue(task: Any, i: int, queue: str) -> float:
    """One accepted ``apply_async`` of a new key (its argument), timed."""
    t0 = time.perf_counter()
    result = task.apply_async((i,), queue=queue)
    took = time.perf_counter() - t0
    if not getattr(result, "id", None):
        raise RuntimeError(f"{task.name}({i}) was refused: its key is new")
    return took


def enqueue(calls: int, warmup: int, burst: int, queue: str) -> dict[str, Any]:
    """The producer's cost of an accepted enqueue, and of a burst, per variant."""
    tasks = [app.tasks[name] for _, _, name in _ENQUEUE]
    first = random.randrange(1, 10**6) * 10**7 + 5 * 10**6  # keys no earlier run used
    samples: list[list[float]] = [[] for _ in tasks]
    sent: list[list[int]] = [[] for _ in tasks]
    n = first
    for rnd in range(warmup + calls):
        for k, task in enumerate(tasks):
            n += 1
            took = _enqueue(task, n, queue)
            sent[k].append(n)
            if rnd >= warmup:
                samples[k].append(took)
    rates: list[float] = []
    for k, task in enumerate(tasks):
        t0 = time.perf_counter()
        for _ in range(burst):
            n += 1
            _enqueue(task, n, queue)
            sent[k].append(n)
        rates.append(burst / (time.perf_counter() - t0))
    _clean_up(tasks, sent, queue)
    base = percentile(samples[0], 50)
    rows = []
    for (label, library, _), xs, rate in zip(_ENQUEUE, samples, rates, strict=True):
        p50 = percentile(xs, 50)
        rows.append(
            {
                "variant": label,
                "library": library,
                "p50_ms": round(p50 * 1000, 3),
                "p90_ms": round(percentile(xs, 90) * 1000, 3),
                "x_plain_p50": round(p50 / base, 2),
                "burst_per_s": round(rate, 1),
                "burst_vs_plain": round(rate / rates[0], 3),
            }
        )
    return {"calls_per_variant": calls, "burst": burst, "rows": rows}


def _clean_up(tasks: list[Any], sent: list[list[int]], queue: str) -> None:
    """Delete the unconsumed queue, then free every key claimed (amqp-locks: by
    ``forget_once``; celery-once's Redis keys go with its private server)."""
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(queue)
    for task, args in zip(tasks, sent, strict=True):
        if isinstance(task, Singleton):
            for i in args:
                task.forget_once((i,))


def run(url: str, line: str, calls: int, warmup: int, burst: int = 300) -> dict[str, Any]:
    """The round trips on the broker ``url`` (of RabbitMQ ``line``) and a private Redis."""
    import redis

    from amqp_locks_dev import devredis

    redis_was = devredis.status("celery-bench") is not None
    rinfo = devredis.start("celery-bench")

    redis_version = str(redis.Redis.from_url(rinfo.url).info()["redis_version"])
    tmp = Path(tempfile.mkdtemp(prefix="celery-bench-"))
    queue, ready = f"celery-bench-{uuid.uuid4().hex[:8]}", tmp / "ready"
    env = {**os.environ, "BENCH_BROKER": url, "BENCH_REDIS": rinfo.url, "BENCH_QUEUE": queue}
    # The library the client runs (PYTHONPATH=/tmp/al/src for a commit: benchmarks/README).
    path = [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]
    env.update(BENCH_READY=str(ready), PYTHONPATH=os.pathsep.join(path))
    app.conf.broker_url, app.conf.task_default_queue = url, queue
    app.conf.ONCE["settings"]["url"] = rinfo.url
    argv = [sys.executable, "-m", "celery", "-A", "benchmarks.celery_overhead", "worker"]
    argv += ["--pool", "solo", "--queues", queue, "--hostname", f"{queue}@%h"]
    argv += ["--loglevel", "WARNING", "--logfile", str(tmp / "worker.log")]
    argv += ["--without-gossip", "--without-mingle"]
    worker = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    samples: list[list[float]] = [[] for _ in VARIANTS]
    refusals = [0] * len(VARIANTS)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start; see {tmp / 'worker.log'}")
            time.sleep(0.05)
        # A run stopped midway leaves its claims on a node kept for the next run: the
        # same-key claim is freed, and the new keys start where no earlier run's did.
        for _, task, _, key in VARIANTS:
            if key == _SAME and getattr(task, "once", None) is True:
                task.forget_once((0,), force=True)
        first = random.randrange(1, 10**6) * 10**7
        for rnd in range(warmup + calls):
            for n, (_, task, _, _) in enumerate(VARIANTS):
                took, refused = _call(task, first + rnd * len(VARIANTS) + n + 1)
                if rnd >= warmup:
                    samples[n].append(took)
                    refusals[n] += refused
        enqueued = enqueue(calls, warmup, burst, f"{queue}-enqueue")
    finally:
        close_all()  # this process's lock connections, before their node stops
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
        if not redis_was:
            devredis.stop("celery-bench")
    base = percentile(samples[0], 50)
    rows = []
    for (label, _, library, key), xs, refused in zip(VARIANTS, samples, refusals, strict=True):
        p50, p90 = percentile(xs, 50), percentile(xs, 90)
        rows.append(
            {
                "variant": label,
                "library": library,
                "key": key,
                "p50_ms": round(p50 * 1000, 2),
                "p90_ms": round(p90 * 1000, 2),
                "overhead_p50_ms": round((p50 - base) * 1000, 2),
                "refused_and_retried": refused,
            }
        )
    return {
        "calls_per_variant": calls,
        "warmup_per_variant": warmup,
        "pool": "solo",
        "rabbitmq_line": line,
        "redis": redis_version,
        "celery": metadata.version("celery"),
        "celery_once": metadata.version("celery_once"),
        "python": platform.python_version(),
        "rows": rows,
        "enqueue": enqueued,
    }


def _markdown(head: str, rule: str, rows: Iterable[str]) -> str:
    """A markdown table: its head row, its alignment row, then one line a row."""
    return "\n".join([head, rule, *rows])


def table(result: dict[str, Any]) -> str:
    return _markdown(
        "| variant | library | key | p50 ms | p90 ms | overhead (p50) ms | refused, retried |",
        "|---|---|---|---:|---:|---:|---:|",
        (
            f"| {r['variant']} | {r['library']} | {r['key']} | {r['p50_ms']:.2f} | "
            f"{r['p90_ms']:.2f} | {r['overhead_p50_ms']:+.2f} | {r['refused_and_retried']} |"
            for r in result["rows"]
        ),
    )


def enqueue_table(result: dict[str, Any]) -> str:
    e = result["enqueue"]
    return _markdown(
        f"| variant | library | apply_async p50 ms | p90 ms | x plain (p50) | "
        f"burst of {e['burst']}: calls/s | burst vs plain |",
        "|---|---|---:|---:|---:|---:|---:|",
        (
            f"| {r['variant']} | {r['library']} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | "
            f"{r['x_plain_p50']:.2f} | {r['burst_per_s']:.0f} | {r['burst_vs_plain']:.0%} |"
            for r in e["rows"]
        ),
    )
