"""Holder records (issue 14): who holds a lock, answered by the holders themselves."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from amqp_locks import (
    Broker,
    ConfigurationError,
    HolderRecord,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
    SemaphoreNotFound,
    TokenSemaphore,
    TokenSemaphoreNotFound,
    aio,
    lock_status,
)
from amqp_locks_dev import devbroker

from .permissions import restricted_brokers
from .spawn import freeze, spawn_held

HOST = socket.gethostname()
ME = os.getpid()
#: How long a read waits for holders whose records should be known. A holder binds its
#: record after the grant, in the background (transport/holders.py), so on a loaded machine
#: a record can lag its grant past the default second; a read returns as soon as every
#: expected holder has answered, so this costs nothing when they do.
READ = 10.0


def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll a broker-side condition (nothing pushes it to us) until it holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _lock(broker: Broker, kind: str, name: str) -> Any:
    return {"mutex": Mutex, "semaphore": PersistentSemaphore, "token": TokenSemaphore}[kind](
        broker, name
    )


def _create(broker: Broker, kind: str, name: str, count: int = 3) -> None:
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(count)
    elif kind == "token":
        TokenSemaphore(broker, name).setup(count)


@pytest.fixture
def reader(amqp_url: str) -> Iterator[Broker]:
    """A second connection: reads never go through the holder's own connection."""
    b = Broker(amqp_url)
    yield b
    b.close()


class Holder:
    """A process holding one lock (tests/workers.py), to kill, stop or let go."""

    def __init__(self, url: str, name: str, kind: str, holder_id: str | None = None) -> None:
        args = [url, name, kind] + ([holder_id] if holder_id else [])
        self.proc, numbers = spawn_held("tests.workers", *args)
        self.number, self.token = numbers[0], numbers[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def spawn(amqp_url: str) -> Iterator[Callable[..., Holder]]:
    started: list[Holder] = []

    def go(name: str, kind: str, holder_id: str | None = None) -> Holder:
        h = Holder(amqp_url, name, kind, holder_id)
        started.append(h)
        return h

    yield go
    for h in started:
        h.close()


# --- every kind: the record says who, and goes with the hold ------------------------------


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "token"])
def test_records_name_the_holder_and_go_with_the_release(
    amqp_url: str, broker: Broker, reader: Broker, name: str, kind: str
) -> None:
    _create(broker, kind, name)
    lock = _lock(reader, kind, name)
    assert lock.holders() == [] and lock.locked() is False
    with Broker(amqp_url, holder_id="worker-7") as holder:
        before = datetime.now(UTC)
        lease = _lock(holder, kind, name).acquire(timeout=10)
        after = datetime.now(UTC)
        assert lease is not None
        [rec] = lock.holders(timeout=READ)
        assert rec == HolderRecord(
            name, kind, lease.number, "worker-7", HOST, ME, rec.since, lease.fencing_token
        )
        assert rec.known and rec.since is not None
        assert before - timedelta(seconds=1) <= rec.since <= after + timedelta(seconds=1)
        assert lock.locked() is True
        lease.release()
        if kind == "token":  # release() returns before the broker's commit (docs/tokens.md)
            _until(lambda: not lock.locked())
        assert lock.holders() == []
        assert lock.locked() is False
        # Someone else takes it: the first holder's binding lingers, but it must not answer
        # for a lease it released.
        with Broker(amqp_url, holder_id="worker-8") as other:
            lease = _lock(other, kind, name).acquire(timeout=10)
            assert lease is not None
            assert [r.holder_id for r in lock.holders(timeout=READ)] == ["worker-8"]
            lease.release()


def test_a_lease_lost_on_a_live_connection_is_not_claimed(
    broker: Broker, reader: Broker, name: str
) -> None:
    """A removed slot stays taken by its holder queue (the seed's "largest limitation"),
    but the lease is lost: its holder must not answer for it any more."""
    admin = SemaphoreAdmin(reader, name)
    admin.create(2)
    first = PersistentSemaphore(broker, name).acquire()
    second = PersistentSemaphore(broker, name).acquire()
    assert first is not None and second is not None
    assert [r.number for r in PersistentSemaphore(reader, name).holders(timeout=READ)] == [1, 2]
    admin.remove_slots(1)
    assert second.lost.wait(10)
    got = PersistentSemaphore(reader, name).holders(timeout=READ)
    assert [(r.number, r.fencing_token) for r in got] == [(1, first.fencing_token)]


def test_mutex_holder_and_semaphore_holders_across_connections(
    amqp_url: str, reader: Broker, name: str
) -> None:
    SemaphoreAdmin(reader, name).create(3)
    with Broker(amqp_url, holder_id="a") as a, Broker(amqp_url, holder_id="b") as b:
        one = PersistentSemaphore(a, name).acquire()
        two = PersistentSemaphore(b, name).acquire()
        three = PersistentSemaphore(a, name).acquire()
        assert one and two and three
        got = PersistentSemaphore(reader, name).holders(timeout=READ)
        assert [(r.number, r.holder_id, r.fencing_token) for r in got] == [
            (one.number, "a", one.fencing_token),
            (two.number, "b", two.fencing_token),
            (three.number, "a", three.fencing_token),
        ]
        # The semaphore's own records are not its administration mutex's, and vice versa.
        assert Mutex(reader, name).holder() is None
        with Mutex(b, name) as m:
            rec = Mutex(reader, name).holder(timeout=READ)
            assert rec is not None and (rec.holder_id, rec.kind) == ("b", "mutex")
            assert rec.fencing_token == m.fencing_token
            assert len(PersistentSemaphore(reader, name).holders()) == 3


def test_default_holder_id_is_host_and_pid(broker: Broker, reader: Broker, name: str) -> None:
    assert broker.holder_id == f"{HOST}:{ME}"
    with Mutex(broker, name):
        rec = Mutex(reader, name).holder(timeout=READ)
        assert rec is not None and rec.holder_id == f"{HOST}:{ME}"
        assert rec.describe() == f"{HOST}:{ME}"
        # the holder's own connection can read it too (its I/O loop answers itself)
        assert Mutex(broker, name).holder(timeout=READ) == rec


def test_bad_holder_ids_are_refused(amqp_url: str) -> None:
    for bad in ("", " x", "a\nb", "x" * 129, "amqp://u:secret@host/"):
        with pytest.raises(ConfigurationError, match="holder_id") as info:
            Broker(amqp_url, holder_id=bad)
        assert "secret" not in str(info.value)
    assert Broker(amqp_url, holder_id="w" * 128).holder_id == "w" * 128


def test_missing_semaphores_raise(reader: Broker, name: str) -> None:
    with pytest.raises(SemaphoreNotFound):
        PersistentSemaphore(reader, name).holders()
    with pytest.raises(TokenSemaphoreNotFound):
        TokenSemaphore(reader, name).locked()
    assert Mutex(reader, name).locked() is False


# --- the holder goes away without cleaning up ----------------------------------------------


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "token"])
def test_record_of_a_killed_holder_vanishes(
    broker: Broker, reader: Broker, name: str, kind: str, spawn: Callable[..., Holder]
) -> None:
    _create(broker, kind, name, 1)
    held = spawn(name, kind, "doomed")
    lock = _lock(reader, kind, name)
    [rec] = lock.holders(timeout=READ)
    assert (rec.holder_id, rec.pid, rec.number, rec.fencing_token) == (
        "doomed",
        held.proc.pid,
        held.number,
        held.token,
    )
    os.kill(held.proc.pid, signal.SIGKILL)
    held.proc.wait(10)
    _until(lambda: not lock.locked())  # the broker frees it when the socket closes
    assert lock.holders() == []
    # and the next holder's record is the only one
    with _lock(broker, kind, name).acquire(timeout=10) as lease:
        assert [(r.holder_id, r.fencing_token) for r in lock.holders(timeout=READ)] == [
            (broker.holder_id, lease.fencing_token)
        ]


def test_a_frozen_holder_is_unknown_not_invented(
    broker: Broker, reader: Broker, name: str, spawn: Callable[..., Holder]
) -> None:
    SemaphoreAdmin(broker, name).create(2)
    frozen = spawn(name, "semaphore", "frozen")
    mine = PersistentSemaphore(broker, name).acquire()
    assert mine is not None
    # Both records bound before the freeze: the short read below is then late only for
    # the frozen holder, not for a bind of ours still in flight.
    assert all(r.known for r in PersistentSemaphore(reader, name).holders(timeout=READ))
    freeze(frozen.proc.pid)  # its connection lives on until heartbeats fail
    try:
        start = time.monotonic()
        got = PersistentSemaphore(reader, name).holders(timeout=0.5)
        assert time.monotonic() - start < 5
        assert got == [
            HolderRecord(name, "semaphore", frozen.number),  # held, holder unknown
            HolderRecord(
                name,
                "semaphore",
                mine.number,
                broker.holder_id,
                HOST,
                ME,
                got[1].since,
                mine.fencing_token,
            ),
        ]
        assert not got[0].known and got[0].pid is None and got[0].fencing_token is None
        [st] = lock_status(reader, name, ("semaphore",), records=True, timeout=0.3)
        assert st.records[0] == HolderRecord(name, "semaphore", frozen.number)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    # thawed, it answers again
    _until(lambda: PersistentSemaphore(reader, name).holders()[0].holder_id == "frozen")


def test_frozen_mutex_and_token_holders_are_unknown(
    broker: Broker, reader: Broker, name: str, spawn: Callable[..., Holder]
) -> None:
    TokenSemaphore(broker, f"{name}t").setup(2)
    m = spawn(name, "mutex")
    t = spawn(f"{name}t", "token")
    for h in (m, t):
        freeze(h.proc.pid)
    try:
        assert Mutex(reader, name).holder(timeout=0.3) == HolderRecord(name, "mutex", 1)
        assert TokenSemaphore(reader, f"{name}t").holders(timeout=0.3) == [
            HolderRecord(f"{name}t", "token", None)
        ]
        assert Mutex(reader, name).locked() is True
    finally:
        for h in (m, t):
            os.kill(h.proc.pid, signal.SIGCONT)


def _cut(broker: Broker) -> None:
    """Drop the connection under the Broker, as a network failure would: no release, no
    goodbye; the broker deletes its exclusive queues when the socket closes."""

    async def abort() -> None:
        session = await broker.core.session()
        assert session.transport_writer is not None
        session.transport_writer.transport.abort()

    broker.core.run(abort())


def test_connection_loss_ends_the_record_and_a_reconnected_holder_claims_nothing(
    amqp_url: str, reader: Broker, name: str
) -> None:
    SemaphoreAdmin(reader, name).create(2)
    with Broker(amqp_url, holder_id="flaky") as flaky, Broker(amqp_url, holder_id="next") as nxt:
        old = PersistentSemaphore(flaky, name).acquire()
        mutex = Mutex(flaky, f"{name}m").acquire()
        assert old is not None and mutex is not None
        got = PersistentSemaphore(reader, name).holders(timeout=READ)
        assert [r.holder_id for r in got] == ["flaky"]
        _cut(flaky)
        assert old.lost.wait(10) and mutex.lost.wait(10)
        _until(lambda: not PersistentSemaphore(reader, name).locked())
        assert Mutex(reader, f"{name}m").holder() is None
        # `next` takes the slot `flaky` lost; `flaky` reconnects and takes the other one.
        taken = PersistentSemaphore(nxt, name).acquire()
        again = PersistentSemaphore(flaky, name).acquire()
        assert taken is not None and again is not None
        assert taken.number == old.number != again.number
        read = PersistentSemaphore(reader, name).holders(timeout=READ)
        assert {r.number: r.holder_id for r in read} == {old.number: "next", again.number: "flaky"}


# --- readers -------------------------------------------------------------------------------


#: How long each concurrent read below waits for the holders' answers (s).
READ_TIMEOUT = 20.0


def test_concurrent_readers(amqp_url: str, broker: Broker, name: str) -> None:
    SemaphoreAdmin(broker, name).create(3)
    leases = [PersistentSemaphore(broker, name).acquire() for _ in range(3)]
    want = sorted((lease.number, lease.fencing_token) for lease in leases if lease)
    results: list[Any] = []
    with Broker(amqp_url) as shared:
        # holders() keeps its timeout (1 s by default) whatever the broker does: beside a
        # loaded rehearsal (load 17 on 2 cores) all 10 reads, 5 of them connecting first,
        # raised BrokerTimeout. The holders here answer at once; what is tested is that
        # concurrent reads each get every record, so they get time to.
        def read(b: Broker | None) -> None:
            try:
                if b is None:
                    with Broker(amqp_url) as own:
                        got = PersistentSemaphore(own, name).holders(timeout=READ_TIMEOUT)
                else:
                    got = PersistentSemaphore(b, name).holders(timeout=READ_TIMEOUT)
                results.append(sorted((r.number, r.fencing_token) for r in got if r.known))
            except Exception as exc:  # reported below
                results.append(exc)

        threads = [
            threading.Thread(target=read, args=(shared if i % 2 else None,)) for i in range(10)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert results == [want] * 10


def test_asyncio_twins(amqp_url: str, name: str) -> None:
    async def main() -> None:
        async with aio.Broker(amqp_url, holder_id="async-1") as b, aio.Broker(amqp_url) as r:
            assert await aio.Mutex(r, name).holder() is None
            async with aio.Mutex(b, name) as lease:
                rec = await aio.Mutex(r, name).holder(timeout=READ)
                assert rec is not None and rec.holder_id == "async-1"
                assert rec.fencing_token == lease.fencing_token
                assert await aio.Mutex(r, name).locked() is True
                [st] = await aio.lock_status(r, name, ("mutex",), records=True)
                assert st.records == (rec,)
            sem = aio.TokenSemaphore(b, f"{name}t")
            await sem.setup(1)
            async with sem as permit:
                [rec] = await aio.TokenSemaphore(r, f"{name}t").holders(timeout=READ)
                assert (rec.number, rec.holder_id) == (permit.number, "async-1")
            admin = aio.SemaphoreAdmin(b, f"{name}s")
            await admin.create(1)
            assert await aio.PersistentSemaphore(r, f"{name}s").locked() is False

    asyncio.run(main())


# --- permissions -----------------------------------------------------------------------------


def test_without_permission_on_the_exchange_locks_work_and_records_are_unknown(
    node: devbroker.NodeInfo, amqp_url: str
) -> None:
    """The permissions docs/operations.md gave before holder records: locks work, the
    holder logs once that records are off, a reader says it cannot ask."""
    names = (
        r"^((reindex)(-(sem|mutex)-(wakeups|watch))?"
        r"|amqp-locks-fence-[0-9]+(-g[0-9]+(-done)?)?)$"
    )
    with restricted_brokers(node, names) as (b, other):
        lease = Mutex(b, "reindex").acquire(timeout=5)
        assert lease is not None and lease.fencing_token >= 1
        [st] = lock_status(other, "reindex", ("mutex",), records=True, timeout=0.3)
        assert st.records == (HolderRecord("reindex", "mutex", 1),)
        assert st.records_note is not None
        assert "exchange" in st.records_note or "403" in st.records_note
        lease.release()


def test_documented_permissions_give_records(node: devbroker.NodeInfo) -> None:
    """docs/operations.md's set_permissions example, with the holder exchange and queues."""
    names = (
        r"^((images|reindex)(-[0-9]+-[AB]|-(sem|mutex)-(wakeups|watch))?"
        r"|amqp-locks-fence-[0-9]+(-g[0-9]+(-done)?)?|amqp-locks\.holder(s|\.[0-9a-f]{32}))$"
    )
    write = r"^(amq\.default|amqp-locks\.holder(s|\.[0-9a-f]{32}))$"
    with restricted_brokers(node, names, write, holder_id="ops") as (b, other):
        lease = Mutex(b, "reindex").acquire(timeout=5)
        assert lease is not None
        rec = Mutex(other, "reindex").holder()
        assert rec is not None and rec.holder_id == "ops"
        assert rec.fencing_token == lease.fencing_token
