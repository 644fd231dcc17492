"""Read-write lock protocol: waiting for reader tokens and the writer's turn, holding
them, giving them back (the package docstring tells the whole story)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConnectionLost, LeaseReleased, LockError, QueueNotFound
from ..fencing import take_token
from ..held import HeldState
from ..shape import READERS, WRITER, Expected
from ..shape import check as check_shape
from ..tokens import heal
from ..tokens.fresh import saw_running, until_running
from ..transport.broker import BrokerCore
from ..transport.channel_ops import consume_at, stop_and_give_back
from ..transport.errors import channel_error
from ..transport.session import Session
from ..transport.shield import close_quietly, shielded
from ..transport.wire import AbstractChannel, Basic, DeliveredMessage
from .admin import lock_arguments, read_shape, readers_queue, waiting_queue, writer_queue

log = logging.getLogger("amqp_locks.rwlock")

#: Consumer priorities on the reader-token queue: the writer holding the turn comes first.
READER_PRIORITY = 0
WRITER_PRIORITY = 1
#: How long a non-blocking acquire waits for tokens the broker reported free.
NONBLOCKING_GRACE = 1.0


async def _fence(core: BrokerCore, session: Session, fence: str) -> int:
    """The next value of the counter lock `fence` counts on (its shared fence shard,
    fencing.py; a missing shard is made on the way)."""
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
        #: The broker cancelled our consumer: the queue was deleted (destroyed, expired
        #: or replaced by a waiter that found it without its tokens: tokens/heal.py).
        self.deleted = False

    async def consume(self, priority: int) -> None:
        self.ch.on_consumer_cancel_callbacks.add(self._cancelled)
        self.ch.closing.add_done_callback(self._closed)
        try:
            await consume_at(
                self.ch, self.queue, self._deliver, priority=priority, consumer_tag=self.tag
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
            self.deleted = True
            self._end(f"the broker cancelled our consumer on {self.queue!r} (queue deleted?)")

    def replaced(self) -> None:
        """The queue was replaced while we waited and the broker told us nothing
        (transport/features.py, ``cancels_reach_holders``): end the wait as a cancel does,
        so that the acquire consumes again; closing the channel returns what the hollow
        consumer took. A holder is not ended here."""
        if not self.full.done():
            self.deleted = True
            self._end(f"{self.queue!r} was replaced while we waited")

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


def _ended(session: Session, name: str, exc: _Ended, *boxes: _Inbox | None) -> Exception:
    """Why waiting stopped, as a typed error: connection gone, or a queue deleted
    (QueueNotFound: the acquire makes it again, as on first use), or else."""
    if not session.alive:
        return ConnectionLost(f"connection lost while waiting for {name!r}: {session.lost_reason}")
    if any(box is not None and box.deleted for box in boxes):
        return QueueNotFound(f"read-write lock {name!r}: {exc} while we waited")
    return LockError(f"read-write lock {name!r}: {exc} while we waited")


# --- healing a lock that lost tokens at its creation (tokens/heal.py) ---------------------


def _plan(
    session: Session,
    queue: str,
    readers: bool,
    register: str | None,
    visible: Callable[[], Awaitable[heal.Sample | None]],
    delete: Callable[[], Awaitable[None]],
    box: _Inbox,
) -> heal.Plan:
    """A heal plan judging the readers (or writer) queue `queue`, whose stamp ends `box`'s
    wait when it changes under it (heal.Plan.on_replaced)."""

    async def stamp() -> int | None:
        return await heal.stamp_of_either(
            session, queue, lambda quorum: lock_arguments(session, quorum, readers)
        )

    return heal.Plan(queue, register, stamp, visible, delete, box.replaced)


async def _replace_both(session: Session, name: str) -> None:
    """Replace a readers queue: the writer queue first (its turn carries R, and must never
    outlive the readers queue it counted), then the readers queue; the next acquire
    makes both again."""
    await session.delete(writer_queue(name))
    await session.delete(readers_queue(name))


def reader_plan(session: Session, name: str, box: _Inbox) -> heal.Plan:
    """A reader waiting for a reader token. A writer with the turn holds any number of
    tokens on one consumer, so a reader judges only while nobody holds the turn."""
    readers, writer = readers_queue(name), writer_queue(name)

    async def visible() -> heal.Sample | None:
        if not await heal.turn_is_free(session, writer, waiting_queue(writer)):
            return None  # a writer may hold the turn, and reader tokens (or no answer)
        return await heal.visible_tokens(session, readers, waiting_queue(readers))

    async def delete() -> None:
        await _replace_both(session, name)

    return _plan(session, readers, True, waiting_queue(readers), visible, delete, box)


def turn_plan(session: Session, name: str, box: _Inbox) -> heal.Plan:
    """A writer waiting for the turn (one token in the writer queue)."""
    writer = writer_queue(name)

    async def visible() -> heal.Sample | None:
        return await heal.visible_tokens(session, writer, waiting_queue(writer))

    async def delete() -> None:
        await session.delete(writer)

    return _plan(session, writer, False, waiting_queue(writer), visible, delete, box)


def gather_plan(session: Session, name: str, tokens: _Inbox) -> heal.Plan:
    """The writer with the turn, gathering all R reader tokens on one consumer of its own
    (not registered: it counts what it holds itself)."""
    readers = readers_queue(name)

    async def visible() -> heal.Sample | None:
        return await heal.visible_tokens(
            session, readers, waiting_queue(readers), held=len(tokens.messages)
        )

    async def delete() -> None:
        await _replace_both(session, name)

    return _plan(session, readers, True, None, visible, delete, tokens)


def _watch(
    session: Session, plan: heal.Plan, box: _Inbox, nonblocking: bool
) -> asyncio.Task[None] | None:
    if nonblocking:
        return None
    return session.spawn(heal.watch(session, plan, box.full))


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
        # A quorum queue is not asked: it applies the return a Raft commit after the
        # close-ok (docs/operations.md, "Releasing and closing").
        try:
            await ch.close()
        except Exception as exc:
            return None if session.alive else f"the connection ended during it ({exc})"
        return None
    try:
        await stop_and_give_back(ch, box.tag, [_tag(m) for m in box.messages])
    except Exception as exc:
        session.spawn(close_quietly(ch))
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

    def quorum_queues(self) -> tuple[str, ...]:
        return tuple(box.queue for box in self.inboxes)

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
        if not self.begin_release():
            return
        session = self.session
        for box in self.inboxes:
            box.detach()
        if not session.alive:
            self.release_failure = f"the connection had ended ({session.lost_reason})"
            return
        if not self.shared:
            await close_quietly(self.inboxes[1].ch)
        self.release_failure = await _give_back(session, self.inboxes[0], self.confirm_wanted)
        log.debug("released %s of %r", "read" if self.shared else "write", self.name)

    def _what(self) -> str:
        return f"{'read' if self.shared else 'write'} hold of {self.name!r}"


# --- acquiring ----------------------------------------------------------------------------


async def _check_token(
    session: Session, name: str, message: DeliveredMessage, readers: bool, count: int | None
) -> None:
    """Refuse (LockShapeMismatch) a reader token or turn whose shape is not this lock's
    (shape.py): another kind, another R than `count`, or a lock delay too short."""
    queue = readers_queue(name) if readers else writer_queue(name)
    expected = Expected(
        frozenset({READERS if readers else WRITER}), count, f"read-write lock {name!r}"
    )
    await check_shape(
        session, queue, message, expected, lambda need: read_shape(session, name, readers, need)
    )


async def acquire_read(
    core: BrokerCore,
    name: str,
    *,
    deadline: float | None,
    nonblocking: bool,
    fence: str | None,
    readers: int | None = None,
    check_running: bool = False,
) -> HoldState | None:
    """One reader token (push). None at the deadline, or when not blocking and none is free.
    Raises QueueNotFound when the lock is not set up; LockShapeMismatch (the token given
    back) when the token says another lock than this one (`readers`: R, if given).
    `check_running`: quorum queues, which may be starting right now: each is seen
    running before we consume (fresh.until_running)."""
    session = await core.session()
    if nonblocking:
        if await session.declare_passive_count(readers_queue(name)) == 0:
            return None
        deadline = time.monotonic() + NONBLOCKING_GRACE
    elif check_running:
        await until_running(session, readers_queue(name))
    ch = await shielded(session.holder_channel(transactional=False), close_quietly)
    box = _Inbox(ch, readers_queue(name), 1)
    healer = None
    try:
        await shielded(box.consume(READER_PRIORITY), lambda _: close_quietly(ch))
        healer = _watch(session, reader_plan(session, name, box), box, nonblocking)
        try:
            got = await box.wait(deadline)
            # Withdraw our registration before we hold, or stop consuming.
            await heal.stop(healer, strict=got)
            if not got:
                await close_quietly(ch)  # returns a token that may be arriving right now
                return None
        except _Ended as exc:
            raise _ended(session, name, exc, box) from None
        await _check_token(session, name, box.messages[0], True, readers)
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
        session.spawn(close_quietly(ch))
        raise
    finally:
        await heal.stop(healer, strict=False)
    if check_running:
        saw_running(session, readers_queue(name))
    state.attach()
    return state


async def acquire_write(
    core: BrokerCore,
    name: str,
    *,
    deadline: float | None,
    nonblocking: bool,
    fence: str | None,
    readers: int | None = None,
    check_running: bool = False,
) -> HoldState | None:
    """The turn, then every reader token (push, ahead of the readers). None at the
    deadline, or when not blocking and a writer or reader holds. LockShapeMismatch
    (all given back) when the turn or a reader token says another lock: another R than
    `readers` (if given) or than the turn's, or a lock delay too short.
    `check_running`: as for :func:`acquire_read`, both queues."""
    session = await core.session()
    if nonblocking:
        if await session.declare_passive_count(writer_queue(name)) == 0:
            return None
        deadline = time.monotonic() + NONBLOCKING_GRACE
    elif check_running:
        await until_running(session, writer_queue(name))
        await until_running(session, readers_queue(name))
    # The tokens' channel (no prefetch limit) opens with the turn's: no extra round trip.
    turn_ch, tokens_ch = await shielded(_open_pair(session), _close_pair)
    channels = [turn_ch, tokens_ch]
    turn = _Inbox(turn_ch, writer_queue(name), 1)
    tokens: _Inbox | None = None
    healer = None
    try:
        await shielded(turn.consume(READER_PRIORITY), lambda _: close_quietly(turn_ch))
        healer = _watch(session, turn_plan(session, name, turn), turn, nonblocking)
        got = await turn.wait(deadline)
        await heal.stop(healer, strict=got)  # withdrawn before we hold the turn
        if not got:
            await _give_up(channels, turn, tokens)
            return None
        await _check_token(session, name, turn.messages[0], False, readers)
        readers = _token_id(turn.messages[0])
        if readers < 1:
            raise LockError(f"the writer's turn of {name!r} holds {turn.messages[0].body!r}")
        if nonblocking and await session.declare_passive_count(readers_queue(name)) < readers:
            await _give_up(channels, turn, tokens)  # a reader holds a token
            return None
        tokens = _Inbox(tokens_ch, readers_queue(name), readers)
        await shielded(tokens.consume(WRITER_PRIORITY), lambda _: close_quietly(tokens_ch))
        healer = _watch(session, gather_plan(session, name, tokens), tokens, nonblocking)
        got = await tokens.wait(deadline)
        await heal.stop(healer, strict=False)  # it never registered
        if not got:
            await _give_up(channels, turn, tokens)
            return None
        # A readers queue of another R than the turn's: R tokens would not exclude them all.
        for message in tokens.messages:
            await _check_token(session, name, message, True, readers)
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
        raise _ended(session, name, exc, turn, tokens) from None
    except BaseException:
        _abandon(session, channels, turn, tokens)
        raise
    finally:
        await heal.stop(healer, strict=False)
    if check_running:
        saw_running(session, writer_queue(name))
        saw_running(session, readers_queue(name))
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
                    session.spawn(close_quietly(ch))
            raise result
    turn_ch, tokens_ch = opened
    assert not isinstance(turn_ch, BaseException) and not isinstance(tokens_ch, BaseException)
    return turn_ch, tokens_ch


async def _close_pair(pair: tuple[AbstractChannel, AbstractChannel]) -> None:
    await close_quietly(pair[1])
    await close_quietly(pair[0])


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
