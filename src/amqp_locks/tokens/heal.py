"""Healing a first-use token queue that lost its tokens: its waiters notice, and replace it.

Why it is needed. A first-use queue is made by one write, a stamped declaration followed
by the publishes of its tokens (fresh.py). They are not atomic: a creator that dies, or
whose connection is cut, while the broker is still making the queue (a quorum
declaration takes 8-40 ms) leaves the queue without some or all of its tokens. Waiters
keep such a queue alive (``x-expires`` never fires while anyone consumes), so without
this module nobody would ever be granted the name again.

How a waiter tells a lost token from a held one. The broker reports two numbers for a
queue (a passive declare): its *ready* messages and its *consumers*. A holder keeps its
token unacked on a consumer of the queue; a waiter is a consumer too. So every waiter
that has waited :data:`REGISTER_AFTER` seconds also *registers*: it consumes from the
name's waiting queue (``names.token_waiting_queue``), which never holds a message. Then

    holders = consumers(token queue) - consumers(waiting queue)

and ``ready + holders`` is the number of tokens anybody can see. A waiter samples both
counts every :data:`SAMPLE_EVERY` seconds. While ``ready + holders`` stays below the
queue's permit count (read from its stamp, fresh.py) in every sample for
:func:`heal_after` seconds, some token exists nowhere a client can reach, and the waiter
deletes the queue; every waiter's consumer is cancelled, and the first use's usual
test-and-set makes the queue again with all its tokens (fresh.py), granted at once.

Why that is safe.
- A registered waiter leaves the waiting queue before it reports a grant (the holder
  leaves it once its token arrived, and the grant waits for that) and before it stops
  consuming the token queue (a timed-out waiter cancels its registration first), so
  holders are never under-counted for longer than one round trip; a waiter that has not
  registered yet counts as a holder (the count only errs upwards: healing waits longer).
  One sample that errs either way breaks the run: healing needs *every* sample for the
  whole period.
- Deleting, not re-publishing: a token that may still come back (held by a consumer on a
  node the majority lost, which RabbitMQ hands back later, after 4.3's lock delay, while
  still counting its consumer: benchmarks/split_counts.py) dies with the queue it belongs
  to, so there is never a second token. Its holder was told it lost the lock by its
  quorum guard after ``quorum_timeout`` (at most ``lock_delay - 1 s``; docs/cluster.md),
  before the period here (``lock_delay`` + :data:`HEAL_MARGIN`) ends, so it is told
  before anyone is granted the name again. Any other holder is a counted consumer: while
  its connection lives (also a frozen process, until the broker drops it for missed
  heartbeats) it is seen, and once it is gone its token is back in the queue, ready.
- Holders of the tokens that are left (K > 1) are told by the delete (their consumers are
  cancelled), except on RabbitMQ 3.x, which loses a quorum consumer's cancel when the
  queue is declared again at once (``features.cancels_reach_holders``): there a queue is
  replaced only in samples where nobody holds one of its tokens.
- A count that did not come from the queue's leader is never evidence. RabbitMQ answers
  a passive declare of a quorum queue with 0 ready and 0 consumers when the node cannot
  get the leader's answer within 250 ms (:data:`FAILED_STAT`), which is what a waiter on
  the far side of a partition from the queue's majority sees for as long as the cut
  lasts (its own quorum guard need not drop it: its node can still reach a majority of
  its probe queue and of the metadata store). A sample counts only when it counts our
  own consumer of the queue; a read-write lock's turn, which a reader does not consume,
  is proved by a ``basic.get`` only its majority can answer (:func:`turn_is_free`).
  Deleting such a queue from there would remove the replicas within reach and its
  record, and the next first use would make a second token.
- Two waiters healing in the same round trip: the second delete would take the queue the
  first one's creator just made, and its new holder is told at once (its consumer is
  cancelled: a loss, never a second holder). Each waiter adds up to :data:`HEAL_JITTER`
  seconds to its period, and stops as soon as the delete of another cancels its consumer.

Bound: a name whose creator died mid-creation grants again ``lock_delay`` (10 s by
default) + :data:`HEAL_MARGIN` + up to :data:`HEAL_JITTER` + :data:`SAMPLE_EVERY` seconds
after its first waiter registered (at most 15 s with the defaults; the first waiter of a
tokenless queue consumes, then registers, :data:`fresh.RUNNING_WAIT` after it arrived,
fresh.until_running), while its waiters keep waiting: a waiter whose connection is dropped
and who waits on, on the next one, keeps both clocks (``Session.carry_from``). The
waiting queue costs nothing once unused (:data:`WAITING_QUEUE`: auto-deleted with its
last consumer). It is a classic queue in cluster mode too: while the node that holds it
is down, its waiters cannot register and do not heal (a creator's death and that node's,
together), until the node is back.

What it does not cover: a queue made by an administrator (``TokenAdmin.setup``: a ledger,
no stamp) is repaired by ``TokenAdmin.repair``, as before; waiters that keep arriving and
leaving within :data:`REGISTER_AFTER` only delay healing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ConnectionLost, QueueNotFound
from ..names import token_queue, token_waiting_queue
from ..stamps import is_stamp, permits_of
from ..transport.channel_ops import take
from ..transport.exchanges import consume_on_own_channel
from ..transport.features import HELPER_EXPIRES_MS, cancels_reach_holders
from ..transport.session import Session
from ..transport.shield import close_quietly, shielded
from ..transport.wire import AbstractChannel
from .fresh import fresh_arguments

log = logging.getLogger("amqp_locks.tokens")

_T = TypeVar("_T")

#: Seconds a waiter waits for its token before it registers and starts sampling.
REGISTER_AFTER = 1.0
#: Seconds between two samples of one waiter (while few wait: :func:`sample_interval`).
SAMPLE_EVERY = 1.0
#: About how many samples a second all the waiters of one name take together.
SAMPLES_PER_SECOND = 4.0
#: Seconds added to the lock delay: the period every sample must show a missing token.
HEAL_MARGIN = 2.0
#: Up to this many seconds are added at random to each waiter's period.
HEAL_JITTER = 2.0
#: Seconds a granted waiter waits for the broker to confirm it left the waiting queue
#: (then it gives its token back), and a leaving one (then it leaves anyway): short, so
#: that ``acquire(timeout=T)`` answers within T + 1 s whatever the broker does.
WITHDRAW_TIMEOUT = 0.5
LEAVE_TIMEOUT = 0.25
#: A run of samples further apart than this (a waiter that went away and came back) starts
#: again: the evidence must be continuous.
MAX_GAP = 5.0
#: The longest one waiter waits between samples (well inside MAX_GAP, jitter included).
MAX_INTERVAL = 3.0


def heal_after(session: Session) -> float:
    """Seconds every sample must show a missing token before a waiter replaces the queue."""
    return session.timing.lock_delay + HEAL_MARGIN


def sample_interval(registered: int) -> float:
    """Seconds between one waiter's samples: :data:`SAMPLE_EVERY`, longer when many wait
    (the name's waiters together sample about :data:`SAMPLES_PER_SECOND` times a second:
    two passive declares each), never past :data:`MAX_INTERVAL` (a run breaks on gaps)."""
    return min(MAX_INTERVAL, max(SAMPLE_EVERY, registered / SAMPLES_PER_SECOND))


@dataclass
class _Run:
    """A run of samples that all showed a token missing from one queue."""

    since: float
    last: float
    jitter: float


#: The waiting queue: a classic queue in every mode (no Raft group per waited name: a
#: quorum queue costs 8-40 ms to make and 3 file handles while it exists), durable (4.x
#: refuses transient shared queues), deleted with its last consumer or unused.
WAITING_QUEUE: dict[str, Any] = {
    "durable": True,
    "auto_delete": True,
    "arguments": {"x-expires": HELPER_EXPIRES_MS},
}

#: (tokens anybody can see, live holders other than us, registered waiters) of one sample.
Sample = tuple[int, int, int]


@dataclass(frozen=True)
class Plan:
    """What one waiter watches: the queue whose tokens it judges, the waiting queue it
    registers on (None: it registers nowhere, e.g. a writer that holds the turn), the
    queue's stamp (fresh.py: its permit count and each creation's own; None: not a queue
    this module heals), how many tokens it can see now (None: it cannot judge now, which
    breaks the run), how to replace it, and what ends the wait when the queue was replaced
    under a waiter that got no cancel (``features.cancels_reach_holders``)."""

    queue: str
    register: str | None
    stamp: Callable[[], Awaitable[int | None]]
    visible: Callable[[], Awaitable[Sample | None]]
    delete: Callable[[], Awaitable[None]]
    on_replaced: Callable[[], None]


async def queue_counts(session: Session, queue: str, waiting: str) -> tuple[int, int, int]:
    """(ready messages, consumers, registered waiters) of `queue`, as the broker reports
    them (:data:`FAILED_STAT` is its stand-in for no answer). A missing waiting queue has
    no waiter (it goes with its last one)."""

    async def waiters() -> int:
        try:
            return (await session.declare_passive_counts(waiting))[1]
        except QueueNotFound:
            return 0

    (ready, consumers), registered = await asyncio.gather(
        session.declare_passive_counts(queue), waiters()
    )
    return ready, consumers, registered


#: What a passive declare of a quorum queue answers when the node it is sent to gets no
#: answer from the queue's leader: the leader is on a node it cannot reach (a partition),
#: or took more than 250 ms to answer (read in rabbitmq-server 3.10.8, 4.0.5 and 4.3.5:
#: ``rabbit_quorum_queue:stat`` turns a failed or timed-out ``rabbit_fifo_client:stat``
#: into ``{ok, 0, 0}``). No message ready and no consumer: the very picture of a queue
#: that lost its tokens. A sample never takes it at its word (:func:`visible_tokens`,
#: :func:`turn_is_free`): a waiter judging by it on a node cut off from the queue's
#: majority would delete a queue whose holder holds on the other side (a delete out of
#: reach of the leader removes the replicas it reaches and the queue's record, and the
#: next first use makes a new queue with a second token: two holders).
FAILED_STAT = (0, 0)

#: Seconds a sample waits for the leader of a queue it does not consume to answer a
#: ``basic.get`` (:func:`answers_empty`).
PROOF_TIMEOUT = 2.0


async def visible_tokens(
    session: Session, queue: str, waiting: str, held: int | None = None
) -> Sample | None:
    """(tokens of `queue` anybody can see, other holders, registered waiters): ready ones
    plus one per holder (a consumer not registered on `waiting`). We consume `queue`
    ourselves (a waiter; or, `held`, unregistered and holding that many of its tokens: a
    writer gathering reader tokens), so an answer that counts no consumer did not come
    from the queue's leader (:data:`FAILED_STAT`): None, this sample cannot judge."""
    ready, consumers, registered = await queue_counts(session, queue, waiting)
    if consumers == 0:
        log.debug(
            "%r answered %d ready and no consumer while we consume it: no answer from its "
            "leader; not judged",
            queue,
            ready,
        )
        return None
    unregistered = max(0, consumers - registered)
    if held is None:
        return ready + unregistered, unregistered, registered
    others = max(0, unregistered - 1)
    return ready + held + others, others, registered


async def answers_empty(session: Session, queue: str) -> bool:
    """Whether the leader of quorum queue `queue` answers, through its majority, that no
    message is ready: a ``basic.get`` is a Raft command its leader answers once a majority
    committed it (docs/cluster.md), so get-empty within :data:`PROOF_TIMEOUT` proves
    both. A message it hands us goes back when the channel closes (False); a channel
    still opening at the deadline is closed once open."""
    channels: list[AbstractChannel] = []

    async def get() -> bool:
        channels.append(await shielded(session.open_channel(), close_quietly))
        return await take(channels[0], queue) is None

    try:
        return await asyncio.wait_for(get(), PROOF_TIMEOUT)
    except Exception:  # no answer in time, a closed channel or connection: not proved
        return False
    finally:
        for ch in channels:
            session.spawn(close_quietly(ch))


async def turn_is_free(session: Session, queue: str, waiting: str) -> bool | None:
    """Whether nobody holds the one-token turn of `queue` (a read-write lock's writer
    queue: a writer holding it may hold any number of reader tokens on one consumer):
    True when it is ready, missing, or lost with only registered waiters on it; False
    when someone may hold it; None when the answer cannot be trusted. We do not consume
    `queue`, so :data:`FAILED_STAT` is either a turn lost with nobody waiting for it or
    no answer from its leader: :func:`answers_empty` tells them apart."""
    try:
        turns, consumers, registered = await queue_counts(session, queue, waiting)
    except QueueNotFound:
        return True
    if (turns, consumers) == FAILED_STAT:
        if await answers_empty(session, queue):
            return True
        log.debug(
            "%r answered no turn and no consumer, and no basic.get within %g s: no answer "
            "from its leader; not judged",
            queue,
            PROOF_TIMEOUT,
        )
        return None
    return turns > 0 or consumers <= registered


async def stamp_of(session: Session, queue: str, arguments: dict[str, Any]) -> int | None:
    """A first-use queue's stamp (fresh.py; read without changing anything); None for a
    queue not made on first use."""
    stamp = await session.held_max_length(queue, arguments)
    return stamp if stamp is not None and is_stamp(stamp) else None


async def stamp_of_either(
    session: Session, queue: str, arguments: Callable[[bool], dict[str, Any]]
) -> int | None:
    """:func:`stamp_of` a queue of either type (`arguments(quorum)`: its declaration)."""
    for quorum in session.queue_types:
        stamp = await stamp_of(session, queue, arguments(quorum))
        if stamp is not None:
            return stamp
    return None


def token_plan(session: Session, name: str, on_replaced: Callable[[], None]) -> Plan:
    """A waiter of the first-use token semaphore `name` (cluster mode's mutex included);
    `on_replaced` ends its wait as a cancel would (``features.cancels_reach_holders``)."""
    queue, waiting = token_queue(name), token_waiting_queue(name)

    async def stamp() -> int | None:
        return await stamp_of_either(session, queue, lambda q: fresh_arguments(session, 0, q))

    async def visible() -> Sample | None:
        return await visible_tokens(session, queue, waiting)

    async def delete() -> None:
        await session.delete(queue)

    return Plan(queue, waiting, stamp, visible, delete, on_replaced)


async def _register(session: Session, queue: str) -> AbstractChannel:
    """Consume from the waiting queue `queue` on a channel of our own (declared first;
    other waiters declare it at the same time: transport/absent.py)."""

    return await consume_on_own_channel(session, queue, **WAITING_QUEUE)  # never published to


async def _gone_is_none(queue: str, read: Awaitable[_T]) -> _T | None:
    """`read`'s answer, or None when the queue was deleted under it: a sample (or stamp
    check) that falls between a replacement's delete and its declaration (one round trip)
    judges nothing, and the watch goes on. Ending it there left a 3.x waiter waiting for
    ever: its consumer moved onto the new queue, hollow, and nobody read the new stamp
    (``features.cancels_reach_holders``; stop 63's CI, 3.10.8)."""
    try:
        return await read
    except QueueNotFound:
        log.debug("%r was not found (deleted; perhaps being made again): not judged", queue)
        return None


async def _first_stamp(plan: Plan, still_waiting: asyncio.Future[Any]) -> int | None:
    """The stamp of the queue we wait on, read once its queue answers (a replacement may
    be between its delete and its declaration: :func:`_gone_is_none`); None for a queue
    this module does not heal, or once the wait is over."""
    while not still_waiting.done():
        try:
            return await plan.stamp()
        except QueueNotFound:
            await asyncio.sleep(SAMPLE_EVERY * random.uniform(0.8, 1.2))
    return None


async def watch(session: Session, plan: Plan, still_waiting: asyncio.Future[Any]) -> None:
    """Run beside a waiter until cancelled: register, sample, and replace the queue once
    a token was missing in every sample for the whole period (module docstring).
    `still_waiting` is the waiter's delivery: once it is settled (a token, a cancel, a
    closed channel) this stops before deleting anything.

    The caller cancels it when the wait ends, and must await it (:func:`stop`): its
    registration is withdrawn (its channel closed) before the cancellation completes."""
    await asyncio.sleep(REGISTER_AFTER)
    stamp = await _first_stamp(plan, still_waiting)
    if stamp is None:
        return
    permits = permits_of(stamp)
    cancels = cancels_reach_holders(session)  # else a waiter checks the stamp
    ch = await _register(session, plan.register) if plan.register is not None else None
    try:
        # Kept on the session across acquire calls, so that a waiter retrying short
        # acquires (``acquire(timeout=5)`` in a loop) heals as well as a patient one, and
        # carried to the session that replaces a lost one (Session.carry_from).
        runs = session.heal_runs
        while not still_waiting.done():
            sample = await _gone_is_none(plan.queue, plan.visible())
            now = time.monotonic()
            run = runs.get(plan.queue)
            seen, holders, registered = sample if sample is not None else (permits, 0, 0)
            if not cancels and seen < permits:
                now_stamp = await _gone_is_none(plan.queue, plan.stamp())
                if now_stamp is not None and now_stamp != stamp:
                    log.warning(
                        "%r was replaced while we waited on it and no cancel came: "
                        "consuming it again (RabbitMQ 3.x moves such a consumer onto the "
                        "new queue, where it takes tokens it never hands on)",
                        plan.queue,
                    )
                    plan.on_replaced()
                    return
            if seen >= permits or (holders and not cancels):
                runs.pop(plan.queue, None)
            elif run is None or now - run.last > MAX_GAP:
                runs[plan.queue] = _Run(now, now, random.uniform(0.0, HEAL_JITTER))
            else:
                run.last = now
                if now - run.since >= heal_after(session) + run.jitter and not still_waiting.done():
                    runs.pop(plan.queue, None)
                    log.warning(
                        "%r showed %d of its %d token(s) in every sample for %.1f s: a "
                        "creator died mid-creation; replacing it so that the next user "
                        "makes it again with all its tokens",
                        plan.queue,
                        seen,
                        permits,
                        now - run.since,
                    )
                    await plan.delete()
                    # Our own consumer of it too: 3.x may move it onto the queue the next
                    # creator makes at once (cancels_reach_holders).
                    plan.on_replaced()
                    return
            await asyncio.sleep(sample_interval(registered) * random.uniform(0.8, 1.2))
    finally:
        # Withdraw the registration before the waiter goes on (a holder must not count
        # as a waiter): closing the channel cancels its consumer.
        if ch is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(ch.close())


async def stop(task: asyncio.Task[None] | None, *, strict: bool = True) -> None:
    """Cancel a :func:`watch` and wait until its registration is withdrawn (its
    channel's close-ok), at most :data:`WITHDRAW_TIMEOUT` (not `strict`:
    :data:`LEAVE_TIMEOUT`) seconds: a caller's timeout is kept when the broker stops
    answering. `strict`: raise ConnectionLost when the withdrawal was not confirmed in
    that time (a holder must not stay registered as a waiter: the caller gives the token
    back). A failure of the watch itself (the broker refused a declaration, the
    connection went) is logged: healing is best effort, the wait goes on or fails on its
    own."""
    if task is None:
        return
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=WITHDRAW_TIMEOUT if strict else LEAVE_TIMEOUT)
    if not done:
        if strict:
            raise ConnectionLost(
                f"the broker did not confirm within {WITHDRAW_TIMEOUT:g}s that this waiter "
                "left the waiting queue"
            )
        return
    exc = None if task.cancelled() else task.exception()
    if exc is not None:
        log.debug("healing watch of a token queue ended: %r", exc)
