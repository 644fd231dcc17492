"""Read-write lock administration: queue names, setup on first use, status (the package
docstring has the protocol; protocol.py acquires and holds).

A lock's queues cost the broker nothing once it is unused: ``B-writer`` and ``B-readers``
are declared with ``x-expires`` (60 s and 90 s: the writer queue, whose turn carries R,
never outlives the readers queue; RabbitMQ deletes a queue that long without a consumer,
a get or a declaration, with what it holds). Each is made, when an acquire finds
it missing, by a test-and-set (stamps.py): a declaration with a random ``x-max-length``
stamp and the queue's tokens in one write; the broker accepts one stamp and refuses (406)
every other, dropping the tokens behind it. The readers queue's stamp carries R, so any
reader of the lock learns R from its own refused declaration (and an explicit other R is
refused, naming both); the writer queue's turn carries R too. The two queues expire
apart (a lock only read leaves its writer queue unused): whichever is missing is made
again alone. No administration mutex: ``ReadWriteLock.destroy`` is the only user of ``B``.

Locks set up by an earlier release have a ledger ``B-ledger`` (``{"readers": R}``) and
queues that never expire; they are used as they are. A readers queue of the release
just before stamps carries R as its plain ``x-max-length``, which reads the same way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pamqp.commands import Basic

from ..errors import (
    ConfigurationError,
    InvalidName,
    LockError,
    PreconditionFailed,
    QueueNotFound,
)
from ..holders import Reading
from ..names import MAX_QUEUE_NAME_BYTES, validate_name
from ..records import LockStatus
from ..stamps import new_stamp, read_count
from ..transport import features
from ..transport.broker import BrokerCore
from ..transport.errors import channel_error
from ..transport.features import (
    broker_version,
    consumer_timeout_arguments,
    lock_queue_arguments,
    min_lock_delay_ms,
)
from ..transport.line_args import held_value, short_delay, short_delay_message
from ..transport.session import Session
from ..transport.shield import close_quietly

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


async def setup(core: BrokerCore, name: str, readers: int | None, quorum: bool) -> int:
    """Make what lock `name` misses (its readers queue with R tokens, its writer queue
    with the turn) unless it has them, without the administration mutex: each queue is
    made by a test-and-set (module docstring). Returns R; refuses an explicit `readers`
    that differs from the lock's. A lock of an earlier release keeps its ledger's R."""
    session = await core.session()
    legacy = await read_ledger(session, name)
    if legacy is not None:  # an earlier release's lock: it keeps its ledger
        if readers is not None and readers != legacy:
            raise _other_count(name, legacy, readers)
        return legacy
    count = await ensure_readers(session, name, readers, quorum)
    await ensure_writer(session, name, count, quorum)
    return count


async def first_use(
    core: BrokerCore, name: str, readers: int | None, quorum: bool, shared: bool
) -> int:
    """What an acquire that found a queue missing makes: a reader needs the readers queue
    only; a writer both (the turn carries R, which the readers queue says). Returns R."""
    session = await core.session()
    count = await ensure_readers(session, name, readers, quorum)
    if not shared:
        await ensure_writer(session, name, count, quorum)
    return count


async def ensure_readers(session: Session, name: str, readers: int | None, quorum: bool) -> int:
    """The readers queue with its R tokens, made by a test-and-set unless it exists;
    returns the lock's R (ours if we made it, else the one its stamp or ``x-max-length``
    says; an explicit `readers` that differs is refused)."""
    count = readers or DEFAULT_READERS
    args = {**_lock_arguments(session, quorum, True), "x-max-length": new_stamp(count)}
    tokens = [(str(k).encode(), _props(f"{name}#r{k}")) for k in range(1, count + 1)]
    try:
        await session.declare_and_publish(readers_queue(name), args, tokens)
    except PreconditionFailed as exc:
        held = _refused_by(exc, readers_queue(name), session)
        have = read_count(held) if held is not None and held >= 1 else None
        if have is None:  # declared with other arguments (another line's): read R
            have = await lock_readers(session, name)
        if readers is not None and have != readers:
            raise _other_count(name, have, readers) from None
        return have
    log.info("made read-write lock %r's readers queue (%d reader tokens)", name, count)
    return count


async def ensure_writer(session: Session, name: str, count: int, quorum: bool) -> None:
    """The writer queue with its turn (which carries R), made by a test-and-set unless it
    exists (then its turn is its own: held, ready, or with a writer)."""
    args = {**_lock_arguments(session, quorum, False), "x-max-length": new_stamp()}
    turn = [(str(count).encode(), _props(f"{name}#w"))]
    try:
        await session.declare_and_publish(writer_queue(name), args, turn)
    except PreconditionFailed as exc:
        _refused_by(exc, writer_queue(name), session)
        return
    log.info("made read-write lock %r's writer queue", name)


def _refused_by(exc: PreconditionFailed, queue: str, session: Session) -> int | None:
    """The queue's ``x-max-length`` when a test-and-set was refused because the queue
    exists (None: it differs from ours in another argument first). Re-raises any other
    refusal; refuses a queue whose lock delay is too short for this Broker."""
    text = str(exc)
    if "inequivalent arg" not in text:
        raise exc
    min_delay_ms = min_lock_delay_ms(session)
    short = short_delay(text, min_delay_ms)
    if short is not None:
        raise PreconditionFailed(short_delay_message(queue, short, min_delay_ms)) from exc
    return held_value(text, "x-max-length")


def _props(ident: str) -> Basic.Properties:
    return Basic.Properties(delivery_mode=2, message_id=ident, app_id="amqp-locks")


def _lock_arguments(session: Session, quorum: bool, readers: bool) -> dict[str, Any]:
    """A readers or writer queue's arguments but its ``x-max-length``: expiring, the
    readers queue half as late again as the writer queue. Why: the turn carries R, so a
    writer queue must never outlive its readers queue (a readers queue made again with
    another R beside an old turn would let a writer take fewer tokens than exist). A
    write hold uses both queues and lets go of the readers queue first, by milliseconds,
    and nothing else uses the writer queue, so the later expiry keeps the order."""
    expires = features.NAME_EXPIRES_MS * 3 // 2 if readers else features.NAME_EXPIRES_MS
    return {**_queue_arguments(session, quorum), "x-expires": expires}


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


async def lock_readers(session: Session, name: str) -> int:
    """R of a lock whose readers queue exists: the ledger's, else its ``x-max-length``
    (a stamp's count, or R itself for a lock of the previous release), read by a
    declaration the broker refuses whether the queue exists or not
    (`Session.held_max_length`): a read never makes a readers queue that expired
    meanwhile (raises QueueNotFound then)."""
    legacy = await read_ledger(session, name)
    if legacy is not None:
        return legacy
    for quorum in (session.cluster, not session.cluster):  # a lock of either type
        args = _lock_arguments(session, quorum, True)
        held = await session.held_max_length(readers_queue(name), args)
        if held is not None and held >= 1:
            return read_count(held)
    raise LockError(
        f"read-write lock {name!r}: its readers queue {readers_queue(name)!r} was declared "
        "with arguments this release does not make (destroy() it, or let it expire unused)"
    )


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
    try:
        readers = await lock_readers(session, name)
    except QueueNotFound:  # expired between the two reads
        return None
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
