"""TokenAdmin, the token semaphore's administration, used directly (sync facade)."""

from __future__ import annotations

import time

import pytest
from pamqp.commands import Basic

from amqp_locks import (
    AdminLockTimeout,
    Broker,
    ConfigurationError,
    InvalidName,
    LockError,
    Mutex,
    TokenAdmin,
    TokenSemaphore,
    TokenSemaphoreNotFound,
)
from amqp_locks.names import token_queue


def _wait_ready(admin: TokenAdmin, ready: int, limit: float = 20.0) -> None:
    """A release returns before the broker's commit (docs/tokens.md): poll until back."""
    deadline = time.monotonic() + limit
    while admin.status().ready != ready:
        assert time.monotonic() < deadline, admin.status()


def test_token_admin_administers_what_the_semaphore_acquires(broker: Broker, name: str) -> None:
    admin = TokenAdmin(broker, name)
    assert admin.setup(2) == 2
    assert admin.setup(2) == 2  # idempotent
    with pytest.raises(LockError, match="already has 2 permits"):
        admin.setup(3)
    sem = TokenSemaphore(broker, name)
    assert isinstance(sem.admin, TokenAdmin) and sem.admin.name == name
    lease = sem.acquire(timeout=5)
    assert lease is not None
    status = admin.status()
    assert (status.permits, status.held) == (2, 1)
    assert admin.add_permits(1) == [3]
    # Two ready tokens are taken at once; the held one is not taken from its holder.
    removed = admin.remove_permits(2, timeout=0.5)
    assert len(removed) == 2 and lease.number not in removed
    assert sem.status().permits == 1  # the facade's status is the admin's
    lease.release()
    _wait_ready(admin, 1)
    audit = admin.audit(timeout=5)
    assert audit.ok and audit.permits == 1 and audit.seen == (lease.number,)
    admin.destroy()
    with pytest.raises(TokenSemaphoreNotFound):
        admin.status()
    with pytest.raises(TokenSemaphoreNotFound):
        sem.acquire(blocking=False)


def test_token_admin_repairs_missing_and_surplus_tokens(broker: Broker, name: str) -> None:
    """A token acked by hand (the blog's "starving" case) is re-published; a duplicate and
    an unknown token are dropped. Nothing else in the suite exercised repair()."""
    admin = TokenAdmin(broker, name)
    admin.setup(3)

    async def tamper() -> int:
        session = await broker.core.session()
        ch = await session.open_channel()
        try:
            taken = await ch.basic_get(token_queue(name), no_ack=True)  # lost for good
            assert isinstance(taken.delivery, Basic.GetOk)
            for body in (b"9", b"1" if taken.body != b"1" else b"2"):
                await ch.basic_publish(body, routing_key=token_queue(name))
            return int(taken.body)
        finally:
            await ch.close()

    lost = broker.core.run(tamper())
    audit = admin.audit(timeout=5)
    assert audit.missing == (lost,)
    assert 9 in audit.surplus and len(audit.surplus) == 2
    repaired = admin.repair(timeout=5)
    assert repaired.missing == audit.missing and repaired.surplus == audit.surplus
    after = admin.audit(timeout=5)
    assert after.ok and after.seen == (1, 2, 3), after
    assert admin.status().ready == 3
    # The re-published token is a good one: it can be held like the others.
    sem = TokenSemaphore(broker, name)
    leases = [sem.acquire(timeout=5) for _ in range(3)]
    assert sorted(lease.number for lease in leases if lease is not None) == [1, 2, 3]
    for lease in leases:
        assert lease is not None
        lease.release()


def test_token_admin_waits_for_the_admin_mutex(amqp_url: str, broker: Broker, name: str) -> None:
    admin = TokenAdmin(broker, name, mutex_timeout=0.5)
    admin.setup(1)
    with Broker(amqp_url) as other, Mutex(other, name, timeout=5):
        with pytest.raises(AdminLockTimeout):
            admin.add_permits(1)
        assert admin.status().permits == 1  # status never takes the mutex
    assert admin.add_permits(1) == [2]


def test_token_admin_bad_input(broker: Broker, name: str) -> None:
    with pytest.raises(InvalidName):
        TokenAdmin(broker, f"{name}.rwlock")
    with pytest.raises(ConfigurationError):
        TokenAdmin(broker, name, mutex_timeout=-1)
    admin = TokenAdmin(broker, name)
    for call in (
        lambda: admin.setup(0),
        lambda: admin.add_permits(True),
        lambda: admin.remove_permits(1, timeout=-1),
    ):
        with pytest.raises(ConfigurationError):
            call()
    with pytest.raises(TokenSemaphoreNotFound, match="setup"):
        admin.add_permits(1)
    assert repr(admin) == f"TokenAdmin({name!r})"


def test_setup_behind_a_ledger_reader_never_doubles_the_permits(
    amqp_url: str, broker: Broker, name: str
) -> None:
    """A reader (status, locked) takes the ledger record off its queue for a moment; a
    setup that read right then once found no ledger and published a second set of tokens
    (found by the Celery integration). Hold the record as a reader does, on a raw
    connection, and hand it back while setup waits: still one permit."""
    import asyncio
    import threading

    import aiormq

    from amqp_locks.tokens.ledger import ledger_queue

    admin = TokenAdmin(broker, name)
    admin.setup(1)
    taken, give_back = threading.Event(), threading.Event()

    async def reader() -> None:
        conn = await aiormq.connect(amqp_url)
        ch = await conn.channel()
        got = await ch.basic_get(ledger_queue(name), no_ack=False)
        assert isinstance(got.delivery, Basic.GetOk)
        taken.set()
        await asyncio.get_running_loop().run_in_executor(None, give_back.wait)
        await conn.close()  # the record goes back, as a reader's channel close does

    t = threading.Thread(target=lambda: asyncio.run(reader()), daemon=True)
    t.start()
    assert taken.wait(10)
    timer = threading.Timer(0.5, give_back.set)
    timer.start()
    started = time.monotonic()
    assert admin.setup(1) == 1  # waited for the record instead of publishing again
    assert time.monotonic() - started >= 0.4
    t.join(10)
    _wait_ready(admin, 1)
    status = admin.status()
    assert (status.permits, status.ready) == (1, 1)
    assert admin.audit().ok
