"""Read-write lock administration: queue names, setup, status (the package docstring has
the protocol; protocol.py acquires and holds).

A lock's queues cost the broker nothing once it is unused: ``B-readers`` and ``B-writer``
are declared with ``x-expires`` (60 s; RabbitMQ deletes a queue that long without a
consumer, a get or a declaration, with what it holds). R lives with the reader tokens: the
readers queue is declared with ``x-max-length: R`` (a limit the R tokens never pass), so a
declaration with another R is refused by the broker (406), whose answer names the R the
lock has. The two queues expire apart (a lock only read leaves its writer queue unused):
:func:`setup`, run by an acquire that finds a queue missing, holds the administration
mutex ``B`` and makes again only what is missing. It publishes the R tokens when the
readers queue's declaration found it without tokens and consumers, and the turn when the
writer queue's did: a token is either ready or held by a consumer, and only setup under
the mutex publishes, so that snapshot proves there is none.

Locks set up by an earlier release have a ledger ``B-ledger`` (``{"readers": R}``) and
queues that never expire; they are used as they are.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pamqp.commands import Basic

from ..admin_mutex import held_mutex
from ..errors import (
    ConfigurationError,
    InvalidName,
    LockError,
    PreconditionFailed,
    QueueNotFound,
)
from ..fencing import ensure_fence
from ..holders import Reading
from ..names import MAX_QUEUE_NAME_BYTES, validate_name
from ..records import LockStatus
from ..transport import features
from ..transport.broker import BrokerCore
from ..transport.errors import channel_error
from ..transport.features import (
    broker_version,
    consumer_timeout_arguments,
    lock_queue_arguments,
    min_lock_delay_ms,
)
from ..transport.line_args import held_value
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
    """Make what lock `name` misses (its queues, its R tokens, its turn) unless it has them
    (idempotent; module docstring); returns R. Refuses an explicit `readers` that differs
    from the lock's."""
    async with held_mutex(core, base_name(name), mutex_timeout, Backoff()) as admin:
        session = admin.session
        legacy = await read_ledger(session, name)
        if legacy is not None:  # an earlier release's lock: it keeps its ledger
            if readers is not None and readers != legacy:
                raise _other_count(name, legacy, readers)
            return legacy
        args = {**_queue_arguments(session, quorum), "x-expires": features.NAME_EXPIRES_MS}
        count, (ready, consumers) = await _declare_readers(session, name, readers, args)
        turns, writers = await session.declare_counts(
            writer_queue(name),
            durable=True,
            arguments=args,
            min_delay_ms=min_lock_delay_ms(session),
        )
        tokens = ready == 0 and consumers == 0
        turn = turns == 0 and writers == 0
        if tokens or turn:
            await ensure_fence(session, base_name(name))
            await _publish(session, name, count, tokens=tokens, turn=turn)
            log.info(
                "set up read-write lock %r (%d reader tokens)%s",
                name,
                count,
                "" if tokens and turn else f": made again its {'tokens' if tokens else 'turn'}",
            )
        return count


def _queue_arguments(session: Session, quorum: bool) -> dict[str, Any]:
    version = broker_version(session)
    return {
        **(lock_queue_arguments(session) if quorum else {}),
        **consumer_timeout_arguments(version, quorum),
    }


def _other_count(name: str, have: int, wanted: int) -> LockError:
    return LockError(
        f"read-write lock {name!r} has {have} reader tokens, not {wanted}; destroy() it to "
        "set it up with another count (or let it expire unused)"
    )


async def _declare_readers(
    session: Session, name: str, readers: int | None, args: dict[str, Any]
) -> tuple[int, tuple[int, int]]:
    """Declare the readers queue with ``x-max-length: R``: (R, its counts). A lock with
    another R refuses the declaration (406) and names its own: an explicit `readers` that
    differs is refused, no `readers` takes the lock's."""
    count = readers or DEFAULT_READERS
    for _ in range(2):
        try:
            counts = await session.declare_counts(
                readers_queue(name),
                durable=True,
                arguments={**args, "x-max-length": count},
                min_delay_ms=min_lock_delay_ms(session),
            )
            return count, counts
        except PreconditionFailed as exc:
            have = held_value(str(exc), "x-max-length")
            if have is None or have < 1:
                raise
            if readers is not None:
                raise _other_count(name, have, readers) from None
            count = have
    raise LockError(f"read-write lock {name!r}: its reader count keeps changing")


async def lock_readers(session: Session, name: str) -> int:
    """R of a lock whose readers queue exists: the ledger's, else its ``x-max-length``,
    read by a declaration the broker refuses whether the queue exists or not
    (`Session.held_max_length`): a read never makes a readers queue that expired
    meanwhile (raises QueueNotFound then). A queue declared with other arguments (another
    line's) is read by a declaration with the default R, adapted to its arguments."""
    legacy = await read_ledger(session, name)
    if legacy is not None:
        return legacy
    for quorum in (session.cluster, not session.cluster):  # a lock of either type
        args = {**_queue_arguments(session, quorum), "x-expires": features.NAME_EXPIRES_MS}
        held = await session.held_max_length(readers_queue(name), args)
        if held is not None and held >= 1:
            return held
    for quorum in (session.cluster, not session.cluster):
        args = {**_queue_arguments(session, quorum), "x-expires": features.NAME_EXPIRES_MS}
        try:
            count, _ = await _declare_readers(session, name, None, args)
        except PreconditionFailed:
            if quorum != session.cluster:
                raise
            continue
        return count
    raise AssertionError("unreachable")  # pragma: no cover


async def _publish(session: Session, name: str, count: int, *, tokens: bool, turn: bool) -> None:
    """The R tokens and/or the turn, in one transaction: all or nothing."""
    assert session.conn is not None
    ch = await session.conn.channel(publisher_confirms=False)  # tx and confirms exclude
    try:
        await ch.tx_select()

        def props(ident: str) -> Basic.Properties:
            return Basic.Properties(delivery_mode=2, message_id=ident, app_id="amqp-locks")

        if tokens:
            for k in range(1, count + 1):
                await ch.basic_publish(
                    str(k).encode(),
                    routing_key=readers_queue(name),
                    properties=props(f"{name}#r{k}"),
                )
        if turn:
            await ch.basic_publish(
                str(count).encode(), routing_key=writer_queue(name), properties=props(f"{name}#w")
            )
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
    """None when the lock is not set up (or expired); else two passive declares and R
    (:func:`lock_readers`). A writer queue that expired reads as no writer."""
    try:
        free, consumers = await session.declare_passive_counts(readers_queue(name))
    except QueueNotFound:
        return None
    readers = await lock_readers(session, name)
    try:
        turns, writers = await session.declare_passive_counts(writer_queue(name))
    except QueueNotFound:
        turns, writers = 1, 0
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
