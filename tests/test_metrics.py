"""Prometheus metrics record acquires, holds, losses and mastership from lock events."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest

from amqp_locks import (
    Broker,
    LockableService,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
    SharedFileLocker,
    metrics,
)
from amqp_locks_dev import devbroker


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
        assert value("amqp_locks_held", kind="semaphore", name=name) == 1
        assert sem.acquire(blocking=False) is None
    assert value("amqp_locks_held", kind="semaphore", name=name) == 0
    granted = dict(kind="semaphore", name=name, outcome="granted")
    timeout = dict(kind="semaphore", name=name, outcome="timeout")
    assert value("amqp_locks_acquire_seconds_count", **granted) == 1
    assert value("amqp_locks_acquire_seconds_count", **timeout) == 1
    assert value("amqp_locks_hold_seconds_count", kind="semaphore", name=name, end="released") == 1

    lost = sem.acquire()
    assert lost is not None
    admin.remove_slots(1)
    assert lost.lost.wait(10)
    lost.release()  # counted once, as lost
    assert value("amqp_locks_lost_total", kind="semaphore", name=name) == 1
    assert value("amqp_locks_held", kind="semaphore", name=name) == 0
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


def _value(registry, metric: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    v = registry.get_sample_value(metric, labels)
    return 0.0 if v is None else float(v)


def _until(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_enable_again_after_disable_reuses_the_metrics(broker: Broker, name: str) -> None:
    reg = prometheus_client.CollectorRegistry()
    metrics.enable(reg)
    try:
        Mutex(broker, name).acquire().release()  # type: ignore[union-attr]
        metrics.disable()
        metrics.enable(reg)  # raised "Duplicated timeseries" before
        metrics.enable(reg)  # idempotent
        Mutex(broker, name).acquire().release()  # type: ignore[union-attr]
        count = "amqp_locks_acquire_seconds_count"
        assert _value(reg, count, kind="mutex", name=name, outcome="granted") == 2
        metrics.disable()
        # The global registry too (the one a plain enable() uses).
        metrics.enable()
        metrics.disable()
        metrics.enable()
    finally:
        metrics.disable()


def test_name_label_can_be_dropped(broker: Broker, name: str) -> None:
    reg = prometheus_client.CollectorRegistry()
    metrics.enable(reg, name_label=False)
    try:
        with Mutex(broker, name).acquire():  # type: ignore[union-attr]
            assert _value(reg, "amqp_locks_held", kind="mutex") == 1
        names = {
            labels.get("name")
            for family in reg.collect()
            for labels in (s.labels for s in family.samples)
        }
        assert names == {None}, names  # no metric has the label
        assert _value(reg, "amqp_locks_acquire_seconds_count", kind="mutex", outcome="granted") == 1
        metrics.disable()
        metrics.enable(reg)  # back to per-name series: re-registered with the label
        with Mutex(broker, name).acquire():  # type: ignore[union-attr]
            assert _value(reg, "amqp_locks_held", kind="mutex", name=name) == 1
    finally:
        metrics.disable()


def test_waiters_gauge(registry, amqp_url: str, broker: Broker, name: str) -> None:  # type: ignore[no-untyped-def]
    holder = Mutex(broker, name).acquire()
    assert holder is not None
    other = Broker(amqp_url)
    got = []
    waiter = threading.Thread(target=lambda: got.append(Mutex(other, name).acquire(timeout=20)))
    waiter.start()
    try:
        _until(lambda: _value(registry, "amqp_locks_waiters", kind="mutex", name=name) == 1)
        assert _value(registry, "amqp_locks_held", kind="mutex", name=name) == 1
        holder.release()
        waiter.join(20)
        assert got and got[0] is not None
        assert _value(registry, "amqp_locks_waiters", kind="mutex", name=name) == 0
        assert _value(registry, "amqp_locks_held", kind="mutex", name=name) == 1
        got[0].release()
    finally:
        other.close()


def test_connection_up_and_reconnects(registry, amqp_url: str, node, name: str) -> None:  # type: ignore[no-untyped-def]
    conn_name = f"metrics-test {name}"
    b = Broker(amqp_url, heartbeat=2.0, connection_name=conn_name)
    try:
        b.connect()
        assert _value(registry, "amqp_locks_connections_up") == 1
        assert _value(registry, "amqp_locks_reconnects_total") == 0
        deadline = time.monotonic() + 30
        while True:  # the listing may lag the connection by a moment
            listing = devbroker.rabbitmqctl(
                node, "list_connections", "pid", "client_properties", "--no-table-headers", "-q"
            )
            mine = [ln.split("\t", 1)[0] for ln in listing.splitlines() if conn_name in ln]
            if mine or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(mine) == 1
        devbroker.rabbitmqctl(node, "close_connection", mine[0], "test: closed")
        _until(lambda: _value(registry, "amqp_locks_connections_up") == 0)
        b.round_trip()  # reconnects
        assert _value(registry, "amqp_locks_connections_up") == 1
        assert _value(registry, "amqp_locks_reconnects_total") == 1
    finally:
        b.close()
    assert _value(registry, "amqp_locks_connections_up") == 0


def test_demotions_and_keep_alive_failures(registry, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    masters = []
    service = LockableService(
        SharedFileLocker(tmp_path, lock_acquire_sleep_interval=0.1),
        lambda stop: (masters.append(1), stop.wait(30)),
        lock_keep_alive_period=0.1,
    )
    service.start()
    labels = dict(locker="SharedFileLocker", name="lock")
    try:
        _until(lambda: len(masters) == 1)
        assert _value(registry, "amqp_locks_demotions_total", **labels) == 0
        (tmp_path / "lock").unlink()  # AMQ-4705: the keep-alive sees the file gone
        _until(lambda: _value(registry, "amqp_locks_demotions_total", **labels) == 1)
        failed = _value(registry, "amqp_locks_keep_alive_failures_total", reason="failed", **labels)
        assert failed == 1
        _until(lambda: len(masters) == 2)  # master again, on a new file
    finally:
        service.stop(10)
