"""Quorum slots removed while clients use them (semaphore/burial.py): no client connection
is closed, a holder of a slot being removed learns it, and a removal cut after any frame
is finished (or taken back) by the next administration action."""

from __future__ import annotations

import contextlib
import threading

import pytest

from amqp_locks import Broker, PersistentSemaphore, SemaphoreAdmin
from amqp_locks.names import holder_queue, quorum_marker, slot_queue, slot_tombstone
from amqp_locks.semaphore import burial
from amqp_locks.transport.errors import undelivered_to
from amqp_locks.transport.line_args import parse_version
from amqp_locks_dev import devbroker
from benchmarks.slot_churn import CLIENTS, SLOTS, churn

from . import waiting
from .conftest import on_session
from .faultproxy import FaultProxy

#: Shorter than the library's (10 s and 5 s) with the library's margin: a consume meets a
#: removal only if the broker reads it GRACE - FRESH after the look, 5 s in both. A 1.7 s
#: margin failed beside a rehearsal at load 17 (3 connections closed; 0.7 s before that
#: was enough in 16 quieter runs).
GRACE, FRESH = 5.5, 0.5


@pytest.fixture
def quick_burial(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(burial, "BURY_GRACE", GRACE)
    monkeypatch.setattr(burial, "LOOK_FRESH", FRESH)


def _queues(node: devbroker.NodeInfo, name: str) -> dict[str, str]:
    """Queue name -> type of semaphore `name`'s slot, marker and tombstone queues."""
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "type", "--no-table-headers")
    rows = (line.split() for line in out.splitlines())
    return {
        r[0]: r[1]
        for r in rows
        if len(r) == 2 and r[0].startswith(name + "-") and r[0].endswith("-A")
    }


def _holder_delete_race(reason: str, name: str) -> bool:
    """Whether a connection's end is RabbitMQ 4.2+'s 506 for a probe that met a holder
    queue `B[k]` of semaphore `name` as it was deleted (the target found by routing, the
    queue record gone by the time the channel looks it up)."""
    return undelivered_to(reason) in {holder_queue(name, k) for k in range(1, SLOTS + 1)}


def test_the_holder_delete_race_is_told_from_a_burial_failure() -> None:
    """The close stop 54's CI logged (4.3.6), and closes that burial exists to prevent."""
    race = (
        "connection closed: RESOURCE_ERROR - failed to deliver message: {not_found,\n"
        '                               {resource,<<"/">>,queue,\n'
        '                                   <<"churn-15a09858-1-B">>}}'
    )
    assert _holder_delete_race(race, "churn-15a09858")
    assert not _holder_delete_race(race, "churn-00000000")
    assert not _holder_delete_race(race.replace("-1-B", "-1-A"), "churn-15a09858")
    assert not _holder_delete_race(
        "connection closed: INTERNAL_ERROR - failed consuming from quorum queue "
        "'churn-15a09858-1-A' in vhost '/': noproc",
        "churn-15a09858",
    )


def _exists(broker: Broker, queues: list[str]) -> list[bool]:
    return on_session(broker, lambda s: s.probe(queues))


@pytest.mark.usefixtures("quick_burial")
def test_quorum_slots_removed_and_added_under_clients_close_no_connection(
    amqp_url: str, node: devbroker.NodeInfo
) -> None:
    """benchmarks/slot_churn.py's loop: before burial, 2-4 of 4 client connections were
    closed in 30 s on 3.10.8 and 4.3.6 (RabbitMQ closes a connection that probes or
    consumes a quorum queue being deleted)."""
    out = churn(amqp_url, quorum=True, seconds=6 * GRACE)
    assert out.errors == []
    races = [r for r in out.lost.values() if _holder_delete_race(r, out.name)]
    # Burial's claim: no connection closed by a slot being removed. RabbitMQ 4.2+ also
    # closes (rarely) a connection whose probe meets a *holder* queue at the instant its
    # holder's release deletes it (docs/protocol.md, "Known gaps": 1 in about 80 CI runs
    # of this loop): counted apart, 4.2+ only, and rare.
    assert [r for r in out.lost.values() if r not in races] == []
    assert not races or parse_version(node.version) >= (4, 2), races
    assert len(races) <= 1, races
    assert out.rounds >= 3  # each removal waits GRACE
    assert len(out.grants) == CLIENTS and all(g > 0 for g in out.grants), out.grants


@pytest.mark.usefixtures("quick_burial")
def test_a_holder_of_a_slot_being_removed_learns_it(
    broker: Broker, amqp_url: str, name: str, node: devbroker.NodeInfo
) -> None:
    admin = SemaphoreAdmin(broker, name, quorum=True)
    admin.create(2)
    assert _queues(node, name) == {
        quorum_marker(name): "classic",
        slot_queue(name, 1): "quorum",
        slot_queue(name, 2): "quorum",
    }
    with Broker(amqp_url) as other:
        sem = PersistentSemaphore(other, name)
        first, second = sem.acquire(timeout=5), sem.acquire(timeout=5)
        assert first is not None and second is not None and second.number == 2
        removal: list[object] = []
        remover = threading.Thread(target=lambda: removal.append(admin.remove_slots(1)))
        remover.start()
        try:
            tomb = slot_tombstone(name, 2)
            waiting.wait_until(lambda: _exists(broker, [tomb])[0], 5, "slot 2 buried")
            assert second.verify() is False  # told before the slot's queue goes
            assert "being removed" in (second.lost_reason or "")
            assert first.verify() is True
            assert PersistentSemaphore(broker, name).acquire(blocking=False) is None
        finally:
            remover.join(GRACE + 10)
        assert not remover.is_alive()
        assert removal and removal[0].removed == (2,)  # type: ignore[attr-defined]
        assert removal[0].still_held == (2,)  # type: ignore[attr-defined]
        second.release()
        first.release()
        session = other.core.run(other.core.session())
        assert session.alive and session.quorum_slots.get(name) is True
    assert _exists(broker, [slot_queue(name, 2), slot_tombstone(name, 2)]) == [False, False]
    admin.destroy()
    assert _queues(node, name) == {}


def test_a_quorum_semaphore_made_before_markers_is_marked_and_buried(
    broker: Broker, name: str, node: devbroker.NodeInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quorum slots without a marker (made before it existed): a removal finds them by
    the 406 on re-declaring the top slot as classic, marks them, then buries."""
    args = {"x-max-length": 0, "x-queue-type": "quorum"}
    for k in (1, 2):
        on_session(
            broker, lambda s, k=k: s.declare(slot_queue(name, k), durable=True, arguments=args)
        )
    monkeypatch.setattr(burial, "BURY_GRACE", GRACE)
    client = PersistentSemaphore(broker, name)
    lease = client.acquire(timeout=5)
    assert lease is not None and lease.number == 1
    removal = SemaphoreAdmin(broker, name).remove_slots(1)  # quorum not given
    assert removal.removed == (2,)
    assert _queues(node, name) == {quorum_marker(name): "classic", slot_queue(name, 1): "quorum"}
    assert lease.verify() is True
    lease.release()
    SemaphoreAdmin(broker, name).destroy()
    assert _queues(node, name) == {}


def test_a_connection_that_saw_classic_slots_sees_quorum_ones_made_again(
    broker: Broker, amqp_url: str, name: str
) -> None:
    SemaphoreAdmin(broker, name).create(1)
    sem = PersistentSemaphore(broker, name)
    with sem.acquire(timeout=5):
        pass
    session = broker.core.run(broker.core.session())
    assert session.quorum_slots.get(name) is False
    with Broker(amqp_url) as admin_broker:
        SemaphoreAdmin(admin_broker, name).destroy()
        SemaphoreAdmin(admin_broker, name, quorum=True).create(1)
        with sem.acquire(timeout=5) as lease:
            assert session.quorum_slots.get(name) is True
            assert lease.verify() is True
        SemaphoreAdmin(admin_broker, name, quorum=True).destroy()


def test_every_cut_of_a_quorum_slot_removal_is_finished_by_the_next_action(
    broker: Broker,
    amqp_url: str,
    amqp_proxy: FaultProxy,
    name: str,
    node: devbroker.NodeInfo,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The admin is cut after each frame of ``remove_slots(1)`` on 3 quorum slots. With no
    operator: clients still get every slot the cut left (the buried one counts as removed)
    and keep their connections; the next administration action finishes the removal
    (remove) or takes it back (add), leaving no tombstone. Probes change nothing: they
    are no cut point (effects_only)."""
    monkeypatch.setattr(burial, "BURY_GRACE", 0.3)  # no client races a removal here
    monkeypatch.setattr(burial, "LOOK_FRESH", 0.1)
    url = amqp_url

    def setup(n: str) -> None:
        SemaphoreAdmin(broker, n, quorum=True).create(3)

    counted = f"{name}-count"
    setup(counted)
    with contextlib.closing(Broker(amqp_proxy.url(), heartbeat=5.0)) as b:
        b.core.run(b.core.session())
        amqp_proxy.count_frames(effects_only=True)
        SemaphoreAdmin(b, counted, quorum=True).remove_slots(1)
        frames = amqp_proxy.frames_sent
    SemaphoreAdmin(broker, counted, quorum=True).destroy()
    assert frames > 5
    states: set[tuple[bool, ...]] = set()  # (A[3] exists, T[3] exists) after each cut
    for n in range(1, frames + 1):
        lock = f"{name}-{n}"
        setup(lock)
        amqp_proxy.count_frames(effects_only=True)
        cut = Broker(amqp_proxy.url(), heartbeat=5.0)
        try:
            cut.core.run(cut.core.session())
            amqp_proxy.cut_after(n, effects_only=True)
            with contextlib.suppress(Exception):
                SemaphoreAdmin(cut, lock, quorum=True, mutex_timeout=5).remove_slots(1)
            completed = not amqp_proxy.fired
        finally:
            cut.close(timeout=1)
        # Passive declares: a probe of A[3] now could meet the cut delete (burial.py); a
        # passive declare never closes the connection (fencing.py: 0 of 40 on 3.10.8).
        states.add(
            tuple(
                on_session(broker, lambda s, q=q: s.exists_passive(q))
                for q in (slot_queue(lock, 3), slot_tombstone(lock, 3))
            )
        )
        with Broker(url) as client:
            sem = PersistentSemaphore(client, lock)
            held = [sem.acquire(timeout=5), sem.acquire(timeout=5), sem.acquire(blocking=False)]
            got = sorted(h.number for h in held if h is not None)
            assert got in ([1, 2], [1, 2, 3]), f"cut after frame {n}: slots {got}"
            for h in held:
                if h is not None:
                    h.release(wait=True)
            first = client.core.run(client.core.session())
            # The next action: even cuts add the slot back, odd ones remove down to one.
            admin = SemaphoreAdmin(broker, lock, quorum=True)
            c = admin.max_slots()
            if n % 2 == 0:
                want = 3
                if c < want:
                    admin.add_slots(want - c)
                third = [True, False]
            else:
                want = 1
                admin.remove_slots(c - want)
                third = [False, False]
            assert admin.max_slots() == want, f"cut after frame {n}"
            assert _exists(broker, [slot_queue(lock, 3), slot_tombstone(lock, 3)]) == third
            leases = [sem.acquire(timeout=5) for _ in range(want)]
            assert sorted(x.number for x in leases if x is not None) == list(range(1, want + 1))
            for x in leases:
                assert x is not None
                x.release(wait=True)
            assert client.core.run(client.core.session()) is first and first.alive
        admin.destroy()
        if completed:
            break
    # One rabbitmqctl for every cut's name (each call starts an Erlang VM: two per cut
    # made this test outlast its 300 s timeout beside three CPU burners).
    assert _queues(node, name) == {}
    # Untouched and done, and at least one state between (a cut frame is processed only
    # if the broker read it before the reset: the next test makes both by hand).
    assert {(True, False), (False, False)} < states, states


@pytest.mark.usefixtures("quick_burial")
@pytest.mark.parametrize("deleted", [False, True], ids=["buried", "deleted-before-tombstone"])
def test_a_removal_cut_between_its_steps_is_finished_or_taken_back(
    broker: Broker, name: str, node: devbroker.NodeInfo, deleted: bool
) -> None:
    """The two states a cut removal can leave, made by hand: slot 3 buried (its tombstone
    declared), and slot 3's queue deleted with its tombstone still there."""
    admin = SemaphoreAdmin(broker, name, quorum=True)
    tomb = slot_tombstone(name, 3)
    for action in ("add", "remove"):
        admin.create(3)
        on_session(broker, lambda s: s.declare(tomb, durable=True, arguments={"x-max-length": 0}))
        if deleted:
            on_session(broker, lambda s: s.delete(slot_queue(name, 3)))
        sem = PersistentSemaphore(broker, name)
        assert admin.max_slots() == 2
        leases = [sem.acquire(timeout=5), sem.acquire(timeout=5), sem.acquire(blocking=False)]
        assert sorted(x.number if x else 0 for x in leases) == [0, 1, 2]  # 0: not granted
        for x in leases:
            if x is not None:
                x.release(wait=True)
        if action == "add":
            assert admin.add_slots(1) == 3
            assert _exists(broker, [slot_queue(name, 3), tomb]) == [True, False]
            again = [sem.acquire(timeout=5) for _ in range(3)]
            assert sorted(x.number if x else 0 for x in again) == [1, 2, 3]
            for x in again:
                x.release(wait=True)  # type: ignore[union-attr]
        else:
            assert admin.remove_slots(1).removed == (2,)
            assert _exists(broker, [slot_queue(name, 3), tomb]) == [False, False]
        admin.destroy()
        assert _queues(node, name) == {}


def test_a_classic_create_takes_away_a_marker_a_cut_destroy_left(
    broker: Broker, name: str, node: devbroker.NodeInfo
) -> None:
    marker = quorum_marker(name)
    on_session(broker, lambda s: s.declare(marker, durable=True, arguments={"x-max-length": 0}))
    SemaphoreAdmin(broker, name).create(2)
    assert _queues(node, name) == {slot_queue(name, 1): "classic", slot_queue(name, 2): "classic"}
    with PersistentSemaphore(broker, name).acquire(timeout=5) as lease:  # type: ignore[union-attr]
        assert lease.verify() is True
    assert broker.core.run(broker.core.session()).quorum_slots.get(name) is False
    SemaphoreAdmin(broker, name).destroy()
    assert _queues(node, name) == {}
