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

from ..errors import (
    ConfigurationError,
    LockError,
    LockShapeMismatch,
    PreconditionFailed,
    QueueNotFound,
)
from ..holders import Reading
from ..names import rwlock_admin_name, rwlock_queue, token_message_id, validate_name
from ..records import LockStatus
from ..shape import READERS, WRITER, delay_refusal, forget, held_delay, shape_headers
from ..stamps import new_stamp, read_count
from ..transport import features
from ..transport.broker import BrokerCore
from ..transport.channel_ops import take
from ..transport.errors import channel_error
from ..transport.features import (
    broker_version,
    consumer_timeout_arguments,
    lock_queue_arguments,
    min_lock_delay_ms,
)
from ..transport.line_args import held_value, short_delay
from ..transport.refusals import inequivalent
from ..transport.session import Session
from ..transport.shield import close_quietly
from ..transport.wire import Basic

log = logging.getLogger("amqp_locks.rwlock")

DEFAULT_READERS = 64
#: A write receives and returns every reader token: its cost grows with R.
MAX_READERS = 10_000


def base_name(name: str) -> str:
    """The administration mutex of read-write lock `name` (``N.rwlock``, names.py)."""
    return rwlock_admin_name(name)


def readers_queue(name: str) -> str:
    return rwlock_queue(name, "readers")


def writer_queue(name: str) -> str:
    return rwlock_queue(name, "writer")


def ledger_queue(name: str) -> str:
    return rwlock_queue(name, "ledger")


def waiting_queue(queue: str) -> str:
    """The queue waiters of the readers or writer queue `queue` register on while they
    wait (it never holds a message; tokens/heal.py counts holders with it; names.py
    reserves its suffix)."""
    return f"{queue}-waiting"


def check_name(name: str) -> str:
    """A valid lock name (names.py maps any to queue names that fit)."""
    return validate_name(name)


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
        message = await take(ch, ledger_queue(name))
    except Exception as exc:
        err = channel_error(exc, ledger_queue(name))
        if isinstance(err, QueueNotFound):
            return None
        raise err from exc
    finally:
        await close_quietly(ch)
    if message is None:
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
    forget(session, readers_queue(name), writer_queue(name))  # found missing: stale
    count = await ensure_readers(session, name, readers, quorum)
    if not shared:
        await ensure_writer(session, name, count, quorum)
    return count


async def ensure_readers(session: Session, name: str, readers: int | None, quorum: bool) -> int:
    """The readers queue with its R tokens, made by a test-and-set unless it exists;
    returns the lock's R (ours if we made it, else the one its stamp or ``x-max-length``
    says; an explicit `readers` that differs is refused)."""
    count = readers or DEFAULT_READERS
    base = lock_arguments(session, quorum, True)
    args = {**base, "x-max-length": new_stamp(count)}
    shape = shape_headers(READERS, count, args)
    tokens = [
        (str(k).encode(), _props(token_message_id(name, f"r{k}"), shape))
        for k in range(1, count + 1)
    ]
    try:
        await session.declare_and_publish(readers_queue(name), args, tokens)
    except PreconditionFailed as exc:
        held = _refused_by(exc, readers_queue(name), session)
        have = read_count(held) if held is not None and held >= 1 else None
        if have is None:  # declared with other arguments (another line's): read R
            have = await lock_readers(session, name)
        if readers is not None and have != readers:
            raise _other_count(name, have, readers) from None
        await _check_delay(session, name, readers_queue(name), base, held)
        return have
    log.info("made read-write lock %r's readers queue (%d reader tokens)", name, count)
    return count


async def ensure_writer(session: Session, name: str, count: int, quorum: bool) -> None:
    """The writer queue with its turn (which carries R), made by a test-and-set unless it
    exists (then its turn is its own: held, ready, or with a writer)."""
    base = lock_arguments(session, quorum, False)
    args = {**base, "x-max-length": new_stamp()}
    turn = [
        (
            str(count).encode(),
            _props(token_message_id(name, "w"), shape_headers(WRITER, count, args)),
        )
    ]
    try:
        await session.declare_and_publish(writer_queue(name), args, turn)
    except PreconditionFailed as exc:
        held = _refused_by(exc, writer_queue(name), session)
        await _check_delay(session, name, writer_queue(name), base, held)
        return
    log.info("made read-write lock %r's writer queue", name)


def _refused_by(exc: PreconditionFailed, queue: str, session: Session) -> int | None:
    """The queue's ``x-max-length`` when a test-and-set was refused because the queue
    exists (None: it differs from ours in another argument first). Re-raises any other
    refusal; refuses a queue whose lock delay is too short for this Broker."""
    if inequivalent(exc) is None:
        raise exc
    min_delay_ms = min_lock_delay_ms(session)
    short = short_delay(exc, min_delay_ms)
    if short is not None:
        raise delay_refusal(queue, short, f"this client of {queue!r}", min_delay_ms) from exc
    return held_value(exc, "x-max-length")


async def _check_delay(
    session: Session, name: str, queue: str, base: dict[str, Any], held: int | None
) -> None:
    """Refuse a queue found with a lock delay shorter than this client needs: the 406
    that told us it exists named its ``x-max-length`` (`held`), compared before the
    delay, which is read by a declaration the broker refuses either way (shape.py)."""
    need = min_lock_delay_ms(session)
    if need <= 0 or held is None:
        return
    delay = await held_delay(session, queue, {**base, "x-max-length": held})
    if delay is not None and delay < need:
        raise delay_refusal(queue, delay, f"read-write lock {name!r}", need)


async def read_shape(
    session: Session, name: str, readers: bool, need_delay: bool
) -> tuple[int | None, int | None]:
    """(R, lock delay ms) of lock `name`'s readers (or writer) queue, from its arguments:
    what a token of an earlier release, which says no shape, is checked against."""
    queue = readers_queue(name) if readers else writer_queue(name)
    try:
        count: int | None = await lock_readers(session, name)
    except (QueueNotFound, LockError):  # gone (our consumer is cancelled), or not ours
        count = None
    delay = None
    for quorum in session.queue_types if need_delay else ():
        args = lock_arguments(session, quorum, readers)
        try:
            held = await session.held_max_length(queue, args)
        except QueueNotFound:
            break
        if held is not None:
            delay = await held_delay(session, queue, {**args, "x-max-length": held})
            break
    return count, delay


def _props(ident: str, headers: dict[str, Any]) -> Basic.Properties:
    return Basic.Properties(delivery_mode=2, message_id=ident, app_id="amqp-locks", headers=headers)


def lock_arguments(session: Session, quorum: bool, readers: bool) -> dict[str, Any]:
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


def _other_count(name: str, have: int, wanted: int) -> LockShapeMismatch:
    return LockShapeMismatch(
        f"read-write lock {name!r} has {have} reader tokens, not {wanted}; destroy() it to "
        "set it up with another count (or let it expire unused)",
        readers_queue(name),
        held=have,
        wanted=wanted,
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
    for quorum in session.queue_types:  # a lock of either type
        args = lock_arguments(session, quorum, True)
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
