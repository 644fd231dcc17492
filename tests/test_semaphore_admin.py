"""Administration of the persistent semaphore against a real broker: every seed section."""

from __future__ import annotations

import threading

import pytest

from amqp_locks import (
    AdminLockTimeout,
    Broker,
    ConfigurationError,
    LockError,
    Mutex,
    PersistentSemaphore,
    PreconditionFailed,
    SemaphoreAdmin,
)
from amqp_locks.names import slot_queue

from .conftest import on_session, queue_exists
from .threads import run_in_threads


def declare(broker: Broker, queue: str, **kw: object) -> None:
    on_session(broker, lambda session: session.declare(queue, **kw))  # type: ignore[arg-type]


def test_create_max_add_remove_destroy(broker: Broker, name: str) -> None:
    admin = SemaphoreAdmin(broker, name)
    assert admin.max_slots() == 0
    assert admin.create(3) == 3
    assert [queue_exists(broker, slot_queue(name, k)) for k in range(1, 5)] == [
        True,
        True,
        True,
        False,
    ]
    assert admin.max_slots() == 3
    assert admin.create(3) == 3  # idempotent for the same count
    with pytest.raises(LockError, match="already exists with 3 slots"):
        admin.create(5)
    assert admin.add_slots(2) == 5
    assert admin.max_slots() == 5
    removal = admin.remove_slots(3)
    assert removal.removed == (5, 4, 3)  # descending
    assert admin.max_slots() == 2
    assert admin.remove_slots(10).removed == (2, 1)  # down to max(0, C - X)
    assert admin.max_slots() == 0
    admin.create(2)
    assert admin.destroy().removed == (2, 1)
    assert admin.max_slots() == 0
    assert not queue_exists(broker, slot_queue(name, 1))


def test_max_counts_past_the_first_window(broker: Broker, name: str) -> None:
    admin = SemaphoreAdmin(broker, name)
    admin.create(75)  # windows of 8, 16, 32, 64: the max lies in the fourth window
    assert admin.max_slots() == 75
    admin.destroy()


def test_ordered_existence_stops_at_first_gap(broker: Broker, name: str) -> None:
    admin = SemaphoreAdmin(broker, name)
    admin.create(2)
    declare(broker, slot_queue(name, 4), durable=True, arguments={"x-max-length": 0})
    assert admin.max_slots() == 2  # A[3] missing ends the count, A[4] is a stray


def test_overshoot_deletes_stray_slots(broker: Broker, name: str) -> None:
    admin = SemaphoreAdmin(broker, name, overshoot=5)
    admin.create(2)
    declare(broker, slot_queue(name, 5), durable=True, arguments={"x-max-length": 0})
    removal = admin.destroy()
    assert removal.overshoot_removed == (5,)
    assert not queue_exists(broker, slot_queue(name, 5))
    # without overshoot the stray stays
    declare(broker, slot_queue(name, 3), durable=True, arguments={"x-max-length": 0})
    SemaphoreAdmin(broker, name).destroy()
    assert queue_exists(broker, slot_queue(name, 3))
    SemaphoreAdmin(broker, name, overshoot=3).destroy()
    assert not queue_exists(broker, slot_queue(name, 3))


def test_ascending_deletion_makes_clients_fail_fast(broker: Broker, name: str) -> None:
    admin = SemaphoreAdmin(broker, name, ascending=True)
    admin.create(4)
    assert admin.remove_slots(2).removed == (3, 4)  # in deletion order
    assert admin.max_slots() == 2
    assert admin.destroy().removed == (1, 2)


def test_holders_and_wait_for_holders(broker: Broker, amqp_url: str, name: str) -> None:
    admin = SemaphoreAdmin(broker, name)
    admin.create(3)
    with Broker(amqp_url) as other:
        sem = PersistentSemaphore(other, name)
        a = sem.acquire(blocking=False)
        b = sem.acquire(blocking=False)
        assert a is not None and b is not None
        assert sorted(admin.holders()) == [1, 2]
        removal = admin.remove_slots(2)  # removes 3 and 2; 2 is held
        assert removal.still_held == (2,)
        assert admin.wait_for_holders([2], timeout=0) == [2]
        releasing = threading.Event()

        def release_later() -> None:
            releasing.set()
            b.release()

        releaser = threading.Thread(target=release_later)
        releaser.start()
        # The poll sees slot 2's B queue gone as soon as the broker deletes it, which
        # can be before b.release() has returned on the other thread: what it proves is
        # that the wait did not end before the release began.
        assert admin.wait_for_holders([2], timeout=30) == []
        assert releasing.is_set()
        releaser.join(30)
        assert not releaser.is_alive() and b.released
        assert admin.holders(beyond=5) == [1]
        a.release()
    admin.destroy()


def test_remove_slots_can_wait_for_holders(broker: Broker, amqp_url: str, name: str) -> None:
    admin = SemaphoreAdmin(broker, name)
    admin.create(1)
    with Broker(amqp_url) as other:
        lease = PersistentSemaphore(other, name).acquire()
        assert lease is not None
        lease.on_lost(lambda lease: lease.release())  # a polite holder gives the slot back
        removal = admin.remove_slots(1, wait=30)
        assert removal.still_held == ()
        assert lease.released


def test_existing_queue_with_other_arguments_is_reported(broker: Broker, name: str) -> None:
    declare(broker, slot_queue(name, 1), durable=True)  # no x-max-length
    with pytest.raises(PreconditionFailed, match=r"406.*" + slot_queue(name, 1)):
        SemaphoreAdmin(broker, name).create(1)
    # the connection survived the channel error
    assert SemaphoreAdmin(broker, name + "x").create(1) == 1


def test_bad_counts_are_refused(broker: Broker, name: str) -> None:
    admin = SemaphoreAdmin(broker, name)
    for bad in (0, -1):
        with pytest.raises(ConfigurationError, match="slots must be >= 1"):
            admin.create(bad)
    with pytest.raises(ConfigurationError):
        admin.add_slots(-2)
    with pytest.raises(ConfigurationError):
        admin.remove_slots(0)
    with pytest.raises(ConfigurationError):
        SemaphoreAdmin(broker, name, overshoot=-1)
    with pytest.raises(LockError, match="does not exist"):
        admin.add_slots(1)


def test_admin_waits_for_the_mutex_and_times_out(broker: Broker, amqp_url: str, name: str) -> None:
    with Broker(amqp_url) as other:
        held = Mutex(other, name, fencing=False).acquire()
        assert held is not None
        with pytest.raises(AdminLockTimeout, match=name):
            SemaphoreAdmin(broker, name, mutex_timeout=0.3).max_slots()
        held.release()
    assert SemaphoreAdmin(broker, name, mutex_timeout=5).create(2) == 2


def test_concurrent_administrators_are_serialised(amqp_url: str, name: str) -> None:
    with Broker(amqp_url) as b0:
        SemaphoreAdmin(b0, name).create(1)

    def add_many() -> None:
        with Broker(amqp_url) as b:
            admin = SemaphoreAdmin(b, name, mutex_timeout=60)
            for _ in range(8):
                admin.add_slots(1)

    errors = run_in_threads(add_many, 4)
    assert not errors
    with Broker(amqp_url) as b:
        admin = SemaphoreAdmin(b, name)
        assert admin.max_slots() == 1 + 4 * 8
        # no stray slot beyond the max: the slots are exactly 1..33
        assert not queue_exists(b, slot_queue(name, 34))
        admin.destroy()
