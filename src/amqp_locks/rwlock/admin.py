"""Read-write lock administration: queue names, setup, status (the package docstring has
the protocol; protocol.py acquires and holds).

``B-ledger`` holds one record ``{"readers": R}``; :func:`setup` publishes the tokens, the
turn and the record in one AMQP transaction under the administration mutex ``B``, so the
lock is either wholly set up or not at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from pamqp.commands import Basic

from ..admin_mutex import held_mutex
from ..errors import ConfigurationError, InvalidName, LockError, QueueNotFound
from ..fencing import ensure_fence
from ..holders import Reading
from ..names import MAX_QUEUE_NAME_BYTES, validate_name
from ..records import LockStatus
from ..transport.broker import BrokerCore
from ..transport.errors import channel_error
from ..transport.features import (
    broker_version,
    consumer_timeout_arguments,
    lock_queue_arguments,
    min_lock_delay_ms,
)
from ..transport.session import Session
from ..transport.shield import close_quietly
from ..waiting import Backoff

log = logging.getLogger("amqp_locks.rwlock")

DEFAULT_READERS = 64
#: A write receives and returns every reader token: its cost grows with R.
MAX_READERS = 10_000


def base_name(name: str) -> str:
    """The prefix of every queue of read-write lock `name` (its administration mutex)."""
    return f"{name}.rwlock"


def readers_queue(name: str) -> str:
    return f"{base_name(name)}-readers"


def writer_queue(name: str) -> str:
    return f"{base_name(name)}-writer"


def ledger_queue(name: str) -> str:
    return f"{base_name(name)}-ledger"


#: The longest queue name of a read-write lock: its admin mutex's wake-up queue.
_LONGEST = ".rwlock-mutex-wakeups"


def check_name(name: str) -> str:
    """A lock name whose every read-write lock queue name fits in 255 bytes."""
    name = validate_name(name)
    most = MAX_QUEUE_NAME_BYTES - len(_LONGEST)
    if len(name.encode("utf-8")) > most:
        raise InvalidName(f"a read-write lock's name must be at most {most} bytes of UTF-8")
    return name


def check_readers(readers: int | None) -> int | None:
    if readers is None:
        return None
    if isinstance(readers, bool) or not isinstance(readers, int):
        raise ConfigurationError(f"readers must be an int, got {type(readers).__name__}")
    if not 1 <= readers <= MAX_READERS:
        raise ConfigurationError(f"readers must be within 1..{MAX_READERS}, got {readers}")
    return readers


async def read_ledger(session: Session, name: str) -> int | None:
    """R from the ledger record, or None when the lock is not set up (the record goes back:
    its channel is closed with the record unacked)."""
    ch = await session.open_channel()
    try:
        message = await ch.basic_get(ledger_queue(name), no_ack=False)
    except Exception as exc:
        err = channel_error(exc, ledger_queue(name))
        if isinstance(err, QueueNotFound):
            return None
        raise err from exc
    finally:
        await close_quietly(ch)
    if not isinstance(message.delivery, Basic.GetOk):
        return None
    return int(json.loads(message.body)["readers"])


async def setup(
    core: BrokerCore, name: str, readers: int | None, quorum: bool, mutex_timeout: float | None
) -> int:
    """Set lock `name` up with `readers` tokens unless it is (idempotent); returns R.
    Refuses an explicit `readers` that differs from the lock's."""
    async with held_mutex(core, base_name(name), mutex_timeout, Backoff()) as admin:
        session = admin.session
        version = broker_version(session)
        args = {
            **(lock_queue_arguments(session) if quorum else {}),
            **consumer_timeout_arguments(version, quorum),
        }
        for queue in (readers_queue(name), writer_queue(name)):
            await session.declare(
                queue, durable=True, arguments=args, min_delay_ms=min_lock_delay_ms(session)
            )
        await session.declare(ledger_queue(name), durable=True, arguments=args)
        have = await read_ledger(session, name)
        if have is not None:
            if readers is not None and readers != have:
                raise LockError(
                    f"read-write lock {name!r} has {have} reader tokens, not {readers}; "
                    "destroy() it to set it up with another count"
                )
            return have
        count = readers or DEFAULT_READERS
        await ensure_fence(session, base_name(name))
        await _publish_all(session, name, count)
        log.info("set up read-write lock %r with %d reader tokens", name, count)
        return count


async def _publish_all(session: Session, name: str, count: int) -> None:
    """The R tokens, the turn and the ledger record, in one transaction: all or nothing."""
    assert session.conn is not None
    ch = await session.conn.channel(publisher_confirms=False)  # tx and confirms exclude
    try:
        await ch.tx_select()

        def props(ident: str) -> Basic.Properties:
            return Basic.Properties(delivery_mode=2, message_id=ident, app_id="amqp-locks")

        for k in range(1, count + 1):
            await ch.basic_publish(
                str(k).encode(), routing_key=readers_queue(name), properties=props(f"{name}#r{k}")
            )
        await ch.basic_publish(
            str(count).encode(), routing_key=writer_queue(name), properties=props(f"{name}#w")
        )
        record = json.dumps({"readers": count}).encode()
        await ch.basic_publish(record, routing_key=ledger_queue(name), properties=props(name))
        await ch.tx_commit()
    finally:
        await close_quietly(ch)


@dataclass(frozen=True)
class RWLockStatus:
    """``readers``: R; ``free``: reader tokens ready in the queue; ``writer``: a writer
    has the turn (it holds, or waits for the readers to leave); ``writers_waiting``:
    writers waiting for the turn; ``consumers``: consumers of the reader tokens (readers
    holding or waiting, plus the writer with the turn)."""

    readers: int
    free: int
    writer: bool
    writers_waiting: int
    consumers: int

    @property
    def held(self) -> int:
        """Reader tokens out of the queue (all R while a writer holds)."""
        return self.readers - self.free


async def read_status(session: Session, name: str) -> RWLockStatus | None:
    """None when the lock is not set up; else one ledger read and two passive declares."""
    readers = await read_ledger(session, name)
    if readers is None:
        return None
    (free, consumers), (turns, writers) = await asyncio.gather(
        session.declare_passive_counts(readers_queue(name)),
        session.declare_passive_counts(writer_queue(name)),
    )
    writer = turns == 0
    return RWLockStatus(readers, free, writer, max(0, writers - int(writer)), consumers)


async def read_rwlock(core: BrokerCore, name: str) -> Reading | None:
    """The read-write lock `name` as a lock status (None: not set up)."""
    rw = await read_status(await core.session(), name)
    if rw is None:
        return None
    return Reading(
        LockStatus(
            name, "rwlock", rw.readers, rw.held, rw.free, (), rw.consumers, rw.writers_waiting
        )
    )
