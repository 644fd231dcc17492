"""What a lock costs a Celery task: p50 of an empty task's round trip (``apply_async``
then ``get``) without a lock, with ``amqp_locks.celery.Singleton`` and with celery-once's
``QueueOnce`` on Redis, in one run (docs/celery.md quotes it).

    python -m benchmarks.run celery-overhead [--calls 200] [--json PATH]

Starts a private RabbitMQ node (``amqp_locks_dev.devbroker``, name ``amqplocksbench``) and
a private Redis (``amqp_locks_dev.devredis``, name ``celery-bench``), stops what it
started, and runs one solo-pool worker (one task at a time: the figures are per-task
costs, not throughput). Calls are sequential and interleaved across the variants (one
call of each per round), so drift hits all alike. A ``once`` call refused because the
previous call of its key has not freed it yet is retried at once and counted.
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
QUEUE = os.environ.get("BENCH_QUEUE", "celery-bench")

# Tasks are named explicitly: the client runs this module as __main__, the worker imports
# it as benchmarks.celery_overhead.
app = Celery("celery_overhead", broker=os.environ.get("BENCH_BROKER"))
app.conf.update(
    result_backend="rpc://",
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ.get("BENCH_REDIS", ""), "default_timeout": 3600},
    },
)


def _same(*_: Any, **__: Any) -> str:
    return "bench-same-key"


@app.task(name="bench.plain")
def plain(i: int) -> int:
    return i


@app.task(base=Singleton, lock_key=_same, name="bench.mutex_same")
def mutex_same(i: int) -> int:
    return i


@app.task(
    base=Singleton, name="bench.mutex_new"
)  # the task's name and its argument: a new key every call
def mutex_new(i: int) -> int:
    return i


@app.task(base=Singleton, lock_key=_same, lock_limit=3, name="bench.token3_same")
def token3_same(i: int) -> int:
    return i


@app.task(base=Singleton, once=True, lock_key=_same, name="bench.once_same")
def once_same(i: int) -> int:
    return i


@app.task(base=Singleton, once=True, name="bench.once_new")
def once_new(i: int) -> int:
    return i


@app.task(base=QueueOnce, once={"graceful": True, "keys": []}, name="bench.celery_once_same")
def celery_once_same(i: int) -> int:
    return i


@app.task(base=QueueOnce, once={"graceful": True}, name="bench.celery_once_new")
def celery_once_new(i: int) -> int:
    return i


#: (label, task, library, how the key varies)
VARIANTS: list[tuple[str, Any, str, str]] = [
    ("no lock", plain, "-", "-"),
    ("Singleton (mutex)", mutex_same, "amqp-locks", "same key"),
    ("Singleton (mutex)", mutex_new, "amqp-locks", "new key each call"),
    ("Singleton lock_limit=3", token3_same, "amqp-locks", "same key"),
    ("Singleton once=True", once_same, "amqp-locks", "same key"),
    ("Singleton once=True", once_new, "amqp-locks", "new key each call"),
    ("QueueOnce", celery_once_same, "celery-once", "same key"),
    ("QueueOnce", celery_once_new, "celery-once", "new key each call"),
]


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = os.environ.get("BENCH_READY")
    if path:
        Path(path).write_text(str(os.getpid()))


def _call(task: Any, i: int) -> tuple[float, int]:
    """One round trip; refusals of a key not yet freed are retried at once and counted."""
    refused = 0
    t0 = time.perf_counter()
    while True:
        if task in (once_same, once_new):
            result = task.apply_async((i,), once_graceful=True)
        else:
            result = task.apply_async((i,))
        if result is not None and getattr(result, "id", None):
            break
        refused += 1
    result.get(timeout=60)
    return time.perf_counter() - t0, refused


def _start_worker(
    env: dict[str, str], queue: str, ready: Path, log: Path
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "celery", "-A", "benchmarks.celery_overhead", "worker",
        "--pool", "solo", "--queues", queue, "--hostname", f"{queue}@%h",
        "--loglevel", "WARNING", "--logfile", str(log), "--without-gossip", "--without-mingle",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not start; see {log}")
        time.sleep(0.05)
    return proc


def _redis_version(url: str) -> str:
    import redis

    return str(redis.Redis.from_url(url).info()["redis_version"])


def run(calls: int, warmup: int, node_name: str = "amqplocksbench") -> dict[str, Any]:
    from amqp_locks_dev import devbroker, devredis

    broker_was = devbroker.status(name=node_name) is not None
    redis_was = devredis.status("celery-bench") is not None
    node = devbroker.start(name=node_name)
    rinfo = devredis.start("celery-bench")
    redis_version = _redis_version(rinfo.url)
    tmp = Path(tempfile.mkdtemp(prefix="celery-bench-"))
    queue = f"celery-bench-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "BENCH_BROKER": node.url,
        "BENCH_REDIS": rinfo.url,
        "BENCH_QUEUE": queue,
        "BENCH_READY": str(tmp / "ready"),
        "PYTHONPATH": str(ROOT),
    }
    app.conf.broker_url = node.url
    app.conf.task_default_queue = queue
    app.conf.ONCE["settings"]["url"] = rinfo.url
    worker = _start_worker(env, queue, tmp / "ready", tmp / "worker.log")
    samples: dict[int, list[float]] = {n: [] for n in range(len(VARIANTS))}
    refusals = dict.fromkeys(samples, 0)
    try:
        counter = 0
        for rnd in range(warmup + calls):
            for n, (_, task, _, _) in enumerate(VARIANTS):
                counter += 1
                took, refused = _call(task, counter)
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
        if not broker_was:
            devbroker.stop(name=node_name)
    base = percentile(samples[0], 50)
    rows = []
    for n, (label, _, library, key) in enumerate(VARIANTS):
        p50 = percentile(samples[n], 50)
        rows.append(
            {
                "variant": label,
                "library": library,
                "key": key,
                "p50_ms": round(p50 * 1000, 2),
                "p90_ms": round(percentile(samples[n], 90) * 1000, 2),
                "overhead_p50_ms": round((p50 - base) * 1000, 2),
                "refused_and_retried": refusals[n],
            }
        )
    return {
        "calls_per_variant": calls,
        "warmup_per_variant": warmup,
        "pool": "solo",
        "rabbitmq_line": devbroker.default_version(),
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
