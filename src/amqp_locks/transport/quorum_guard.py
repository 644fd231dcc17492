"""Cluster mode: a connection proves, again and again, that its node is on the majority side.

On a Khepri cluster (RabbitMQ 4.2+) a node cut off from the others keeps serving its
clients: their heartbeats flow, their channels answer, and a consumer there holding an
unacked quorum-queue message is **not** told when the majority side returns that message to
the queue and grants it again. Nothing on the minority connection changes. What does
change is that nothing commits there: a quorum queue needs a majority of its replicas, so a
publish with confirms to a quorum queue gets no confirm for the whole cut, whichever side
leads the queue (docs/cluster.md, measured on 4.3.6).

So every cluster-mode session runs a :class:`QuorumGuard`: it publishes a small probe with
publisher confirms to a quorum queue every `interval` seconds (several may be in flight)
and remembers when the newest *confirmed* probe was sent. A confirm proves that the node
was connected to a majority at some moment after that probe was sent, so a partition cannot
have begun before. When ``quorum_timeout`` passes without a fresher proof, the guard drops
the connection: every lock held through it is reported lost (``lease.lost``, ``on_lost``),
and waiters move on to another node. So a holder is told at most ``quorum_timeout`` (plus
one check step) after any cut.

Why that is before anyone else is granted the lock: on RabbitMQ 4.3+ every lock queue
carries ``x-consumer-disconnected-timeout = lock_delay``: the broker returns a token held
through a node it has lost only ``lock_delay`` after it notices the loss, which is never
before the cut. ``quorum_timeout <= lock_delay - MIN_MARGIN`` (checked when the Broker is
made) then orders the two whatever the nodes' ``net_ticktime`` and however fast the
majority hears of the cut (a silent drop, or a reset it hears at once). A process crash is
not delayed: the holder's channel closes and its token goes back at once. Lines without
the argument (3.10-4.2) re-grant as soon as the majority notices the node is gone: 0.75 x
``net_ticktime`` after a silent cut at the earliest (so the bound must stay below it:
:meth:`ClusterTiming.check_line`), and at once after a cut it hears of, which no client
bound can beat; a WARNING says so when such a broker is connected.

A session that has not had its first confirm yet counts from when it connected: any lock
granted through it was committed by a majority after that moment. Each held lock is also
checked on its own queue (:meth:`QuorumGuard._send_checks`), and a lock's grant or
answered check proves the node as a probe does: a holder whose locks answer is not dropped
while the probe queue elects a new leader.

The probes go over a second connection to the same node, the guard's own (its
:class:`Link` comes from `connect`): a channel the broker crashes on a quorum queue's leader
change (RabbitMQ 3.10.8 answers a publish whose enqueuer registration meets a restarting
leader with a channel crash, 541 INTERNAL_ERROR, which closes the whole connection) then
costs a probe and a reconnect, never the locks held through the session. The probe link
proves the same node's membership, which is all the guard needs to know.

The probe queue is one quorum queue per node URL, ``amqp-locks.quorum-guard.HOST:PORT``
(``x-max-length: 1``, dropping the older probe). It never expires: publishing does not
count as using a queue, so an ``x-expires`` queue would vanish under a long-lived guard,
and an unroutable publish is confirmed at once by any node, majority or not. For the same
reason probes are mandatory: a returned probe (the queue was deleted) proves nothing, and
the next probe declares the queue again. (Earlier versions used expiring queues named
``amqp-locks.quorum-probe.*``; they expire by themselves.) Its
leader is usually the node of the client that declared it first (RabbitMQ's ``client-local``
leader locator), so on the majority side a probe never waits for a leader across the cut.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aiormq.abc import AbstractChannel
from aiormq.exceptions import PublishError
from pamqp.commands import Basic

from ..errors import AccessRefused, BrokerUnreachable, ConfigurationError
from ..names import standalone_queue
from .absent import while_absent
from .aiormq_compat import close_reason, route_gets, send_together
from .errors import censor, channel_error
from .ports import Link
from .shield import close_quietly

T = TypeVar("T")
log = logging.getLogger("amqp_locks.cluster")
#: The line warnings already logged (once per process: every connection checks).
_warned: set[str] = set()

#: RabbitMQ's (Erlang's) default ``net_ticktime``, in seconds.
DEFAULT_NET_TICKTIME = 60.0
#: How long (seconds) the broker keeps a token held by a consumer on a lost node before it
#: grants it again (RabbitMQ 4.3+: the lock queues' ``x-consumer-disconnected-timeout``).
#: Consul's session ``lock-delay`` exists for the same reason (15 s there).
DEFAULT_LOCK_DELAY = 10.0
#: The guard's default bound, as a share of ``lock_delay``: half leaves the other half as
#: margin for a busy machine.
DEFAULT_SHARE = 0.5
#: The bound must stay this far (seconds) below the earliest re-grant it races.
MIN_MARGIN = 1.0
#: The longest lock delay accepted (an hour): beyond it a node's loss stops its locks longer
#: than any user would want, and a typo (ms for s) is caught.
MAX_LOCK_DELAY = 3600.0
#: Probes in flight at most (during a cut none is confirmed; sending more proves nothing).
MAX_IN_FLIGHT = 8
PROBE_PREFIX = "amqp-locks.quorum-guard."
#: Lock checks in flight at most per channel, and channels for them at most (see
#: :meth:`QuorumGuard._send_checks`). The broker runs a channel's ``basic.get`` one after
#: another, each waiting for its commit: a channel answers a few hundred a second on a
#: loaded machine (measured: 4 channels of 128 answered ~400/s on 4.3.6), so the checks
#: go on many channels with a short window each.
CHECK_WINDOW = 16
CHECK_CHANNELS = 64
#: A held lock is checked every this share of ``quorum_timeout`` (2.5 s by default): the
#: broker's cost is one Raft command per check, and an answer may take the other half.
CHECK_SHARE = 0.5
#: Checks sent per step: the held locks' share of the step, with headroom to catch up,
#: and never fewer than this many.
PACE_HEADROOM = 1.5
PACE_MIN = 64
#: A check unanswered for this share of the check period is sent again, on a channel
#: with nothing that old in flight. A queue's leader dying with a check in flight leaves
#: that check (and every later one on its channel: replies come in order) waiting for
#: the new leader's election, or for ever; a fresh check, sent once the old one is
#: overdue, is what the new leader answers. Measured: a 4.3.6 holder on a surviving node
#: was dropped 5.0 s after its queue's leader was killed on a loaded machine, while the
#: waiter beside it was served by the new leader.
RESEND_SHARE = 0.5
#: The first line with ``x-consumer-disconnected-timeout`` (the lock delay).
LOCK_DELAY_LINE = (4, 3)


@dataclass(frozen=True)
class ClusterTiming:
    """The numbers cluster-mode safety follows from (docs/cluster.md, "Why a holder is told
    first").

    ``lock_delay``: how long the broker keeps a token held through a lost node before it
    grants it again; set on every lock queue as ``x-consumer-disconnected-timeout``
    (RabbitMQ 4.3+). A process crash is not delayed (its channel closes: the token goes at
    once); a node's death or a partition is: failover then takes at least ``lock_delay``.
    ``quorum_timeout``: how long a connection may go without a quorum-confirmed probe before
    its locks are reported lost (default half of ``lock_delay``); at most ``lock_delay -
    MIN_MARGIN``, so a cut-off holder is told before the broker can re-grant its lock,
    whatever the nodes' ``net_ticktime`` and however the majority hears of the cut.
    ``net_ticktime``: the nodes' Erlang setting as the user gave it (None: not given, taken
    as RabbitMQ's 60 s). Only lines without the lock delay (3.10-4.2) rest on it: there the
    majority can re-grant 0.75 x ``net_ticktime`` after a silent cut, so the bound must stay
    below that too (checked when such a broker is connected: :meth:`check_line`).
    """

    net_ticktime: float | None = None
    quorum_timeout: float = DEFAULT_LOCK_DELAY * DEFAULT_SHARE
    lock_delay: float = DEFAULT_LOCK_DELAY

    @classmethod
    def of(
        cls,
        net_ticktime: float | None,
        quorum_timeout: float | None,
        lock_delay: float | None = None,
    ) -> ClusterTiming:
        """Validate the Broker's arguments (ConfigurationError naming the problem)."""
        tick = None if net_ticktime is None else float(net_ticktime)
        if tick is not None and not tick > 0:
            raise ConfigurationError(f"net_ticktime must be > 0 seconds, got {net_ticktime}")
        delay = DEFAULT_LOCK_DELAY if lock_delay is None else float(lock_delay)
        if not MIN_MARGIN < delay <= MAX_LOCK_DELAY:
            raise ConfigurationError(
                f"lock_delay must be > {MIN_MARGIN:g} and at most {MAX_LOCK_DELAY:g} seconds,"
                f" got {lock_delay}"
            )
        bound = delay * DEFAULT_SHARE if quorum_timeout is None else float(quorum_timeout)
        limit = delay - MIN_MARGIN
        if not 0 < bound <= limit:
            raise ConfigurationError(
                f"quorum_timeout must be > 0 and at most lock_delay - {MIN_MARGIN:g}"
                f" = {limit:g} s (lock_delay {delay:g} s), got {quorum_timeout}: a cut-off"
                " holder must learn it lost its lock before the broker can grant it again"
            )
        return cls(tick, bound, delay)

    @property
    def lock_delay_ms(self) -> int:
        """``x-consumer-disconnected-timeout`` of the lock queues (milliseconds)."""
        return round(self.lock_delay * 1000)

    @property
    def min_delay_ms(self) -> int:
        """The shortest lock delay an existing lock queue may have for this bound: a queue
        made with less (an earlier amqp-locks gave 1 s) could grant a cut-off holder's
        lock before the holder is told."""
        return round((self.quorum_timeout + MIN_MARGIN) * 1000)

    @property
    def assumed_ticktime(self) -> float:
        """``net_ticktime`` as given, else RabbitMQ's default."""
        return DEFAULT_NET_TICKTIME if self.net_ticktime is None else self.net_ticktime

    def check_line(self, version: tuple[int, int]) -> str | None:
        """On a line without the lock delay, what safety rests on (a WARNING for the log);
        ConfigurationError when the bound cannot be below the majority's earliest re-grant
        after a silent cut (0.75 x ``net_ticktime``)."""
        if version >= LOCK_DELAY_LINE:
            return None
        tick = self.assumed_ticktime
        limit = 0.75 * tick - MIN_MARGIN
        told = "given" if self.net_ticktime is not None else "assumed: RabbitMQ's default"
        if self.quorum_timeout > limit:
            raise ConfigurationError(
                f"RabbitMQ {version[0]}.{version[1]} cannot delay a lost node's token (the lock"
                f" delay needs 4.3): quorum_timeout {self.quorum_timeout:g} s must be at most"
                f" 0.75 x net_ticktime - {MIN_MARGIN:g} = {limit:g} s (net_ticktime {tick:g} s,"
                f" {told}), or the majority can grant a cut-off holder's lock before it is told"
            )
        floor = (self.quorum_timeout + MIN_MARGIN) / 0.75
        return (
            f"RabbitMQ {version[0]}.{version[1]} cannot delay the re-grant of a token held "
            "through a lost node (x-consumer-disconnected-timeout is 4.3+), so cluster-mode "
            "safety rests on the nodes' net_ticktime: a cut-off holder is told within "
            f"quorum_timeout {self.quorum_timeout:g} s, the majority can grant its lock "
            "0.75 x net_ticktime after a silent cut — safe only while every node runs "
            f"net_ticktime >= {floor:.1f} s ({tick:g} s {told}) — and at once after a cut it "
            "hears of (a reset link), which is not safe. Upgrade to RabbitMQ 4.3 for a "
            "guarantee that rests on numbers the library sets (docs/cluster.md)"
        )

    @property
    def check_period(self) -> float:
        """Seconds between two checks of one held lock (:data:`CHECK_SHARE` of the bound):
        an answer may then take the rest of the bound without a false loss, and the broker
        runs ``1 / check_period`` Raft commands per held lock per second."""
        return self.quorum_timeout * CHECK_SHARE

    @property
    def interval(self) -> float:
        """Seconds between probes: five per bound, at most every 2 s, at least every 0.2 s."""
        return min(2.0, max(0.2, self.quorum_timeout / 5))


def probe_queue(host: str | None, port: int | None) -> str:
    """The probe queue of the node at ``host:port`` (see the module docstring)."""
    return standalone_queue(f"{PROBE_PREFIX}{host or 'localhost'}:{port or 5672}")


class QuorumGuard:
    """Probes a quorum queue and drops the session when no probe is confirmed in time."""

    def __init__(
        self,
        session: Link,
        timing: ClusterTiming,
        drop: Callable[[str], None],
        connect: Callable[[], Awaitable[Link]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session = session
        self.timing = timing
        self._drop = drop
        #: Opens the guard's own connection to the session's node (the probe link).
        self._connect = connect
        self._link: Link | None = None
        self._clock = clock
        #: When the session connected: the proof until the first confirm (module docstring).
        self.since = clock()
        #: When the newest confirmed probe was sent (None: none yet).
        self.proven_at: float | None = None
        self.in_flight = 0
        self.sent = 0
        self.confirmed = 0
        #: Probes the broker returned (no probe queue): they prove nothing.
        self.returned = 0
        #: Per held lock queue: when the newest answered check (a ``basic.get``) was sent.
        self.lock_proofs: dict[str, float] = {}
        #: Per held lock queue: checks sent since its newest proof, and when the newest
        #: went (so a drop can say whether checks went unanswered or none could be sent).
        self._tries: dict[str, tuple[int, float]] = {}
        #: Lock queues with a check in flight, each with its newest send time (one at a
        #: time per queue until it is overdue, :data:`RESEND_SHARE`; a cut leaves them
        #: hanging, and the bound decides).
        self._in_flight: dict[str, float] = {}
        #: The channels that carry the checks, and the task writing this step's checks.
        self._pipes: list[_Pipe] = []
        self._sender: asyncio.Task[None] | None = None
        #: A check pipe being opened beside the writing (:meth:`_free_pipe`).
        self._pipe_opening: asyncio.Task[None] | None = None
        #: When the check writer now running began (see :meth:`_held_up`).
        self._sender_began = 0.0
        #: The run loop's late wake-ups (when, how late: seconds past its step), kept for
        #: a drop's reason: a starved I/O loop sends its checks late.
        self._late: collections.deque[tuple[float, float]] = collections.deque(maxlen=32)
        self._step = min(timing.interval, max(0.05, timing.quorum_timeout / 20))
        #: Checks answered, and tokens a check took while free (given back at once).
        self.checked = 0
        self.taken = 0
        #: The most checks in flight at once, and the slowest answer (seconds from the
        #: send): what the pipelining does, for tests and benchmarks/guard_scale.py.
        self.most_in_flight = 0
        self.slowest = 0.0
        self._queue = probe_queue(session.url.host, session.url.port)
        self._channel: AbstractChannel | None = None
        self._opening = asyncio.Lock()
        self._connecting = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing: asyncio.Task[None] | None = None

    @property
    def proof(self) -> float:
        """The moment up to which the node is known to have been on the majority side."""
        return self.since if self.proven_at is None else max(self.since, self.proven_at)

    def held(self) -> dict[str, float]:
        """The lock queues held through the session, each with its earliest grant."""
        held: dict[str, float] = {}
        for state in self.session.leases:
            if state.released or state.lost_reason is not None:
                continue
            for queue in state.quorum_queues():
                held[queue] = min(state.acquired_at, held.get(queue, state.acquired_at))
        return held

    def expired(self, now: float, held: dict[str, float] | None = None) -> str | None:
        """Why the session must be dropped at `now`, or None while the proof holds
        (`held`: :meth:`held`, when the caller has it)."""
        bound = self.timing.quorum_timeout
        # The node's proof: the newest probe confirm, or any held lock's newer proof (a
        # grant or an answered check is a majority commit too). So a holder whose locks
        # all answer is not dropped while the probe queue elects a new leader after its
        # leader's node died (the probes stall; the locks' own leaders answer).
        node_proof = self.proof
        for queue, granted in (self.held() if held is None else held).items():
            proven = max(granted, self.lock_proofs.get(queue, granted))
            node_proof = max(node_proof, proven)
            unproven = now - proven
            if unproven > bound:
                return (
                    f"no answer from the leader of lock queue {queue!r} to a check sent "
                    f"within the last {unproven:.1f} s (quorum_timeout {bound:g} s; "
                    f"{self._tried(queue, now, proven)}): this node may be cut off from it (a "
                    "partial partition, or the queue's majority on the other side), and "
                    f"the queue can grant our lock again {self.timing.lock_delay:g} s "
                    "(lock_delay) after it notices"
                )
        unproven = now - node_proof
        if unproven <= bound:
            return None
        return (
            f"no quorum-queue confirm for a probe sent within the last {unproven:.1f} s "
            f"(quorum_timeout {self.timing.quorum_timeout:g} s): this node may be cut off "
            "from the cluster's majority, which can grant our locks again "
            f"{self.timing.lock_delay:g} s (lock_delay) after it notices"
            f"{self._held_up(now)}"
        )

    def _tried(self, queue: str, now: float, proven: float) -> str:
        """What was tried for `queue` since its newest proof (at `proven`), for the drop's
        reason: how many checks, how late the newest went, and what held the guard up."""
        count, newest = self._tries.get(queue, (0, 0.0))
        due = proven + self.timing.check_period
        if count == 0:
            tried = (
                "no check was sent since its last proof: the probe link did not open, or "
                "the I/O loop was held up"
            )
        else:
            tried = (
                f"{count} check(s) sent since its last proof, the newest {now - newest:.1f} s"
                f" ago, {max(0.0, newest - due):.1f} s after it was due"
            )
        return tried + self._held_up(now)

    def _held_up(self, now: float) -> str:
        """What may have held the guard up within the last bound: its loop's worst late
        wake-up, a check writer still busy, and how many check channels are open."""
        since = now - self.timing.quorum_timeout
        late = max((how for at, how in self._late if at >= since), default=0.0)
        notes = []
        if late > 0:
            notes.append(f"its loop woke up to {late:.1f} s late")
        sender = self._sender
        if sender is not None and not sender.done():
            notes.append(f"its check writer busy for {now - self._sender_began:.1f} s")
        notes.append(f"{len(self._pipes)} check channel(s) open")
        return "; " + ", ".join(notes)

    def sending(self, queue: str, at: float) -> None:
        """A check of `queue` is being written at `at` (see :meth:`_tried`)."""
        count, _ = self._tries.get(queue, (0, at))
        self._tries[queue] = (count + 1, at)

    def confirm(self, sent_at: float) -> None:
        """A probe sent at `sent_at` was confirmed by the queue's quorum."""
        self.confirmed += 1
        if self.proven_at is None or sent_at > self.proven_at:
            self.proven_at = sent_at

    async def run(self) -> None:
        """Send probes and check the bound until the session ends (a session task)."""
        step = self._step
        next_probe = woke = self._clock()
        try:
            while self.session.alive:
                now = self._clock()
                if now - woke > 2 * step:  # asleep for one step, awake a step late or more
                    self._late.append((now, now - woke - step))
                woke = now
                held = self.held()
                reason = self.expired(now, held)
                if reason is not None:
                    log.warning("connection %r: %s", self.session.connection_name, reason)
                    self._drop(reason)
                    return
                if now >= next_probe:
                    next_probe = now + self.timing.interval
                    if self.in_flight < MAX_IN_FLIGHT:
                        self.spawn(self._probe(now))
                self._check_locks(now, held)
                await asyncio.sleep(step)
        finally:
            self.stop()

    def _check_locks(self, now: float, held: dict[str, float]) -> None:
        """Send the checks that are due, oldest proof first, at most a paced share of
        what is held this step (so a burst of grants spreads over the period and stays
        spread); forget the proofs of queues no longer held (the maps stay the size of
        what is held) and the checks of pipes that died or stalled past the bound (their
        queues are sent again)."""
        for per_queue in (self.lock_proofs, self._tries):
            for queue in [q for q in per_queue if q not in held]:
                del per_queue[queue]
        for pipe in [p for p in self._pipes if p.dead]:
            if pipe.fifo:
                log.debug(
                    "connection %r: lock check channel %d closed (%s) with %d check(s) "
                    "unanswered; they are sent again",
                    self.session.connection_name,
                    pipe.ch.number,
                    close_reason(pipe.ch),
                    len(pipe.fifo),
                )
            self._pipes.remove(pipe)
            pipe.forget(self._in_flight)
        for pipe in [p for p in self._pipes if p.stalled(now - self.timing.quorum_timeout)]:
            # Stuck past the bound: its checks can prove nothing more; free its place.
            log.debug(
                "connection %r: lock check channel %d unanswered for %.1f s (%d check(s)); "
                "closing it",
                self.session.connection_name,
                pipe.ch.number,
                now - pipe.fifo[0][1],
                len(pipe.fifo),
            )
            self._pipes.remove(pipe)
            pipe.forget(self._in_flight)
            self.spawn(close_quietly(pipe.ch))
        if self._sender is not None and not self._sender.done():
            return  # the last step's checks are still being written (a pipe opening)
        chosen = self.due(now, held)
        if not chosen:
            return
        self._sender_began = now
        self._sender = self.spawn(self._send_checks(chosen))

    def _overdue(self, now: float) -> float:
        """A check sent at or before this moment is overdue at `now` (:data:`RESEND_SHARE`)."""
        return now - self.timing.check_period * RESEND_SHARE

    def due(self, now: float, held: dict[str, float]) -> list[str]:
        """The held queues to check at `now`, oldest proof first: those whose proof is a
        check period old, with no check in flight or only an overdue one
        (:data:`RESEND_SHARE`), at most a paced share of what is held."""
        period = self.timing.check_period
        overdue = self._overdue(now)
        due = [
            (base, queue)
            for queue, granted in held.items()
            if self._in_flight.get(queue, -math.inf) <= overdue
            and (base := max(granted, self.lock_proofs.get(queue, granted))) + period <= now
        ]
        budget = max(PACE_MIN, math.ceil(len(held) * self._step / period * PACE_HEADROOM))
        return [queue for _, queue in heapq.nsmallest(budget, due)]

    async def _send_checks(self, queues: list[str]) -> None:
        """Proof per lock: a ``basic.get`` on the lock's own queue is a Raft command its
        leader answers only once a majority of the queue's replicas committed it, so an
        answer proves this node reached the queue's leader, with its majority, after the
        check was sent. Nothing else does in a partial partition (this node still commits
        to the probe queue through a third node while the lock queue's leader, cut off
        from us, gives our token away) or on a cluster larger than a queue's replica set.

        The checks are pipelined: up to :data:`CHECK_WINDOW` in flight per channel, on up
        to :data:`CHECK_CHANNELS` channels of the probe link (the broker runs each
        channel's ``basic.get`` one after another, so channels are what overlap its
        work), each proof dated by the moment its frame was queued for writing and
        credited when its own reply comes (replies come in order per channel)."""
        i = 0
        try:
            while i < len(queues):
                pipe = await self._free_pipe()
                if pipe is None:
                    return  # every window full: the rest wait for the next step
                batch = queues[i : i + CHECK_WINDOW - len(pipe.fifo)]
                i += len(batch)
                # Dated now, just before the frames are queued: a pipe opened above may
                # have taken a round trip, and the proof must not age by it.
                await pipe.send(batch, self._clock(), self._in_flight)
                self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no proof; the bound decides. A closed channel reopens.
            log.debug("lock checks on %r failed: %s", self.session.connection_name, exc)

    async def _free_pipe(self) -> _Pipe | None:
        """The open check pipe with the most room, or a new one while fewer than
        :data:`CHECK_CHANNELS` are open; None when every window is full. A pipe with an
        overdue check is stalled (a dead leader's queue holds up its replies) and takes
        no more."""
        overdue = self._overdue(self._clock())
        opened = [p for p in self._pipes if not p.dead]
        live = [p for p in opened if not p.stalled(overdue)]
        best = min(live, key=lambda p: len(p.fifo), default=None)
        room = len(opened) + (self._pipe_opening is not None) < CHECK_CHANNELS
        if best is not None and len(best.fifo) < CHECK_WINDOW:
            if len(best.fifo) >= CHECK_WINDOW // 2 and room and self._pipe_opening is None:
                # Half full: the next pipe opens beside the writing, which goes on here.
                self._pipe_opening = self.spawn(self._open_beside())
            return best
        if self._pipe_opening is not None:
            await asyncio.shield(self._pipe_opening)  # no room anywhere until it opens
            return await self._free_pipe()
        if not room:
            return None
        return await self._open_pipe()

    async def _open_pipe(self) -> _Pipe:
        """A new check pipe on the probe link."""
        link = await self._probe_link()
        pipe = _Pipe(self, await link.open_channel())
        self._pipes.append(pipe)
        return pipe

    async def _open_beside(self) -> None:
        """:meth:`_open_pipe` while the writer goes on (a failure: the writer opens one
        itself when it needs one)."""
        try:
            await self._open_pipe()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            name = self.session.connection_name
            log.debug("lock check channel on %r did not open: %s", name, exc)
        finally:
            self._pipe_opening = None

    def answered(self, queue: str, sent_at: float, tag: int | None) -> None:
        """A check of `queue` sent at `sent_at` was answered (`tag`: it took a free token,
        which its pipe gives back)."""
        if self._in_flight.get(queue) == sent_at:
            del self._in_flight[queue]
        self.slowest = max(self.slowest, self._clock() - sent_at)
        self.checked += 1
        if tag is not None:
            self.taken += 1
        self.lock_proofs[queue] = max(sent_at, self.lock_proofs.get(queue, sent_at))
        self._tries.pop(queue, None)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` as one of the guard's tasks (cancelled by :meth:`stop`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _probe(self, sent_at: float) -> None:
        self.in_flight += 1
        self.sent += 1
        try:
            ch = await self._probe_channel()
            await ch.basic_publish(
                b"",
                routing_key=self._queue,
                properties=Basic.Properties(delivery_mode=1),
                mandatory=True,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the bound decides; a broken link or channel is reopened
            log.debug("quorum probe on %r failed: %s", self.session.connection_name, exc)
            current = self._channel
            if isinstance(exc, PublishError) and current is not None:
                # Returned: the queue is gone. A new channel declares it again.
                self.returned += 1
                self._channel = None
                await close_quietly(current)
            elif current is not None and current.is_closed:
                self._channel = None
        else:
            self.confirm(sent_at)
        finally:
            self.in_flight -= 1

    async def prepare(self, timeout: float) -> None:
        """Open the probe channel and declare the probe queue, as part of connecting: a
        user without permission on it gets :class:`AccessRefused` naming it at once (the
        guard could never prove anything), and a node that cannot declare it in time (cut
        off from the majority) is reported unreachable, so the Broker tries the next one.
        A line without the lock delay gets its line checked (:meth:`ClusterTiming.check_line`):
        a WARNING once per process, or a ConfigurationError when the bound cannot be kept."""
        note = self.timing.check_line(self.session.version)
        if note is not None and note not in _warned:
            _warned.add(note)
            log.warning("%s", note)
        try:
            await asyncio.wait_for(self._probe_channel(), timeout)
        except TimeoutError:
            raise BrokerUnreachable(
                f"node {censor(self.session.url)} did not declare the quorum probe queue "
                f"{self._queue!r} within {timeout:g} s: it may be cut off from the "
                "cluster's majority"
            ) from None
        except AccessRefused as exc:
            raise AccessRefused(
                f"cluster mode needs configure and write permission on queue {self._queue!r}"
                f" (its quorum guard; docs/operations.md): {exc}"
            ) from None

    async def _probe_channel(self) -> AbstractChannel:
        """A confirm channel on the probe link (reconnected when it died), the probe queue
        declared on it (once per channel)."""
        async with self._opening:
            ch = self._channel
            link = self._link
            if ch is not None and not ch.is_closed and link is not None and link.alive:
                return ch

            async def attempt() -> AbstractChannel:
                link = await self._probe_link()
                ch = await link.open_channel()
                await self._declare(ch)  # every client's guard declares it: absent.py
                return ch

            ch = self._channel = await while_absent(self._queue, attempt)
            return ch

    async def _probe_link(self) -> Link:
        """The guard's own connection, opened again when it died (one opening at a time)."""
        async with self._connecting:
            link = self._link
            if link is None or not link.alive:
                self._link = None
                again, began = link is not None, self._clock()
                link = self._link = await self._connect()
                log.debug(
                    "connection %r: probe link %s in %.3f s",
                    self.session.connection_name,
                    "reopened" if again else "opened",
                    self._clock() - began,
                )
            return link

    async def _declare(self, ch: AbstractChannel) -> None:
        try:
            await self._declare_on(ch)
        except Exception as exc:
            raise channel_error(exc, self._queue) from exc

    async def _declare_on(self, ch: AbstractChannel) -> None:
        await ch.queue_declare(
            self._queue,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-max-length": 1,
                "x-overflow": "drop-head",
            },
        )

    def stop(self) -> None:
        """Stop probing and close the probe link (in the background; see :meth:`aclose`)."""
        for task in list(self._tasks):
            task.cancel()
        self._channel = None
        self._pipes.clear()
        self._in_flight.clear()
        link, self._link = self._link, None
        if link is not None:
            self._closing = asyncio.get_running_loop().create_task(_close_link(link))

    async def aclose(self, timeout: float = 5.0) -> None:
        """:meth:`stop`, then wait (up to `timeout`) for the probe link to close."""
        self.stop()
        closing = self._closing
        if closing is not None and not closing.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(closing), timeout)


async def _close_link(link: Link) -> None:
    with contextlib.suppress(Exception):
        await link.close()


class _Pipe:
    """One channel of the probe link carrying pipelined lock checks: the checks in flight
    in the order they were written, matched to the replies as they come."""

    def __init__(self, guard: QuorumGuard, ch: AbstractChannel) -> None:
        self.guard = guard
        self.ch = ch
        self.fifo: collections.deque[tuple[str, float]] = collections.deque()
        route_gets(ch, self._on_reply)

    @property
    def dead(self) -> bool:
        return self.ch.is_closed

    def stalled(self, overdue: float) -> bool:
        """Its oldest check in flight was sent at or before `overdue`."""
        return bool(self.fifo) and self.fifo[0][1] <= overdue

    async def send(self, queues: list[str], sent_at: float, in_flight: dict[str, float]) -> None:
        """Write one ``basic.get`` per queue, as one buffer (no reply awaited here)."""
        for queue in queues:
            self.fifo.append((queue, sent_at))
            in_flight[queue] = sent_at
            self.guard.sending(queue, sent_at)
        await send_together(self.ch, [Basic.Get(queue=q, no_ack=False) for q in queues])

    def forget(self, in_flight: dict[str, float]) -> None:
        """The channel died: its unanswered checks proved nothing and may be sent again."""
        for queue, sent_at in self.fifo:
            if in_flight.get(queue) == sent_at:
                del in_flight[queue]
        self.fifo.clear()

    def _on_reply(self, tag: int | None) -> None:
        if not self.fifo:
            log.debug("lock check reply with none in flight on %r", self.ch)
            return
        queue, sent_at = self.fifo.popleft()
        if tag is not None:  # a spare permit taken: back at once, first to the next consumer
            self.guard.spawn(self._give_back(tag))
        self.guard.answered(queue, sent_at, tag)

    async def _give_back(self, tag: int) -> None:
        with contextlib.suppress(Exception):
            await send_together(self.ch, [Basic.Reject(delivery_tag=tag, requeue=True)])
