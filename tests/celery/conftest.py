"""Real Celery workers (the celery CLI, as subprocesses) against the test RabbitMQ node.

Each worker consumes a queue of its own and writes its tasks' events to a file of its
own (tests/celery/app.py); tests use keys of their own, so one worker serves every test
of a module. Workers are stopped (warm shutdown, then SIGKILL of their process group)
by the fixture that started them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from amqp_locks_dev import devbroker

from .. import waiting

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Event:
    t: float
    kind: str  # "start" | "end"
    key: str
    pid: int
    fields: dict[str, str] = field(default_factory=dict)


def read_events(
    path: Path, key: str | None = None, kinds: tuple[str, ...] = ("start", "end")
) -> list[Event]:
    """The events file in order (the order the tasks wrote them), of `key` if given:
    "start" and "end" by default, "called" (before the lock is taken) if asked."""
    out: list[Event] = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            t, kind, k, *rest = line.split()
            fields = dict(item.split("=", 1) for item in rest)
            if (key is None or k == key) and kind in kinds:
                out.append(Event(float(t), kind, k, int(fields.pop("pid")), fields))
    return out


def max_running(events: list[Event]) -> int:
    """The most calls that were between their start and end at once (exact: the file
    order is the real order)."""
    running = peak = 0
    for e in events:
        running += 1 if e.kind == "start" else -1
        peak = max(peak, running)
    return peak


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll `predicate` (a file or broker read) until it is truthy; fail after `timeout`."""
    return waiting.wait_until(predicate, timeout, what, step=0.02)


class Worker:
    """One `celery worker` subprocess with its own queue, events file and log."""

    def __init__(
        self,
        url: str,
        home: Path,
        pool: str,
        concurrency: int,
        queue: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.pool = pool
        self.queue = queue or f"celery-test-{uuid.uuid4().hex[:10]}"
        tag = uuid.uuid4().hex[:6]
        self.events = home / f"{self.queue}.events"
        self.log = home / f"{self.queue}-{tag}.log"
        self.ready = home / f"{self.queue}-{tag}.ready"
        self.env = {
            **os.environ,
            "CELERY_TEST_BROKER": url,
            "CELERY_TEST_QUEUE": self.queue,
            "CELERY_TEST_EVENTS": str(self.events),
            "CELERY_TEST_READY": str(self.ready),
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery.app",
            "worker",
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--queues",
            self.queue,
            "--hostname",
            f"{self.queue}-{tag}@%h",
            "--loglevel",
            "INFO",
            "--logfile",
            str(self.log),
            "--without-gossip",
            "--without-mingle",
        ]  # fmt: skip  (event heartbeats kept: their timer wakes the solo/threads loop
        #               for a shutdown signal; without it that takes 10 s)
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_until(f"{pool} worker ready", lambda: self.ready.exists() or self._died(), 90)
        except BaseException:
            self.stop()
            raise
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited ({self.proc.returncode}):\n{self.log_text()}")

    def _died(self) -> bool:
        return self.proc.poll() is not None

    def events_of(self, key: str) -> list[Event]:
        return read_events(self.events, key)

    def wait_called(self, key: str, count: int, timeout: float = 60.0) -> None:
        """Wait until `count` calls of `key` began in the worker (before their lock)."""
        wait_until(
            f"{count} calls of {key}",
            lambda: len(read_events(self.events, key, ("called",))) >= count,
            timeout,
        )

    def wait_events(self, key: str, kind: str, count: int, timeout: float = 60.0) -> list[Event]:
        """Wait until `count` events of `kind` for `key` were written; all of `key`'s."""
        wait_until(
            f"{count} {kind} events of {key}",
            lambda: sum(e.kind == kind for e in self.events_of(key)) >= count,
            timeout,
        )
        return self.events_of(key)

    def log_text(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return self.log.read_text(errors="replace")
        return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        """Warm shutdown; after 30 s, SIGKILL to the worker's process group (ours)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="session")
def celery_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("celery")


@pytest.fixture(scope="session")
def celery_app(node: devbroker.NodeInfo) -> Any:
    """The tests' Celery app, as producers use it, on the test broker."""
    from .app import app

    app.conf.broker_url = node.url
    return app


@pytest.fixture(scope="module")
def prefork(node: devbroker.NodeInfo, celery_home: Path, celery_app: Any) -> Iterator[Worker]:
    """A prefork worker with 4 children."""
    worker = Worker(node.url, celery_home, "prefork", 4)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def threads(node: devbroker.NodeInfo, celery_home: Path, celery_app: Any) -> Iterator[Worker]:
    """A threads-pool worker with 4 threads (one process, one Broker)."""
    worker = Worker(node.url, celery_home, "threads", 4)
    yield worker
    worker.stop()


def key() -> str:
    return f"k{uuid.uuid4().hex[:10]}"
