"""What a lock costs a Celery task (docs/celery.md): p50 of an empty task's round trip
(``apply_async`` then ``get``) without a lock, with ``amqp_locks.celery.Singleton`` and with
celery-once's ``QueueOnce`` on a private Redis, one solo-pool worker, calls interleaved
across the variants (drift hits all alike); a ``once`` call refused because its key is not
free yet is retried at once and counted.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
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


def run(url: str, line: str, calls: int, warmup: int) -> dict[str, Any]:
    """The round trips on the broker ``url`` (of RabbitMQ ``line``) and a private Redis."""
    import redis

    from amqp_locks_dev import devredis

    redis_was = devredis.status("celery-bench") is not None
    rinfo = devredis.start("celery-bench")

    redis_version = str(redis.Redis.from_url(rinfo.url).info()["redis_version"])
    tmp = Path(tempfile.mkdtemp(prefix="celery-bench-"))
    queue, ready = f"celery-bench-{uuid.uuid4().hex[:8]}", tmp / "ready"
    env = {**os.environ, "BENCH_BROKER": url, "BENCH_REDIS": rinfo.url, "BENCH_QUEUE": queue}
    env.update(BENCH_READY=str(ready), PYTHONPATH=str(ROOT))
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
        for rnd in range(warmup + calls):
            for n, (_, task, _, _) in enumerate(VARIANTS):
                took, refused = _call(task, rnd * len(VARIANTS) + n + 1)
                if rnd >= warmup:
                    samples[n].append(took)
                    refusals[n] += refused
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
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| variant | library | key | p50 ms | p90 ms | overhead (p50) ms | refused, retried |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['variant']} | {r['library']} | {r['key']} | {r['p50_ms']:.2f} | "
            f"{r['p90_ms']:.2f} | {r['overhead_p50_ms']:+.2f} | {r['refused_and_retried']} |"
        )
    return "\n".join(lines)
