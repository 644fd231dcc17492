"""Read-write lock: many readers or one writer, on reader tokens and a writer's turn.

Lock `N` uses the queues of ``B = "N.rwlock"`` (docs/rwlock.md has the whole story):

- ``B-readers`` (durable): ``R`` reader tokens. A **reader** consumes it with prefetch 1
  and consumer priority 0 and holds one token unacknowledged, as a token-semaphore holder
  does: the broker hands a token back when the reader releases it, closes its channel or
  dies. So at most ``R`` readers hold at once.
- ``B-writer`` (durable): one **turn** token. A writer first takes the turn (prefetch 1),
  so writers never split the reader tokens between them, then consumes ``B-readers`` with
  no prefetch limit and consumer priority 1. The broker hands every token that is free, or
  becomes free, to that higher-priority consumer and none to the readers: once a writer
  waits, new readers wait behind it, and nobody polls. The writer holds the lock when it
  holds all ``R`` tokens: no reader does.
- A writer releases in two steps: closing the tokens' channel returns all ``R`` tokens
  (the broker answers close-ok once the queue has requeued them, and the readers waiting
  at that moment get them first); then it returns the turn to the next writer, who waits
  for those readers. Read and write phases alternate: neither side starves.
- ``B-ledger`` (durable) holds one record ``{"readers": R}``; the tokens, the turn and the
  record are published in one AMQP transaction by :func:`setup` under the administration
  mutex ``B`` (an exclusive queue), so the lock is either wholly set up or not at all.
  Acquires set a missing lock up themselves (``readers`` tokens, default 64).
- Fencing: every grant, read or write, takes the next value of one counter, the quorum
  queue ``B-fence`` (fencing.py), *after* it holds its tokens. A writer's token is above
  every token granted before it, a reader's above every earlier writer's.

The broker taking tokens back (queue deleted: consumer cancelled; channel closed, e.g. by
``consumer_timeout``; connection lost or silent) marks the hold lost at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp.commands import Basic

from .admin_mutex import held_mutex
from .errors import (
    ConfigurationError,
    ConnectionLost,
    InvalidName,
    LeaseReleased,
    LockError,
    QueueNotFound,
)
from .fencing import ensure_fence, take_token
from .holders import HolderQueries, Reading
from .lease import HeldState, Lease
from .lockobject import LockObject
from .names import MAX_QUEUE_NAME_BYTES, validate_name
from .records import LockStatus
from .replication import choose_quorum
from .transport.broker import BrokerCore, BrokerLike
from .transport.errors import channel_error
from .transport.features import broker_version, consumer_timeout_arguments, quorum_arguments
from .transport.session import Session
from .transport.shield import shielded
from .waiting import Backoff, check_timeout

log = logging.getLogger("amqp_locks.rwlock")

DEFAULT_READERS = 64
#: A write receives and returns every reader token: its cost grows with R.
MAX_READERS = 10_000
#: Consumer priorities on the reader-token queue: the writer holding the turn comes first.
READER_PRIORITY = 0
WRITER_PRIORITY = 1
#: How long a non-blocking acquire waits for tokens the broker reported free.
NONBLOCKING_GRACE = 1.0
#: How long a grant whose fence queue was deleted waits for the administration mutex.
FENCE_CREATE_TIMEOUT = 10.0


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


# --- setting the lock up ------------------------------------------------------------------


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
        await _close(ch)
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
            **(quorum_arguments(version) if quorum else {}),
            **consumer_timeout_arguments(version, quorum),
        }
        for queue in (readers_queue(name), writer_queue(name), ledger_queue(name)):
            await session.declare(queue, durable=True, arguments=args)
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
        await _close(ch)


async def _fence(core: BrokerCore, session: Session, fence: str) -> int:
    """The next value of the counter `fence`-fence; creates a missing fence queue under
    the mutex `fence` (the lock's admin mutex, or the lock whose counter we share)."""
    try:
        return await take_token(session, fence)
    except QueueNotFound:
        async with held_mutex(core, fence, FENCE_CREATE_TIMEOUT, Backoff()) as admin:
            await ensure_fence(admin.session, fence)
        return await take_token(session, fence)


# --- one consumer and its deliveries ------------------------------------------------------


class _Ended(Exception):
    """The broker ended a consumer before we had what we waited for."""


class _Inbox:
    """One consumer's deliveries, and the broker's ways of ending it: a consumer cancel
    (its queue was deleted) or the channel closing. Before the grant these fail the
    acquire; after it they call ``on_end`` (the hold's ``lose``)."""

    def __init__(self, ch: AbstractChannel, queue: str, want: int) -> None:
        self.ch = ch
        self.queue = queue
        self.want = want
        self.messages: list[DeliveredMessage] = []
        self.tag = f"amqp-locks-{uuid.uuid4().hex}"
        self.full: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.full.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        self.on_end: Callable[[str], None] | None = None
        self.ended: str | None = None

    async def consume(self, priority: int) -> None:
        self.ch.on_consumer_cancel_callbacks.add(self._cancelled)
        self.ch.closing.add_done_callback(self._closed)
        try:
            await self.ch.basic_consume(
                self.queue,
                self._deliver,
                no_ack=False,
                consumer_tag=self.tag,
                arguments={"x-priority": priority},
            )
        except Exception as exc:
            self.detach()
            raise channel_error(exc, self.queue) from exc

    async def _deliver(self, message: DeliveredMessage) -> None:
        self.messages.append(message)
        if len(self.messages) >= self.want and not self.full.done():
            self.full.set_result(None)

    async def wait(self, deadline: float | None) -> bool:
        """True once `want` deliveries arrived; False at the deadline."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(self.full), left)
        except TimeoutError:
            return False
        return True

    def _cancelled(self, frame: Basic.Cancel) -> None:
        if frame.consumer_tag == self.tag:
            self._end(f"the broker cancelled our consumer on {self.queue!r} (queue deleted?)")

    def _closed(self, fut: asyncio.Future[Any]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        self._end(f"channel consuming {self.queue!r} closed" + (f": {exc}" if exc else ""))

    def _end(self, reason: str) -> None:
        if self.ended is not None:
            return
        self.ended = reason
        if not self.full.done():
            self.full.set_exception(_Ended(reason))
        elif self.on_end is not None:
            self.on_end(reason)

    def detach(self) -> None:
        self.ch.on_consumer_cancel_callbacks.discard(self._cancelled)
        with contextlib.suppress(Exception):
            self.ch.closing.remove_done_callback(self._closed)


def _ended(session: Session, name: str, exc: _Ended) -> Exception:
    """Why waiting stopped, as a typed error: connection gone, or the lock destroyed."""
    if not session.alive:
        return ConnectionLost(f"connection lost while waiting for {name!r}: {session.lost_reason}")
    return LockError(f"read-write lock {name!r}: {exc} while we waited")


async def _close(ch: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        await ch.close()


async def _give_back(session: Session, box: _Inbox, confirm: bool = False) -> str | None:
    """Cancel the consumer (nothing comes back to us), then requeue what it holds; the
    channel goes back to the holder pool. If anything fails, closing it returns them.
    With `confirm` (release(wait=True)) the channel is closed instead and its close-ok is
    the broker's answer; returns why it could not be confirmed, if the connection failed."""
    ch = box.ch
    if confirm:
        # Closing with the consumer still on: the channel asks the queue to take back
        # what it holds and answers close-ok after it has. A reject and a round trip on
        # the channel are not enough: the queue may answer another client's passive
        # declare (prioritised in RabbitMQ's queue process) before it handles the reject.
        try:
            await ch.close()
        except Exception as exc:
            return None if session.alive else f"the connection ended during it ({exc})"
        return None
    try:
        await ch.basic_cancel(box.tag, nowait=True)
        for message in box.messages:
            await ch.basic_reject(_tag(message), requeue=True)
    except Exception as exc:
        session.spawn(_close(ch))
        return None if session.alive else f"the connection ended during it ({exc})"
    session.return_holder_channel(ch, transactional=False)
    return None


async def _no_undo(_: int) -> None:
    """A fencing token taken after a cancel costs nothing to keep."""


def _tag(message: DeliveredMessage) -> int:
    tag = getattr(message.delivery, "delivery_tag", None)
    assert isinstance(tag, int)
    return tag


def _token_id(message: DeliveredMessage) -> int:
    body = message.body.strip()
    return int(body) if body.isdigit() else 0


# --- the held state -----------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class HoldState(HeldState):
    """A read hold (one reader token) or a write hold (the turn and all R tokens), left
    unacked on our channels. ``number`` is the reader token's id, 0 for a write hold."""

    shared: bool
    #: Reader: [token]; writer: [turn, tokens] (the tokens' channel is ours alone).
    inboxes: list[_Inbox] = field(default_factory=list)

    def attach(self) -> None:
        """From now on the broker ending a consumer means the hold is lost."""
        self._listener = self.session.add_listener(self._on_session_lost)
        self.session.leases.add(self)
        for box in self.inboxes:
            box.on_end = self.lose
            if box.ended is not None:
                self.lose(box.ended)

    async def verify(self) -> bool:
        """Our channels and connection are alive and the lock's queues exist."""
        if self.released:
            raise LeaseReleased(f"{self._what()} was released")
        if self.lost_reason is not None or not self.session.alive:
            return False
        if any(box.ch.is_closed for box in self.inboxes):
            return False
        for box in self.inboxes:
            if not await self.session.exists_passive(box.queue):
                self.lose(f"{box.queue!r} no longer exists")
                return False
        return True

    async def release(self) -> None:
        """Reader: cancel and requeue its token (no round trip). Writer: close the tokens'
        channel, which returns all R tokens to the waiting readers first (close-ok), then
        hand the turn to the next writer."""
        if self.released:
            return
        self.released = True
        self._emit_release()
        session = self.session
        session.remove_listener(self._listener)
        session.leases.discard(self)
        for box in self.inboxes:
            box.detach()
        if not session.alive:
            self.release_failure = f"the connection had ended ({session.lost_reason})"
            return
        if not self.shared:
            await _close(self.inboxes[1].ch)
        self.release_failure = await _give_back(session, self.inboxes[0], self.confirm_wanted)
        log.debug("released %s of %r", "read" if self.shared else "write", self.name)

    def _what(self) -> str:
        return f"{'read' if self.shared else 'write'} hold of {self.name!r}"


# --- acquiring ----------------------------------------------------------------------------


async def acquire_read(
    core: BrokerCore, name: str, *, deadline: float | None, nonblocking: bool, fence: str | None
) -> HoldState | None:
    """One reader token (push). None at the deadline, or when not blocking and none is free.
    Raises QueueNotFound when the lock is not set up."""
    session = await core.session()
    if nonblocking:
        if await session.declare_passive_count(readers_queue(name)) == 0:
            return None
        deadline = time.monotonic() + NONBLOCKING_GRACE
    ch = await shielded(session.holder_channel(transactional=False), _close)
    box = _Inbox(ch, readers_queue(name), 1)
    try:
        await shielded(box.consume(READER_PRIORITY), lambda _: _close(ch))
        try:
            if not await box.wait(deadline):
                await _close(ch)  # returns a token that may be arriving right now
                return None
        except _Ended as exc:
            raise _ended(session, name, exc) from None
        token = 0 if fence is None else await shielded(_fence(core, session, fence), _no_undo)
        state = HoldState(
            core=core,
            session=session,
            kind="rwlock",
            name=name,
            number=_token_id(box.messages[0]),
            fencing_token=token,
            shared=True,
            inboxes=[box],
        )
    except BaseException:
        box.detach()
        session.spawn(_close(ch))
        raise
    state.attach()
    return state


async def acquire_write(
    core: BrokerCore, name: str, *, deadline: float | None, nonblocking: bool, fence: str | None
) -> HoldState | None:
    """The turn, then every reader token (push, ahead of the readers). None at the
    deadline, or when not blocking and a writer or reader holds."""
    session = await core.session()
    if nonblocking:
        if await session.declare_passive_count(writer_queue(name)) == 0:
            return None
        deadline = time.monotonic() + NONBLOCKING_GRACE
    # The tokens' channel (no prefetch limit) opens with the turn's: no extra round trip.
    turn_ch, tokens_ch = await shielded(_open_pair(session), _close_pair)
    channels = [turn_ch, tokens_ch]
    turn = _Inbox(turn_ch, writer_queue(name), 1)
    tokens: _Inbox | None = None
    try:
        await shielded(turn.consume(READER_PRIORITY), lambda _: _close(turn_ch))
        if not await turn.wait(deadline):
            await _give_up(channels, turn, tokens)
            return None
        readers = _token_id(turn.messages[0])
        if readers < 1:
            raise LockError(f"the writer's turn of {name!r} holds {turn.messages[0].body!r}")
        if nonblocking and await session.declare_passive_count(readers_queue(name)) < readers:
            await _give_up(channels, turn, tokens)  # a reader holds a token
            return None
        tokens = _Inbox(tokens_ch, readers_queue(name), readers)
        await shielded(tokens.consume(WRITER_PRIORITY), lambda _: _close(tokens_ch))
        if not await tokens.wait(deadline):
            await _give_up(channels, turn, tokens)
            return None
        token = 0 if fence is None else await shielded(_fence(core, session, fence), _no_undo)
        state = HoldState(
            core=core,
            session=session,
            kind="rwlock",
            name=name,
            number=0,
            fencing_token=token,
            shared=False,
            inboxes=[turn, tokens],
        )
    except _Ended as exc:
        _abandon(session, channels, turn, tokens)
        raise _ended(session, name, exc) from None
    except BaseException:
        _abandon(session, channels, turn, tokens)
        raise
    state.attach()
    return state


async def _open_pair(session: Session) -> tuple[AbstractChannel, AbstractChannel]:
    """A holder channel (prefetch 1) for the turn and a fresh one for the tokens."""
    opened = await asyncio.gather(
        session.holder_channel(transactional=False), session.open_channel(), return_exceptions=True
    )
    for result in opened:
        if isinstance(result, BaseException):
            for ch in opened:
                if not isinstance(ch, BaseException):
                    session.spawn(_close(ch))
            raise result
    turn_ch, tokens_ch = opened
    assert not isinstance(turn_ch, BaseException) and not isinstance(tokens_ch, BaseException)
    return turn_ch, tokens_ch


async def _close_pair(pair: tuple[AbstractChannel, AbstractChannel]) -> None:
    await _close(pair[1])
    await _close(pair[0])


def _abandon(
    session: Session, channels: list[AbstractChannel], turn: _Inbox, tokens: _Inbox | None
) -> None:
    """Give up on an error: closing the channels returns the tokens (first), then the turn."""
    turn.detach()
    if tokens is not None:
        tokens.detach()
    session.spawn(_close_pair((channels[0], channels[1])))


async def _give_up(channels: list[AbstractChannel], turn: _Inbox, tokens: _Inbox | None) -> None:
    """Not granted (timed out, or not blocking and a reader holds): return the tokens and
    the turn before saying so (close-ok comes after the queues took them back), so that
    nothing of ours still holds the lock when acquire returns None."""
    turn.detach()
    if tokens is not None:
        tokens.detach()
    await _close_pair((channels[0], channels[1]))


# --- the lock objects ---------------------------------------------------------------------


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


class _Half(LockObject):
    """The read or the write side of a :class:`ReadWriteLock`."""

    kind = "rwlock"
    #: A nested hold on one thread waits for itself once a writer queues up.
    reentrant_with = False
    shared: bool

    def __init__(self, rw: ReadWriteLock, blocking: bool, timeout: float | None) -> None:
        self.rw = rw
        self.broker = rw.broker
        self.name = rw.name
        self._init_wait(blocking, timeout)

    async def _wait(self, blocking: bool, timeout: float | None) -> HoldState | None:
        """Set a missing lock up; wait on a new connection when the old one dies."""
        timeout = check_timeout(timeout)
        nonblocking = not blocking or timeout == 0
        deadline = None if timeout is None else time.monotonic() + timeout
        acquire = acquire_read if self.shared else acquire_write
        set_up = retried = False
        while True:
            try:
                return await acquire(
                    self.rw._core,
                    self.name,
                    deadline=deadline,
                    nonblocking=nonblocking,
                    fence=self.rw.fence if self.rw.fencing else None,
                )
            except QueueNotFound:
                if set_up:
                    raise
                await self.rw._setup()
                set_up = True
            except ConnectionLost:
                expired = deadline is not None and time.monotonic() >= deadline
                if (nonblocking and retried) or expired:
                    raise
                retried = True

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Lease | None:
        """A read (or write) hold: a :class:`Lease`, or None when not blocking / timed out."""
        return super().acquire(blocking, timeout)

    def __repr__(self) -> str:
        return f"{self.rw!r}.{'read_lock' if self.shared else 'write_lock'}"


class ReadLock(_Half):
    """Shared hold: any number of readers (up to R at once), no writer."""

    shared = True


class WriteLock(_Half):
    """Exclusive hold: no reader, no other writer."""

    shared = False


class ReadWriteLock(HolderQueries):
    """A distributed read-write lock ``name``: ``read_lock`` and ``write_lock`` are lock
    objects (``acquire()``, ``with``) whose leases carry fencing tokens and loss reports.

    ``readers`` (R, default 64) is the number of reader tokens, used when the lock is set
    up (on first use, or by :meth:`setup`): at most R readers hold at once, and a write
    receives and returns R messages. ``quorum=True`` sets the queues up as quorum queues.
    ``fencing=False`` skips the fence round trip (``fencing_token`` is then 0).
    ``timeout`` / ``blocking`` are what ``with rw.read_lock:`` waits (default: for ever).
    ``locked()`` is true while anyone holds it (read or write); ``holders()`` lists a
    record per hold (a write hold's ``number`` is 0).
    """

    kind = "rwlock"

    @staticmethod
    async def _own_status(core: BrokerCore, name: str) -> Reading:
        reading = await read_rwlock(core, name)
        return reading or Reading(LockStatus(name, "rwlock", 0, 0, 0))  # not set up: free

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        readers: int | None = None,
        timeout: float | None = None,
        blocking: bool = True,
        quorum: bool | None = None,
        fencing: bool = True,
        mutex_timeout: float | None = 30.0,
    ) -> None:
        self.broker = broker
        self.name = check_name(name)
        self.readers = check_readers(readers)
        self.quorum = choose_quorum(broker, quorum, f"read-write lock {name!r}")
        self.fencing = bool(fencing)
        #: Whose fence queue (`<fence>-fence`) the grants count on: the lock's own. The
        #: tooz driver points it at the queue its earlier, mutex-based locks counted on.
        self.fence = base_name(self.name)
        self.mutex_timeout = check_timeout(mutex_timeout)
        self.read_lock = ReadLock(self, blocking, timeout)
        self.write_lock = WriteLock(self, blocking, timeout)

    @property
    def _core(self) -> BrokerCore:
        return self.broker._core

    async def _setup(self) -> int:
        return await setup(self._core, self.name, self.readers, self.quorum, self.mutex_timeout)

    def setup(self) -> int:
        """Create the lock's queues and tokens unless they exist (acquires do it on first
        use); returns R. Raises LockError if ``readers`` was given and differs."""
        return self._core.run(self._setup())

    async def _status(self) -> RWLockStatus | None:
        return await read_status(await self._core.session(), self.name)

    def status(self) -> RWLockStatus | None:
        """Reader tokens, free tokens, writer and waiters; None if not set up."""
        return self._core.run(self._status())

    async def _destroy(self) -> None:
        admin = held_mutex(self._core, base_name(self.name), self.mutex_timeout, Backoff())
        async with admin as m:
            for queue in (ledger_queue(self.name), readers_queue(self.name)):
                await m.session.delete(queue)
            await m.session.delete(writer_queue(self.name))

    def destroy(self) -> None:
        """Delete the lock's queues (holders are told: lost). The fence queue stays, so a
        lock set up again under this name keeps its fencing tokens rising."""
        self._core.run(self._destroy())

    def __repr__(self) -> str:
        return f"ReadWriteLock({self.name!r})"


__all__ = ["RWLockStatus", "ReadLock", "ReadWriteLock", "WriteLock"]
