"""Prometheus metrics record acquires, holds, losses and mastership from lock events."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest

from amqp_locks import (
    Broker,
    LockableService,
    PersistentSemaphore,
    SemaphoreAdmin,
    SharedFileLocker,
    metrics,
)


@pytest.fixture
def registry() -> Iterator[object]:
    reg = prometheus_client.CollectorRegistry()
    metrics.enable(reg)
    yield reg
    metrics.disable()


def test_acquire_hold_lost_and_master(registry, broker: Broker, name: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    def value(metric: str, **labels: str) -> float:
        v = registry.get_sample_value(metric, labels)
        return 0.0 if v is None else float(v)

    admin = SemaphoreAdmin(broker, name)
    admin.create(1)
    sem = PersistentSemaphore(broker, name)
    with sem.acquire() as lease:  # type: ignore[union-attr]
        assert value("amqp_locks_held", kind="slot", name=name) == 1
        assert sem.acquire(blocking=False) is None
    assert value("amqp_locks_held", kind="slot", name=name) == 0
    granted = dict(kind="slot", name=name, outcome="granted")
    timeout = dict(kind="slot", name=name, outcome="timeout")
    assert value("amqp_locks_acquire_seconds_count", **granted) == 1
    assert value("amqp_locks_acquire_seconds_count", **timeout) == 1
    assert value("amqp_locks_hold_seconds_count", kind="slot", name=name, end="released") == 1

    lost = sem.acquire()
    assert lost is not None
    admin.remove_slots(1)
    assert lost.lost.wait(10)
    lost.release()  # counted once, as lost
    assert value("amqp_locks_lost_total", kind="slot", name=name) == 1
    assert value("amqp_locks_held", kind="slot", name=name) == 0
    assert lease.released

    mastered = threading.Event()
    service = LockableService(
        SharedFileLocker(tmp_path), lambda stop: (mastered.set(), stop.wait(10))
    )
    service.start()
    assert mastered.wait(10)  # the work runs once the service is master
    assert value("amqp_locks_master", locker="SharedFileLocker", name="lock") == 1
    service.stop(10)
    assert value("amqp_locks_master", locker="SharedFileLocker", name="lock") == 0
