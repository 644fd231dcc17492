"""Fencing tokens that never go back: generations of a shared counter per fence shard.

**What a token is.** Every lock `N` counts on fence shard ``k = crc32(N) % 16``. A shard's
counter lives in *generation* queues ``amqp-locks-fence-KK-g<G>`` (durable quorum, one
message each); the shard's *marker* ``amqp-locks-fence-KK`` says the counter was ever made
and holds the newest generation numbers as hints. A take reads the message's return count
(``x-delivery-count`` up to 4.2, ``x-acquired-count`` from 4.3: a quorum queue raises it on
every return and keeps it in its replicated log) and returns the message at once; the token
is ``FLOOR + G*SPAN + count + 1``. FLOOR = 2**52 is above every token of the clock-based
shards this design replaces (71753d0: a clock-µs base, about 1.8e15 < 2**51, plus 2**40
per re-base) and of 0.1's per-name fences (below 2**42). SPAN = 2**24: a generation is
replaced after RENEW_AFTER = 4096 returns, so its count never nears SPAN (a take that
reads count >= SPAN-1 replaces it first). Tokens fit 63 bits for 2**38 generations.

**A take** writes mandatory probe publishes to G+1 and to G's tombstone
``amqp-locks-fence-KK-g<G>-done`` (NO_ROUTE: missing) and ``basic.get`` on G at once on
one channel, then ``basic.reject(requeue)`` after the reply: one round trip, as before.
The broker handles a channel's methods in order, so the probes are judged before the
message is read. It uses G's count only if neither exists; it moves to G+1 if that
exists; a tombstone without G+1 means G+1 was deleted by hand (below). A connection's
first take on a generation, and every take in cluster mode, consume instead (RabbitMQ
3.10 answers a get on a leaderless quorum queue with 541, which closes the connection),
with the same probes: written with them when this process saw that generation current
less than STALE_AFTER ago (one round trip; it cannot be being deleted then), else a round
trip after them. A connection's first consume of a generation waits, within the take's
wait, until passive declares show the generation's message or a taker: a generation a
renewal or genesis just declared may have its record before its Raft member runs, and a
consume in between closes the whole connection (541 noproc; ``Session.wait_running``).

**Why tokens of one lock strictly rise.** The generations that exist always form one
unbroken run [D, M], and D and M never go down: a generation G+1 is made only by a write
whose first frame is a passive declare of G (a 404 there makes the broker discard the rest
of the write), followed by the stamped declaration of G+1 (a random ``x-max-length``: a
second creator gets 406, so one creator only), its message and G's tombstone; and a generation x is
deleted only when x+1 exists and x-1 does not (lowest first; x-1 can then never be made
again, since that needs x-2). Take grants A then B of one lock, B starting after A ended.
A used G, so G existed when A read it and G+1 did not when A probed just before. B uses G'
only if G' existed and G'+1 did not at B's probe, later than A's. If G' < G, G'+1 <= G lies
in the run (G' >= D and G <= M at B's probe), a contradiction. If G' = G, B's read is
later in the queue's own order than A's, so its count is larger. If G' > G, every token of
G' is above every token of G (count < SPAN). Sharing a counter between locks only makes
tokens skip values: each grant reads it after it holds its lock.

**Why a held message cannot double the counter.** A message taken by a taker that then
froze, or whose node was lost, comes back whenever its connection ends (4.3: after
``x-consumer-disconnected-timeout``). So nothing is ever published into an existing
generation: renewal, rebase and healing all make G+1 (:func:`_supersede`), and once G+1
exists the old message is worthless wherever it comes back (every take probes G+1 first).
There is no AMQP transaction anywhere on this path (they are not atomic even within one
queue: RabbitMQ's "Transactions" notes; docs/protocol.md).

**Healing, and its bound.** A take that finds G empty waits HEAL_AFTER (5 s: a live taker
holds the message for one round trip) for it to come back, then makes G+1. So a creator
that dies after any frame it sends (declared G+1 but never published, the case that left
1/16 of all names failing on 71753d0), a frozen taker, a purge, or a delivery limit cost
one generation, and the name grants again within HEAL_AFTER plus a few round trips (the
crash-point harness in tests/test_fence_generations.py measures it after every frame of
every path). Generation G is deleted RETIRE_AFTER (10 s) after G+1 was made (an older
one left by a client that died first, as long after it is found), in the background:
RabbitMQ 3.10 closes the whole connection (541) of a client that publishes to or reads
from a quorum queue while it is being deleted (measured), so a generation is deleted only
when active clients have moved past it, and searches start from the newest (below).

**Finding the current generation.** A process keeps the newest G it saw per shard
(``Session.fence_gens``). A client with none reads the marker's hints first (every
creation write ends with HINTS_KEPT publishes of its number to the marker, which keeps
the newest HINTS_KEPT; read once a passive declare shows one, since a get or consume on a
marker still starting closes the connection, 541), probes FIRST_WINDOW names from the
highest (else from 0) in one round trip, and asks whether the marker exists (a passive
declare: a probe would be a message, pushing the marker's hints out); if nothing is found
and the marker exists, it reads the hints again and probes SCAN_WINDOW names a round trip
from there. Readers hold the hints they took for a few round trips, so a cold read beside
others may see some or none: harmless for a start (a low hint costs a wider scan), but a
verdict (the counter gone; a rebuild's generation) rests on a read that saw the marker
whole, HINTS_KEPT of them, waiting up to HINT_SETTLE for it (a counter rebuilt far above
its leftovers is found only from the hints: CI of stop 60, 4.0.5).

**Never touching a generation being deleted.** RabbitMQ closes the whole connection of a
client that publishes to a quorum queue while it is deleted: 3.10.8 with 541 (40 of 40
probes; a passive declare: 0 of 40), 4.3.6 with 506 "failed to deliver message: {not_found,
...}" (seen once: 1 of 8 rounds of a test's cold searches beside a retire, in a CI
rehearsal), and a cold cluster-mode search starts from generation 0, where retiring happens.
So a search probes the window's tombstones first (classic queues: harmless, but in the
instant of their own delete on 4.2+, docs/protocol.md) and then only the generations without
one: a buried generation is counted as existing and never touched (the run's top, what the
search wants, has no tombstone). A generation is deleted only RETIRE_AFTER after its
tombstone exists (:func:`_retire` buries one a cut creator left unburied, and waits again;
and it deletes one only RETIRE_AFTER after its own process first knew of the tombstone,
which another process may have written a moment ago), and a search sends its second round
within RETIRE_AFTER / 2 of its first (else it asks the tombstones again). A retire asks
whether a neighbour exists with passive declares, and a take whose generation was last seen
current more than STALE_AFTER ago first asks whether that generation has a tombstone (one
round trip; others may be retiring what its probes would touch), and searches above it when
it has. A tombstone is never left without its generation: a retire buries only a generation
that still exists (every session whose search saw one retires it, so a second retire often
finds it gone), and drops the tombstone below the run that a retire which died between its
two deletes (the generation, then its tombstone) left. Such a tombstone read as a superseded
top to a run restarted below it (a reset shard): CounterGone.

**Made once, never again from scratch.** The first generation is made by a write whose first
frame declares the marker's name as an *exclusive* queue: refused (405) when the marker
exists, so a process that slept through a shard's whole life cannot make a low generation
again; the durable marker replaces the stand-in once the counter is confirmed. A counter
whose marker exists but whose generations are gone was deleted by hand: grants raise
:class:`FenceMissing` (naming the fix) instead of restarting low, until an operator rebuilds
it with ``SemaphoreAdmin(broker, N).repair_fence(floor)`` (``amqp-locks semaphore
repair-fence N --floor F``) at ``max(hint + 1, generation_for_floor(floor))``: every token
above the floor, the highest token any resource accepted, and above every generation the
broker knows of. Never from a clock. An operator who deletes the current generation while
the previous one still exists (within RETIRE_AFTER of a renewal) finds the same: the
previous one is tombstoned, so it is never counted on again. Residual: an operator who
deletes the marker too makes the shard "never made" (tokens restart at FLOOR); one who
deletes tombstones as well as the current generation in that window, or a creator cut
between its G+1 and its tombstone whose G+1 an operator then deletes, makes G current.

Broker limits: RabbitMQ 4.x gives quorum queues a default delivery limit of 20, so
generations are declared with ``x-delivery-limit: -1`` there; 3.x has no default limit,
and ``-1`` there means "drop on the first return" (checked on 3.10.8).

**Per-name epoch fences** (:func:`take_epoch`): a token semaphore's epochs come from its
own ``N-fence`` (one message, made by its administrator under its admin mutex), shifted
left by 32 bits, so they must stay small; those keep the earlier one-queue design (renewed
every RENEW_EPOCH_AFTER returns and re-based by 2**40 on a counting-rule change, by ack +
publish in one transaction).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import (
    AmqpLocksError,
    BrokerTimeout,
    FenceMissing,
    LockError,
    PreconditionFailed,
    QueueNotFound,
    ResourceLocked,
)
from .names import (
    FENCE_SHARDS,
    fence_generation,
    fence_marker,
    fence_queue,
    fence_shard_index,
    fence_tombstone,
)
from .transport.broker import BrokerCore, BrokerLike
from .transport.channel_ops import (
    ack,
    begin_transaction,
    cancel,
    consume_at,
    consume_unacked,
    declare_on,
    give_back,
    replace_and_commit,
    take,
)
from .transport.errors import channel_error
from .transport.features import (
    acquired_count_header,
    broker_version,
    counting_rule,
    lock_queue_arguments,
    quorum_arguments,
)
from .transport.queue_ops import bulk_probe
from .transport.recent import RecentDict
from .transport.session import Session
from .transport.shield import close_quietly
from .transport.wire import (
    AbstractChannel,
    AMQPError,
    Basic,
    ChannelInvalidStateError,
    ChannelNotFoundEntity,
    ContentBody,
    ContentHeader,
    DeliveredMessage,
    DeliveryError,
    PublishError,
    Queue,
    forget_returns,
    write_confirmed,
)

log = logging.getLogger("amqp_locks.fencing")

#: Every shard token is above this: above every token of the clock-based shards (71753d0: a clock-µs
#: base, about 1.8e15 in 2026, plus 2**40 per re-base), so an upgrade never goes back.
FLOOR = 2**52
#: Tokens per generation: generation g hands out FLOOR + g*SPAN + count + 1, count < SPAN-1.
SPAN = 2**24
#: After how many returns a generation is replaced by the next (its quorum queue's log is
#: never truncated while its one message is never acked).
RENEW_AFTER = 4096
#: How long a take waits for a generation's message before it makes the next generation:
#: longer than a live taker holds it (one round trip), so only a lost message, or one a
#: frozen or cut-off taker holds, costs a generation. The bound on healing.
HEAL_AFTER = 5.0
#: Hint messages the marker keeps (a reader takes the highest). Each hint is written this
#: many times, so a marker is full from its first hint on: a read that took HINTS_KEPT
#: saw every hint there, none held by another reader.
HINTS_KEPT = 4
#: Tries to read the marker's hints while other readers hold them (about 1 s in all).
HINT_TRIES = 10
#: How long a read the search's verdict rests on (a counter gone, a rebuild's generation)
#: keeps reading the hints until it has seen all HINTS_KEPT: every cold reader holds the
#: ones it took for a few round trips, so eight racing on one shard can each see some or
#: none (CI of stop 60, 4.0.5: a racer read none twice and called a healthy counter
#: gone, "g0 superseded, none above it; marker hint None").
HINT_SETTLE = 2.0
#: The longest wait for the marker to show a hint before it is read (a marker just made
#: may be starting: :func:`_read_hint`); in cluster mode (hints read by a consumer) also
#: the longest wait for them, HINT_QUIET how long after the last the burst is complete.
HINT_WAIT = 1.0
HINT_QUIET = 0.05
#: How long after making the next generation the old one is deleted (module docstring).
#: The margin every reader of a generation relies on: a consume written within
#: STALE_AFTER of a look that found its generation current meets the delete only if the
#: broker reads it RETIRE_AFTER - STALE_AFTER (5 s) after it was written, and a consumer
#: waits on a generation at most HEAL_AFTER (5 s) after a look in its own write found it
#: current. A stall longer than that (client or broker) closes the reader's connection
#: (541 on 3.10.8); tests that shorten these keep at least 1 s of it on a loaded machine.
RETIRE_AFTER = 10.0
#: How often, and after what pause (s), a search that finds the marker but no generation
#: looks again before it reports the counter gone (a racing genesis or renewal).
GONE_LOOKS = 3
GONE_PAUSE = 0.2
#: A generation this process last saw current longer ago than this is looked for again
#: before a take touches its neighbours (:func:`take_token`).
STALE_AFTER = RETIRE_AFTER / 2
#: Generation names probed first where a client looks for the current one (its hint).
FIRST_WINDOW = 4
#: Generation names probed per round trip by a wider search.
SCAN_WINDOW = 64
#: Windows probed from the hint before the counter is declared gone.
SCAN_WINDOWS = 4
#: Steps (supersede, retire, move up) a take makes before it gives up.
_MAX_STEPS = 64

# The per-name epoch fences (take_epoch) keep the earlier one-queue design:
#: How far a re-base lifts the base: above any count a message can reach.
REBASE_STEP = 2**40
#: After how many returns an epoch fence message is replaced by a fresh one (:func:`_renew`).
RENEW_EPOCH_AFTER = 1024
#: How long a renewal waits for the message (another client may hold it).
RENEW_WAIT = 5.0
_stamps = random.SystemRandom()


def fence_arguments(session: Session) -> dict[str, Any]:
    return lock_queue_arguments(session)


def fence_body(base: int, rule: str) -> bytes:
    """``b"<base> <rule>"``: the message's base and the counting rule it was minted under."""
    return f"{base} {rule}".encode()


def parse_fence_body(body: bytes) -> tuple[int, str | None]:
    """(base, rule) of a fence message; amqp-locks 0.1 wrote the base alone (no rule)."""
    parts = body.split()
    base = int(parts[0]) if parts and parts[0].isdigit() else 0
    rule = parts[1].decode(errors="replace") if len(parts) > 1 else None
    return base, rule


def rule_matches(rule: str | None, current: str) -> bool:
    """A message of amqp-locks 0.1 (no rule) was counted by ``x-delivery-count`` (all it
    knew): it matches every rule that still counts there, and is re-based on 4.3+."""
    return rule == current or (rule is None and current != counting_rule((4, 3)))


# --- fence shards: generations -------------------------------------------------------


def shard_token(g: int, count: int) -> int:
    """The fencing token of a take that read return count `count` from generation `g`."""
    return FLOOR + g * SPAN + count + 1


def generation_for_floor(floor: int) -> int:
    """The lowest generation every token of which is above `floor`."""
    return max(0, (floor - FLOOR) // SPAN + 1)


def _gen(k: int, g: int) -> str:
    return fence_generation(k, g)


def _marker_arguments(session: Session) -> dict[str, Any]:
    """The marker keeps the newest HINTS_KEPT hints (drop-head); no lock delay, so every
    client declares it alike."""
    args = quorum_arguments(broker_version(session), lock_delay_ms=None)
    return {**args, "x-max-length": HINTS_KEPT, "x-overflow": "drop-head"}


def _counter_message(session: Session) -> tuple[bytes, Basic.Properties]:
    rule = counting_rule(broker_version(session))
    props = Basic.Properties(delivery_mode=2, message_id=f"amqp-locks-fence-{_stamps.random()}")
    return fence_body(0, rule), props


@dataclass
class _Look:
    """What one take on generation g found (module docstring, "A take")."""

    above: bool = False  # generation g+1 exists: g is superseded
    dead: bool = False  # g's tombstone exists: g was superseded (g+1 may be deleted since)
    missing: bool = False  # g itself does not exist
    taken: Taken | None = None  # (count, returns) read from g's message, returned at once
    foreign: bool = False  # g's message was minted under another counting rule
    junk: bool = False  # something else was in g (dropped): look again


def _neighbours(k: int, g: int) -> list[str]:
    """What a take on g probes first: generation g+1, and g's tombstone."""
    return [_gen(k, g + 1), fence_tombstone(k, g)]


#: A tombstone's arguments: it exists, it never holds a message (probes vanish).
TOMBSTONE_ARGS: dict[str, Any] = {"x-max-length": 0}


async def _generations_exist(
    session: Session, k: int, gs: list[int], deadline: float
) -> list[bool]:
    """Whether each generation of `gs` exists: two round trips of probes (mandatory
    publishes), the tombstones first (classic queues: a publish to one being deleted is
    harmless but in the instant of its delete on 4.2+), then only the generations without
    one. A generation with a tombstone was superseded and may be being deleted right now: it
    is counted as existing without being touched (its successor is in the run above it, and
    the search only wants the run's top). One without a tombstone is not deleted for
    RETIRE_AFTER after that was seen (:func:`_retire` buries a generation before deleting
    it, and waits RETIRE_AFTER when it had to): its probe follows within RETIRE_AFTER / 2,
    or the tombstones are asked again, until `deadline` (then BrokerTimeout: a broker
    answering that slowly must not hold a caller past its timeout)."""
    names = [_gen(k, g) for g in gs]
    while True:
        asked = time.monotonic()
        buried = await session.probe([fence_tombstone(k, g) for g in gs])
        took = time.monotonic() - asked
        if took < RETIRE_AFTER / 2:
            break
        if time.monotonic() >= deadline:
            raise BrokerTimeout(
                f"fence shard {k:02d}: each probe of its generations took over "
                f"{RETIRE_AFTER / 2:g}s (last {took:.1f}s) until the deadline"
            )
    for g, b in zip(gs, buried, strict=True):
        if b:
            _saw_buried(session, k, g)
    found = iter(await session.probe([n for n, b in zip(names, buried, strict=True) if not b]))
    return [True if b else next(found) for b in buried]


async def _exists_untouched(session: Session, queue: str) -> bool:
    """Whether a generation that may be being deleted exists: a passive declare (never a
    crash; a 404 costs only a pooled channel), never a probe (module docstring)."""
    return await session.exists_passive(queue)


async def _settle(
    ch: AbstractChannel, message: DeliveredMessage, version: tuple[int, int], look: _Look
) -> None:
    """Read the counter message into `look` and return it at once (its return count rises
    by one). Anything else found in a generation (a probe that did not expire) is
    dropped, and the take tries again."""
    if not message.body:
        look.junk = True
        await ack(ch, _tag(message))
        return
    try:
        look.taken = _count(message, version)
    except _RuleChanged:
        look.foreign = True
    finally:
        await give_back(ch, _tag(message))


async def _look_get(session: Session, k: int, g: int) -> _Look:
    """The warm take: the probes of g+1 and g-1 and a `basic.get` on g written at once on
    one channel, so one round trip; the broker handles them in that order."""
    version = broker_version(session)
    queue = _gen(k, g)
    look = _Look()

    async def op(ch: AbstractChannel) -> None:
        probes = asyncio.ensure_future(bulk_probe(ch, _neighbours(k, g)))
        await asyncio.sleep(0)  # the probes are written before the get (bulk_probe's first step)
        try:
            message = await take(ch, queue)
        except ChannelNotFoundEntity:
            look.missing = True
            message = None
        except BaseException:  # a connection lost under the get, or our caller's deadline
            await _end(probes)
            raise
        found = await asyncio.gather(probes, return_exceptions=True)
        if isinstance(found[0], list):
            look.above, look.dead = found[0][0], found[0][1]
        elif not look.missing:
            raise found[0]
        if message is not None:
            await _settle(ch, message, version, look)

    await session.call(queue, op)
    return look


async def _end(probes: asyncio.Future[Any]) -> None:
    """Probes written beside a get or consume that ended: cancelled if still waiting,
    their outcome retrieved (never "Task exception was never retrieved")."""
    probes.cancel()  # a no-op once they are done
    await asyncio.gather(probes, return_exceptions=True)


async def _look_pushed(
    session: Session, k: int, g: int, wait: float, probed: bool, current_since: float | None = None
) -> _Look:
    """A take by a prefetch-1 consumer (cluster mode, a connection's first take, or after a
    `basic.get` found g empty): waits up to `wait` for g's message, on a pooled channel
    (:class:`_Pushed`: no channel opened per take). Unless `probed`, g+1 and g's tombstone
    are probed too. Never a consume on a superseded g, which may be being deleted (RabbitMQ
    3.10 closes the whole connection, 541, of a client reading a quorum queue while it is
    deleted; 4.3.6 too, "failed consuming from quorum queue: noproc"): the probes come
    first, a round trip before the consume, unless probes sent after `current_since`
    (monotonic) found g or a generation below it current, less than STALE_AFTER ago
    (:data:`_seen_current`). g is deleted no sooner than RETIRE_AFTER after g+1 was made,
    after those probes, so a consume written within STALE_AFTER of them meets a delete
    only if the broker reads it RETIRE_AFTER - STALE_AFTER (5 s) later: the probes and
    the consume then go in one write on one channel (the broker handles them in that
    order), one round trip in all instead of two."""
    queue = _gen(k, g)
    look = _Look()
    known = queue in session.fences_known
    async with _Pushed(session, queue) as pushed:
        probes: asyncio.Future[list[bool]] | None = None
        fresh = current_since is not None and time.monotonic() - current_since < STALE_AFTER
        if not probed and fresh and known:
            probes = asyncio.ensure_future(bulk_probe(pushed.ch, _neighbours(k, g)))
            await asyncio.sleep(0)  # written before the consume (bulk_probe's first step)
        elif not probed:
            look.above, look.dead = await session.probe(_neighbours(k, g))
            if look.above or look.dead:
                return look
        if not known:
            # A generation this connection never took from may be starting right now (a
            # genesis or renewal just declared it): a consume before its Raft member runs
            # closes the whole connection (541 noproc; seen on 3.10.8 in a fresh shard's
            # race). Seen running first (a message or a taker), within the same wait;
            # the consume then comes at most `wait` (HEAL_AFTER) after the probes, as a
            # consumer's wait may anyway.
            started = time.monotonic()
            try:
                if not await session.wait_running(queue, wait):
                    return look  # neither for `wait`: as if no message came
            except QueueNotFound:
                look.missing = True
                return look
            wait = max(0.05, wait - (time.monotonic() - started))
        try:
            try:
                await pushed.start()
            except ChannelNotFoundEntity:
                look.missing = True
                return look
            if probes is not None:
                look.above, look.dead = await probes
                if look.above or look.dead:
                    return look  # leaving cancels the consumer and returns what came
        finally:
            if probes is not None:
                await _end(probes)
        message = await pushed.first(wait)
        if message is None:
            return look  # nothing arrived: held by a frozen taker, or lost
        await pushed.settle(message)
        await _settle(pushed.ch, message, broker_version(session), look)
        return look


class _Pushed:
    """The first message the broker pushes from `queue` to a consumer on a pooled
    prefetch-1 channel (``Session.ready_channel``: no channel opened per take). A caller
    that got its message cancels the consumer first (:meth:`settle`) and the channel goes
    straight back to the pool. Otherwise (no message in time, or an error) the consumer
    is cancelled in the background on leaving and a message that came late is returned
    before the channel goes back; a channel that cannot be cleaned is closed (what it
    holds goes back with it)."""

    def __init__(self, session: Session, queue: str) -> None:
        self.session = session
        self.queue = queue
        self.ch: AbstractChannel
        self._tag: str | None = None
        self._got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()
        self._unsettled: list[DeliveredMessage] = []

    async def __aenter__(self) -> _Pushed:
        self.ch = await self.session.ready_channel()
        return self

    async def start(self) -> None:
        """Start consuming (one round trip; the first delivery follows the consume-ok)."""

        async def on_message(message: DeliveredMessage) -> None:
            self._unsettled.append(message)
            if not self._got.done():
                self._got.set_result(message)

        self._tag = await consume_at(self.ch, self.queue, on_message)

    async def first(self, wait: float) -> DeliveredMessage | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self._got), wait)
        except TimeoutError:
            return None

    async def settle(self, message: DeliveredMessage) -> None:
        """Before the caller settles `message` itself: cancel the consumer (no reply
        awaited), so the broker handles the cancel first and never pushes the returned
        message back to us (with prefetch 1 nothing else can have come)."""
        self._unsettled.remove(message)
        if self._tag is not None:
            await cancel(self.ch, self._tag, answered=False)
            self._tag = None

    async def __aexit__(self, *exc: object) -> None:
        ch, tag = self.ch, self._tag
        if ch.is_closed:
            return
        if tag is None:
            if exc[0] is None and not self._unsettled:
                # Never consumed, or cancelled before the caller settled its message:
                # clean as it came, the channel's own order sees to the rest.
                self.session.return_ready(ch)
            else:
                self.session.spawn(close_quietly(ch))
            return

        async def clean() -> None:
            await cancel(ch, tag)
            # Deliveries precede the cancel-ok on the channel: every one is in by now.
            for message in self._unsettled:
                await give_back(ch, _tag(message))

        self.session.recycle_ready(ch, clean)


async def take_token(session: Session, name: str, timeout: float = 30.0) -> int:
    """The next fencing token of lock `name`, from its shard's current generation (module
    docstring). Heals what it meets on the way (a generation with no message for
    :data:`HEAL_AFTER` seconds, a lower generation not yet deleted, a counter never made);
    raises :class:`FenceMissing` when the counter was deleted by hand (rebuilt by
    ``SemaphoreAdmin.repair_fence(floor)``) or nothing answered within `timeout`.

    aiormq's errors leave typed, as :func:`take_epoch`'s do: a connection lost under the
    take (the return of the counter message on a pooled channel, say) is a
    :class:`ConnectionLost`, which a waiter answers by waiting on a new connection. CI of
    2026-12-02 saw a write lock's grant end in aiormq's raw ``AMQPConnectionError``
    instead, which no acquire retries."""
    try:
        return await _take_token(session, name, timeout)
    except (AMQPError, ConnectionError, ChannelInvalidStateError) as exc:
        err = channel_error(exc)
        if isinstance(err, QueueNotFound):
            # Not the lock's own queue: an acquire would take it for a first use.
            err = FenceMissing(f"fencing token of {name!r}: {err}")
        raise err from exc


async def _take_token(session: Session, name: str, timeout: float) -> int:
    k = fence_shard_index(name)
    deadline = time.monotonic() + timeout
    g = session.fence_gens.get(k)
    seen = _seen_current.setdefault(session, {})
    last = seen.get(k)
    if g is not None and (last is None or _age(last) > STALE_AFTER):
        asked = time.monotonic()
        g = await _recheck(session, k, g, deadline)
        seen[k] = (g, asked)
    elif g is None:
        asked = time.monotonic()
        g = await _discover(session, k, deadline)
        seen[k] = (g, asked)
    for _ in range(_MAX_STEPS):
        queue = _gen(k, g)
        wait = _wait(deadline)
        asked = time.monotonic()
        if session.cluster or queue not in session.fences_known:
            # Never basic.get in a cluster (541 "nodedown" while a leader is elected closes
            # the connection), nor on a connection's first take of a queue (RabbitMQ 3.10
            # can bring back a quorum queue without a leader: a get then ends in 541 after
            # 60 s): a consumer just waits.
            last = seen.get(k)
            since = last[1] if last is not None and g >= last[0] else None
            look = await _look_pushed(session, k, g, wait, probed=False, current_since=since)
        else:
            look = await _look_get(session, k, g)
            if look.taken is None and not (
                look.missing or look.above or look.dead or look.foreign or look.junk
            ):
                # Held by another taker (for one round trip, or frozen) or lost: wait for it.
                look = await _look_pushed(session, k, g, wait, probed=True)
        if look.junk:
            pass
        elif look.missing:
            session.fences_known.discard(queue)
            g = await _discover(session, k, deadline, start=g)
        elif look.above:
            g += 1
        elif look.dead:
            # Superseded: its successor was made between our two probes, or deleted by
            # hand (never used again). The search tells them apart.
            g = await _discover(session, k, deadline, start=g)
        elif look.taken is None or look.foreign or look.taken[1] >= SPAN - 1:
            # No message for HEAL_AFTER (a creator died before its publish, a frozen taker
            # holds it), minted under another counting rule (a broker upgrade), or counted
            # out: the next generation replaces it, and every token of that is higher.
            if look.taken is None and wait < HEAL_AFTER:
                break  # our time ran out before the generation's
            await _supersede(session, k, g)
        else:
            count, returns = look.taken
            session.fence_gens[k] = g
            seen[k] = (g, asked)  # this look's probes were sent after `asked`
            session.fences_known.add(queue)
            if returns >= RENEW_AFTER:
                _renew_soon(session, k, g)
            return shard_token(g, count)
        if time.monotonic() >= deadline:
            break
    raise FenceMissing(
        f"fence shard {k:02d} ({_gen(k, g)}) gave no token within {timeout:.0f}s: its "
        f"message did not come back and no newer generation could be made (no quorum, or "
        f"no configure permission on {fence_generation(k, 0)[:-1]}*); the library retries "
        "it on the next grant"
    )


async def _recheck(session: Session, k: int, g: int, deadline: float) -> int:
    """The generation to take from, when this process saw `g` current more than
    STALE_AFTER ago: others may have moved on and be deleting what a take touches (g, g+1).
    A generation with no tombstone is not deleted for RETIRE_AFTER, nor any above it
    (lowest first), so one probe of g's tombstone (a classic queue, harmless to touch)
    clears g; a buried g is searched above the careful way (:func:`_generations_exist`)."""
    if (await session.probe([fence_tombstone(k, g)]))[0]:
        return await _discover(session, k, deadline, start=g)
    return g


def _wait(deadline: float) -> float:
    """How long a take waits for a generation's message before superseding it."""
    return max(0.05, min(HEAL_AFTER, deadline - time.monotonic()))


async def _discover(
    session: Session, k: int, deadline: float, *, start: int | None = None, create: bool = True
) -> int:
    """The current generation of shard `k`, found by probing from a hint (the newest this
    process saw, else the marker's hint message, else 0), SCAN_WINDOW names per round
    trip. A shard never made is made here (generation 0, :func:`_genesis`) when `create`.
    Raises FenceMissing when the marker exists but no generation is found: the counter
    was deleted by hand and must be rebuilt from a floor (:func:`repair_fence`)."""
    hint_read = False
    looked_above: int | None = None
    dead: int | None = None  # a superseded top seen with nothing above it
    gone_looks = 0
    hint = start if start is not None else session.fence_gens.get(k, 0)
    if start is None and k not in session.fence_gens and not session.cluster:
        # A cold search starts where the marker's hints say the run is: its probes then
        # touch the newest generations only, never one being retired (RabbitMQ 3.10 closes
        # the whole connection, 541, of a client publishing to a quorum queue while it is
        # deleted: measured with a search from 0 beside renewals every second). Not in
        # cluster mode: there the marker's leader may be across a partition from us, and
        # RabbitMQ 4.3.6 answers a consume on it with 541 "nodedown" too (measured in a
        # 5-node split: the write lock's waiter was never granted in 70 s); the search
        # from 0 reads the marker only when the run is not found there.
        hint = await _read_hint(session, k) or 0
    scanned: set[int] = set()  # where wide scans started
    while True:
        top, marker_found, low = await _scan(session, k, hint, deadline, wide=hint_read)
        if hint_read:
            scanned.add(hint)
        if top is not None and (await session.probe([fence_tombstone(k, top)]))[0]:
            if looked_above != top:
                # G's tombstone is written after G+1, in the same creation write: a
                # renewal that completed between our scan and this probe. Look above G
                # (the run's top never goes down, and G+1 is deleted only after G's
                # tombstone), never at the marker's hints alone: they are written last.
                looked_above = top
                above, _, _ = await _scan(session, k, top + 1, deadline, wide=True)
                if above is not None:
                    hint = above
                    continue
            # Superseded, its successor gone. Dead leftovers below a rebuilt counter look
            # so from 0 (a counter deleted by hand just after a renewal, then rebuilt far
            # above by repair_fence): the marker's hints say where the live run is, read
            # until seen whole (other readers may hold them) before any verdict.
            got = await _read_hint(session, k, settle=_settle_within(deadline))
            hint_read, dead = True, top
            if got is None or got <= top:
                seen = f"g{top} superseded, none above it; marker hint {got}"
                raise _counter_gone(k, dead=top, seen=seen)
            hint = got
            continue
        if top is not None:
            if not marker_found:
                await _ensure_marker(session, k)  # a genesis that died before its marker
                await _hint(session, k, top)
            if low is not None and low < top - 1:
                _retire_later(session, k, top - 2)  # left by clients that died first
            if low is not None and low < top:
                _retire_later(session, k, top - 1)
            session.fence_gens[k] = top
            return top
        if not marker_found:
            if hint != 0:
                hint = 0
                continue
            if not create:
                raise FenceMissing(f"fence shard {k:02d} was never made")
            if await _genesis(session, k, 0):
                _made_here.setdefault(session, set()).add(k)
        elif not hint_read:
            hint_read = True  # and the next scan is wide
            got = await _read_hint(session, k)
            if got is not None:
                hint = got
            elif not await _marker_usable(session, k):
                await asyncio.sleep(0.1)  # a genesis is making it right now
                hint_read = False
            else:
                hint = 0  # no hint at all: the wide search starts from the bottom
        elif gone_looks < GONE_LOOKS:
            # A marker with no generation near any hint: a racing genesis or renewal may
            # be between its writes (CI, 3.10.8: 1 of 8 racing processes got CounterGone
            # on a fresh shard). Look again from the bottom a few times before saying so;
            # a refusal later, never a lower token.
            gone_looks += 1
            await asyncio.sleep(GONE_PAUSE)
            hint, hint_read = 0, False
        else:
            # The verdict: only once the marker's hints, read whole, point nowhere new.
            got = await _read_hint(session, k, settle=_settle_within(deadline))
            if got is None or got in scanned:
                was = "" if dead is None else f"g{dead} superseded, none above it; "
                seen = f"{was}marker hint {got}, scanned from {sorted(scanned)}"
                raise _counter_gone(k, dead=dead, seen=seen)
            hint = got
        if time.monotonic() >= deadline:
            raise FenceMissing(f"fence shard {k:02d}: no generation found in time")


async def _scan(
    session: Session, k: int, base: int, deadline: float, *, wide: bool
) -> tuple[int | None, bool, int | None]:
    """(the highest generation of the run found from `base` up, whether the marker exists,
    the lowest generation seen).
    A narrow scan probes :data:`FIRST_WINDOW` names (where a hint points, the run is);
    a wide one SCAN_WINDOW names per round trip, SCAN_WINDOWS times."""
    top, low = None, None
    width, windows = (SCAN_WINDOW, SCAN_WINDOWS) if wide else (FIRST_WINDOW, 1)
    # The marker is asked by a passive declare, never probed: a probe is a message, and
    # the marker keeps only its newest HINTS_KEPT messages.
    marker = asyncio.ensure_future(_marker_exists(session, k))
    try:
        for _ in range(windows):
            gens = await _generations_exist(session, k, [base + i for i in range(width)], deadline)
            if any(gens):
                top = base + max(i for i, there in enumerate(gens) if there)
                if low is None:
                    low = base + gens.index(True)
                if not gens[-1]:
                    break
            elif top is not None or (base == 0 and not await marker):
                break  # the run ended at a window's edge; or nothing from 0 and no marker
            base += width
        marker_found = await marker
    finally:
        marker.cancel()
    if top is not None and gens[-1] and not wide:
        # The run goes on past the window.
        more, _, _ = await _scan(session, k, base, deadline, wide=True)
        top = more if more is not None else top
    return top, marker_found, low


class CounterGone(FenceMissing):
    """A shard's counter was deleted by hand: rebuild it from a floor (repair_fence)."""

    #: The newest generation still there, superseded (its successor deleted), if any.
    dead: int | None = None


def _counter_gone(k: int, dead: int | None = None, seen: str | None = None) -> CounterGone:
    """`seen`: what the search found (the error names it, for a report)."""
    found = f"; found: {seen}" if seen else ""
    gone = CounterGone(
        f"the fencing counter of shard {k:02d} is gone: its marker {fence_marker(k)!r} "
        f"exists but no generation {fence_generation(k, 0)[:-1]}<G> near its hint does "
        f"(deleted by hand?{found}). Tokens must not restart low: rebuild it above every "
        "token your resources accepted with "
        "`amqp-locks semaphore repair-fence NAME --floor HIGHEST_TOKEN` or "
        "SemaphoreAdmin(broker, NAME).repair_fence(HIGHEST_TOKEN)"
    )
    gone.dead = dead
    return gone


async def _marker_exists(session: Session, k: int) -> bool:
    """The marker exists (also as another genesis's stand-in)."""
    try:
        await session.declare_passive_counts(fence_marker(k))
    except ResourceLocked:
        return True
    except QueueNotFound:
        return False
    return True


async def _marker_usable(session: Session, k: int) -> bool:
    """False when the marker is another connection's exclusive stand-in (a genesis under
    way, :func:`_genesis`)."""
    try:
        await session.declare_passive_counts(fence_marker(k))
    except ResourceLocked:
        return False
    except QueueNotFound:
        return False
    return True


async def _read_hint(session: Session, k: int, settle: float = 0.0) -> int | None:
    """The highest generation number the marker holds (None: none there, or all held by
    other readers for a few tries). Every cold reader takes the hints and holds them a few
    round trips, so a read may see some or none: without `settle` the first read that saw
    any answers (a search starts from it: a low hint costs a wider scan, never a lower
    token); with it, reads go on until one sees all HINTS_KEPT or `settle` seconds pass,
    and the highest seen answers (what a verdict rests on: :func:`_discover`)."""
    marker = fence_marker(k)
    until = time.monotonic() + settle
    try:
        # A marker a genesis just declared may be starting: a get or a consume before its
        # Raft member runs closes the whole connection, with every lease on it (541
        # noproc: a consume, and a basic.get, "Cannot get a message ...: noproc", in CI
        # rehearsal 62 on 3.10.8). One with no hint ready has nothing to read: none, or
        # others hold them all (so a settled read waits for them as long).
        if not await session.wait_running(marker, max(HINT_WAIT, settle)):
            return None
    except (QueueNotFound, ResourceLocked):
        return None  # missing, or another's stand-in (405)
    read = _read_hints_pushed if session.cluster else _read_hints
    best: int | None = None
    tries = 1 if session.cluster else HINT_TRIES  # a consumer's read waits HINT_WAIT itself
    attempt = 0
    while True:
        seen = await read(session, marker)
        if seen is None:
            return best  # missing (404), or another's stand-in (405)
        if seen:
            best = max(seen) if best is None else max(best, *seen)
        attempt += 1
        if len(seen) >= HINTS_KEPT:
            return best  # all of them: nobody else held any
        if (best is not None and not settle) or (attempt >= tries and time.monotonic() >= until):
            return best  # any hint will do for a start; else out of tries and patience
        # Another reader holds the hints for a few round trips: try again a little later.
        await asyncio.sleep(random.uniform(0.01, 0.05) * min(attempt, HINT_TRIES))


async def _read_hints(session: Session, marker: str) -> list[int] | None:
    """One read of the marker's hints: every one taken on one channel, then returned by
    closing it. None when the marker is missing or another's stand-in."""
    ch = await session.open_channel()
    seen: list[int] = []
    try:
        for _ in range(HINTS_KEPT * 2):
            message = await take(ch, marker)
            if message is None:
                break
            seen += _hint_of(message)
    except AMQPError:
        return None
    finally:
        await close_quietly(ch)
    return seen


async def _read_hints_pushed(session: Session, marker: str) -> list[int] | None:
    """:func:`_read_hints` in cluster mode, by a consumer: never ``basic.get`` there (while
    a quorum queue has no leader, RabbitMQ answers a get with 541 "nodedown", which closes
    the whole connection: measured on a 5-node 4.3.6 split). The hints arrive in one burst
    (prefetch HINTS_KEPT * 2); the wait ends HINT_QUIET after the last, at most HINT_WAIT
    after the consume; closing the channel returns them."""
    seen: list[int] = []
    arrived = asyncio.Event()

    async def on_message(message: DeliveredMessage) -> None:
        seen.extend(_hint_of(message))
        arrived.set()

    ch = await session.open_channel()
    try:
        await consume_unacked(ch, marker, on_message, prefetch=HINTS_KEPT * 2)
        deadline = time.monotonic() + HINT_WAIT
        wait = HINT_WAIT
        while wait > 0:
            try:
                await asyncio.wait_for(arrived.wait(), wait)
            except TimeoutError:
                break
            arrived.clear()
            wait = min(HINT_QUIET, deadline - time.monotonic())
    except AMQPError:
        return None
    finally:
        await close_quietly(ch)
    return seen


def _hint_of(message: DeliveredMessage) -> list[int]:
    """The generation number a marker message holds ([] for anything else)."""
    text = message.body.decode(errors="replace")
    return [int(text)] if text.isdigit() else []


def _settle_within(deadline: float) -> float:
    """A verdict's hint read: HINT_SETTLE, within what is left of the caller's time."""
    return max(0.0, min(HINT_SETTLE, deadline - time.monotonic()))


async def _ensure_marker(session: Session, k: int) -> None:
    # ResourceLocked: another genesis's stand-in, which declares the marker itself;
    # PreconditionFailed: made with other arguments (an earlier build): it exists.
    with contextlib.suppress(ResourceLocked, PreconditionFailed):
        await session.declare(fence_marker(k), durable=True, arguments=_marker_arguments(session))


async def _hint(session: Session, k: int, g: int) -> None:
    """Leave `g` in the marker for clients that look for the shard's generation, HINTS_KEPT
    copies (:func:`_write_creation`; best effort: a lost hint costs a later client a
    wider search)."""
    text = str(g).encode()
    marker = fence_marker(k)
    copies = (session.publish("", marker, text, persistent=True) for _ in range(HINTS_KEPT))
    # Every copy awaited (none left running); a broker's refusal is best effort, as above.
    for out in await asyncio.gather(*copies, return_exceptions=True):
        if isinstance(out, BaseException) and not isinstance(out, AmqpLocksError | AMQPError):
            raise out


async def _write_creation(
    session: Session, k: int, g: int, first: list[Any], *, hint: bool = True, bury: bool = False
) -> bool:
    """Make generation `g` of shard `k` with its counter message in one write: the
    precondition frames `first`, then a declaration of `g` with a random stamp (a
    test-and-set: a second one is refused with 406) and a mandatory, confirmed publish.
    A failed precondition or a refused declaration makes the broker discard what follows
    (AMQP 0-9-1 ``channel.close``). With `hint`, the write ends with the new number's
    publish to the marker (its hint). True when this call made it; False when a
    condition failed or the write did not complete (every outcome is safe to retry:
    module docstring, "Crash points")."""
    queue = _gen(k, g)
    stamp = _stamps.randrange(2**40, 2**62)
    args = {**fence_arguments(session), "x-max-length": stamp}
    body, props = _counter_message(session)

    async def op(ch: AbstractChannel) -> None:
        frames: list[Any] = [
            *first,
            Queue.Declare(queue=queue, durable=True, nowait=True, arguments=args),
        ]
        frames += [
            Basic.Publish(exchange="", routing_key=queue, mandatory=True),
            ContentHeader(properties=props, body_size=len(body)),
            ContentBody(body),
        ]
        if bury:  # g-1's tombstone: superseded, even if g is deleted by hand later
            frames.append(
                Queue.Declare(
                    queue=fence_tombstone(k, g - 1),
                    durable=True,
                    nowait=True,
                    arguments=TOMBSTONE_ARGS,
                )
            )
        if hint:
            # HINTS_KEPT copies: the marker is full from its first hint on, so a reader
            # that took HINTS_KEPT knows it saw them all (:func:`_read_hint`).
            text = str(g).encode()
            frames += [
                Basic.Publish(exchange="", routing_key=fence_marker(k)),
                ContentHeader(properties=Basic.Properties(delivery_mode=2), body_size=len(text)),
                ContentBody(text),
            ] * HINTS_KEPT
        # The counter's publish is returnable (mandatory, matched by its id); the hints'
        # are not.
        ids = [props.message_id] + [None] * (HINTS_KEPT if hint else 0)
        confirms = await write_confirmed(ch, frames, ids)
        try:
            await confirms[0]  # the counter is in; the hints are best effort
            await asyncio.gather(*confirms[1:], return_exceptions=True)
        finally:
            forget_returns(ch, ids)

    call = asyncio.ensure_future(session.call(queue, op))
    session.creating.add(call)
    call.add_done_callback(session.creating.discard)
    try:
        await call
    except (QueueNotFound, PreconditionFailed, ResourceLocked) as exc:
        log.debug("fence generation %r not made: %s", queue, exc)
        return False
    except (PublishError, DeliveryError) as exc:
        log.debug("fence generation %r: counter not taken: %s", queue, exc)
        return False
    log.info("made fence generation %r", queue)
    return True


async def _supersede(session: Session, k: int, g: int) -> None:
    """Make generation g+1 of shard `k` (precondition: g still exists, checked in the
    same write), then retire g. Never touches g's message: whoever holds it cannot use it
    once g+1 exists (every take probes g+1 first)."""
    check = Queue.Declare(queue=_gen(k, g), passive=True, nowait=True)
    if await _write_creation(session, k, g + 1, [check], bury=True):
        session.fence_gens[k] = g + 1
        _saw_buried(session, k, g)  # its tombstone was in the confirmed write
    if g > 0:
        # Two generations old, left by a client that died first: retired later too, so
        # no search or take touches it while it is deleted (module docstring).
        _retire_later(session, k, g - 1)
    _retire_later(session, k, g)


def _retire_later(session: Session, k: int, g: int, *, again: bool = False) -> None:
    """Retire generation `g` :data:`RETIRE_AFTER` seconds from now, in the background:
    by then every active client has moved on, and none touches `g` while it is deleted
    (RabbitMQ 3.10 closes the whole connection, 541, of a client that publishes to or
    reads from a quorum queue while it is being deleted: measured)."""
    busy = _retiring.setdefault(session, {})
    if ((k, g) in busy and not again) or not session.alive:
        return

    async def go() -> None:
        try:
            await asyncio.sleep(RETIRE_AFTER)
            await _retire(session, k, g)
        except Exception as exc:  # a later take or search retires it
            log.debug("fence generation %r not retired: %s", _gen(k, g), exc)
        finally:
            if busy.get((k, g)) is asyncio.current_task():
                del busy[(k, g)]

    busy[(k, g)] = session.spawn(go(), deferred=True)


#: Per session and shard, (g, t): probes sent after monotonic time t found generation g
#: current, or at least without a tombstone. No generation >= g can be deleted before
#: t + RETIRE_AFTER (each is deleted RETIRE_AFTER after its tombstone was written, with
#: its successor, and lowest first), whatever else other takes on the session wrote since.
_seen_current: weakref.WeakKeyDictionary[Session, dict[int, tuple[int, float]]] = (
    weakref.WeakKeyDictionary()
)


def _age(seen: tuple[int, float]) -> float:
    return time.monotonic() - seen[1]


_retiring: weakref.WeakKeyDictionary[Session, dict[tuple[int, int], asyncio.Task[Any]]] = (
    weakref.WeakKeyDictionary()
)


async def _retire(session: Session, k: int, g: int) -> None:
    """Delete generation `g` of shard `k`, once g+1 exists, lowest first: a lower one
    still there is deleted before, so the generations that exist always form one
    unbroken run (module docstring, "Why the run stays unbroken")."""
    low = g
    while low > 0:
        if not await _exists_untouched(session, _gen(k, low - 1)):
            break
        low -= 1
        if g - low > _MAX_STEPS:
            break
    if low > 0 and (await session.probe([fence_tombstone(k, low - 1)]))[0]:
        # The tombstone of a generation already deleted below the run: a retire that died
        # between its two deletes left it. Nothing can make that generation again (its
        # predecessor is gone too), and left, it would read as a superseded top to a run
        # restarted below it (a reset shard): CounterGone on a healthy counter.
        await session.delete(fence_tombstone(k, low - 1))
    for x in range(low, g + 1):
        if not await _exists_untouched(session, _gen(k, x + 1)):
            return  # never delete the newest
        if not (await session.probe([fence_tombstone(k, x)]))[0]:
            if not await _exists_untouched(session, _gen(k, x)):
                # Retired meanwhile by another session (it deletes x, then x's tombstone):
                # burying it now would leave a tombstone of nothing, for good once this
                # session ends, and a run restarted below it (a reset shard) would read
                # it as a superseded top (CounterGone). Measured: a session that searched
                # from x while x was being superseded did exactly that.
                continue
            # Superseded by a creator cut before its tombstone: bury it, and delete it only
            # RETIRE_AFTER later, so no search that saw it unburied touches it while it is
            # deleted (:func:`_generations_exist`).
            await session.declare(fence_tombstone(k, x), durable=True, arguments=TOMBSTONE_ARGS)
            _saw_buried(session, k, x)
            _retire_later(session, k, g, again=True)
            return
        _saw_buried(session, k, x)
        if _buried_for(session, k, x) < RETIRE_AFTER:
            # A tombstone this session had not seen for RETIRE_AFTER: another process's
            # retire may have written it a moment ago (a leftover it buried), so searches
            # may still touch x. Wait its whole grace, as if we had buried it.
            _retire_later(session, k, g, again=True)
            return
        await session.delete(_gen(k, x))
        await session.delete(fence_tombstone(k, x))
        _buried_since.setdefault(session, RecentDict()).pop((k, x), None)
        session.fences_known.discard(_gen(k, x))
        log.debug("retired fence generation %r", _gen(k, x))


#: Per session, (shard, generation) -> when this session first knew that generation's
#: tombstone to exist (monotonic, after the answer or confirm: never earlier than the
#: tombstone was made). :func:`_retire` deletes a generation only RETIRE_AFTER after that,
#: whoever wrote the tombstone.
_buried_since: weakref.WeakKeyDictionary[Session, RecentDict[tuple[int, int], float]] = (
    weakref.WeakKeyDictionary()
)


def _saw_buried(session: Session, k: int, g: int) -> None:
    seen = _buried_since.setdefault(session, RecentDict())
    if (k, g) not in seen:
        seen[(k, g)] = time.monotonic()


def _buried_for(session: Session, k: int, g: int) -> float:
    """Seconds since this session first knew generation g's tombstone to exist."""
    since = _buried_since.setdefault(session, RecentDict()).get((k, g))
    return 0.0 if since is None else time.monotonic() - since


_renewing: weakref.WeakKeyDictionary[Session, set[int]] = weakref.WeakKeyDictionary()


def _renew_soon(session: Session, k: int, g: int) -> None:
    """Replace generation `g` after RENEW_AFTER returns (its quorum queue's log is never
    truncated while its message is never acked), in the background: the caller's token
    stands."""
    busy = _renewing.setdefault(session, set())
    if k in busy:
        return
    busy.add(k)

    async def go() -> None:
        try:
            await _supersede(session, k, g)
        except Exception as exc:  # the next take past RENEW_AFTER tries again
            log.debug("fence shard %02d not renewed: %s", k, exc)
        finally:
            busy.discard(k)

    session.spawn(go())


async def _genesis(session: Session, k: int, g: int) -> bool:
    """Make shard `k`'s counter for the first time, at generation `g`: one write whose
    first frame declares the marker's name *exclusive* (refused, 405, when the marker
    exists, so a process that slept through the shard's whole life cannot make a low
    generation again; made and then dropped by us when it does not), then generation `g`
    and its message. The durable marker is declared once that is confirmed."""
    marker = fence_marker(k)
    stand_in = Queue.Declare(queue=marker, exclusive=True, nowait=True)
    made = await _write_creation(session, k, g, [stand_in], hint=False)
    # Ours or not, drop the exclusive stand-in (a delete of another connection's
    # exclusive queue is refused, 405; of the durable marker, never sent: we delete only
    # when this call's stand-in was accepted, i.e. the marker did not exist).
    if await _own_stand_in(session, marker):
        with contextlib.suppress(ResourceLocked, QueueNotFound):
            await session.delete(marker)
    await _ensure_marker(session, k)
    if made:
        await _hint(session, k, g)
        session.fence_gens[k] = g
    return made


async def _own_stand_in(session: Session, marker: str) -> bool:
    """The marker's name is our own exclusive stand-in (a classic queue: a passive declare
    answers, a durable marker made by others would be quorum and not exclusive to us)."""
    try:
        await session.call(marker, lambda ch: declare_on(ch, marker, exclusive=True))
    except (PreconditionFailed, ResourceLocked, QueueNotFound):
        return False
    return True


async def current_queue(session: Session, name: str) -> str:
    """The queue of the generation lock `name` counts on now (made if never made): for
    tools and tests that look at the counter."""
    k = fence_shard_index(name)
    return _gen(k, await _discover(session, k, time.monotonic() + 30.0))


#: Shards whose counter a session made (genesis), for ensure_fence's answer.
_made_here: weakref.WeakKeyDictionary[Session, set[int]] = weakref.WeakKeyDictionary()


async def ensure_fence(session: Session, name: str) -> bool:
    """Make the fence counter lock `name` counts on unless it exists (safe to race).
    True if this call made it."""
    return await _ensure_shard(session, fence_shard_index(name))


async def ensure_shards(session: Session) -> list[str]:
    """Make every fence shard's counter that is missing (:func:`amqp_locks.prepare_fences`);
    returns the markers made now."""
    made = []
    for k in range(FENCE_SHARDS):
        if await _ensure_shard(session, k):
            made.append(fence_marker(k))
    return made


async def _ensure_shard(session: Session, k: int) -> bool:
    made = _made_here.setdefault(session, set())
    made.discard(k)
    await _discover(session, k, time.monotonic() + 30.0)
    return k in made


def prepare_fences(broker: BrokerLike) -> list[str]:
    """Make the 16 fence counters now, at a quiet moment, rather than on the first fenced
    grant of each (once per broker or cluster; idempotent). Returns the markers made."""
    return broker.core.run(prepare_on_loop(broker.core))


async def prepare_on_loop(core: BrokerCore) -> list[str]:
    return await ensure_shards(await core.session())


async def repair_fence(session: Session, name: str, floor: int) -> bool:
    """Rebuild the fence counter of `name`'s shard if it is gone (its marker exists, no
    generation does: deleted by hand), at the lowest generation whose every token is above
    `floor` (the highest token any resource accepted) and above every generation that
    can have been used. Call under the shard's lock (names.fence_shard_lock): two rebuilds
    would make two counters. False when the counter is there (nothing to do: the library
    heals a generation that lost its message by itself)."""
    k = fence_shard_index(name)
    deadline = time.monotonic() + 30.0
    dead: int | None = None
    try:
        await _discover(session, k, deadline, create=False)
        return False
    except CounterGone as exc:
        dead = exc.dead
    except FenceMissing as exc:
        if "never made" in str(exc):
            return await _genesis(session, k, generation_for_floor(floor))
    if dead is not None:
        # Superseded generations whose successor was deleted: dead for ever; drop them so
        # the rebuilt one is the run's only member.
        x = dead
        while x >= 0 and (await session.probe([_gen(k, x)]))[0]:
            await session.delete(_gen(k, x))
            await session.delete(fence_tombstone(k, x))
            x -= 1
    hints = await _read_hint(session, k, settle=HINT_SETTLE)
    hint = max(hints or 0, session.fence_gens.get(k, 0), (dead or 0) + 1)
    # Above the newest generation this broker and process know of, and above the floor:
    # the floor is what proves it (it is at least every token handed out).
    g = max(hint + 1, generation_for_floor(floor))
    check = Queue.Declare(queue=fence_marker(k), passive=True, nowait=True)
    made = await _write_creation(session, k, g, [check])
    if made:
        session.fence_gens[k] = g
        log.warning(
            "fence shard %02d rebuilt at generation %d (tokens from %d, floor %d)",
            k,
            g,
            shard_token(g, 0),
            floor,
        )
    return made


async def ensure_name_fence(session: Session, name: str) -> bool:
    """Create lock `name`'s own fence `N-fence` with its one message unless it exists: the
    epochs of an administrator's token semaphore (:func:`take_epoch`). Call under the
    admin mutex (two creators could otherwise publish two fence messages). True if
    created now."""
    queue = fence_queue(name)
    if await session.exists_passive(queue):
        return False
    await session.declare(queue, durable=True, arguments=fence_arguments(session))
    rule = counting_rule(broker_version(session))
    await session.publish("", queue, fence_body(0, rule), persistent=True)
    log.info("created fence queue %r", queue)
    return True


class _RuleChanged(Exception):
    """The fence message was minted under another counting rule: re-base it first."""


#: (the message's base plus its return count, the return count) of one take.
Taken = tuple[int, int]


def _count(message: DeliveredMessage, version: tuple[int, int]) -> Taken:
    """The message's base plus its return count under this broker's rule, and that count."""
    base, rule = parse_fence_body(message.body)
    if not rule_matches(rule, counting_rule(version)):
        raise _RuleChanged(rule)
    headers = (message.header.properties.headers or {}) if message.header else {}
    value = headers.get(acquired_count_header(version), 0)
    returns = int(value) if isinstance(value, int) else 0
    return base + returns, returns


def _tag(message: DeliveredMessage) -> int:
    tag = getattr(message.delivery, "delivery_tag", None)
    assert isinstance(tag, int)
    return tag


async def take_epoch(session: Session, name: str, timeout: float = 30.0) -> int:
    """The next value of lock `name`'s own fence `N-fence` (made by its administrator,
    :func:`ensure_name_fence`): a token semaphore's epoch, which it shifts left by 32 bits
    (tokens/fencing.py). Its own counter rises only when tokens are published or given
    back by the broker, so its tokens stay far below 2**63; a shard's (about 2**51, and
    rising with every lock of the shard) would not."""
    return await _take_from(session, name, fence_queue(name), timeout)


async def _take_from(session: Session, name: str, queue: str, timeout: float) -> int:
    try:
        for _attempt in range(3):
            try:
                count, returns = await _take(session, queue, timeout)
                if returns >= RENEW_EPOCH_AFTER:
                    renewed = await _renew(session, queue, timeout)
                    if renewed is not None:
                        return renewed
                return count + 1
            except _RuleChanged:
                await _rebase(session, queue, timeout)
    except (AMQPError, ConnectionError, ChannelInvalidStateError) as exc:
        # Typed (the rebase's too), so a waiter's reconnect logic sees a ConnectionLost.
        raise channel_error(exc, queue) from exc
    raise LockError(f"the fence of {name!r} keeps changing counting rules (mixed brokers?)")


async def _take(session: Session, queue: str, timeout: float) -> Taken:
    version = broker_version(session)
    if session.cluster:
        # In a cluster, never basic.get: while the fence's leader is being re-elected
        # (about 0.5 s after its node dies) RabbitMQ 3.10 answers it with 541
        # INTERNAL_ERROR "nodedown", which closes the whole connection and loses every
        # lease on it. A consumer just waits for the new leader.
        return await _take_pushed(session, queue, timeout)
    if queue not in session.fences_known:
        # A connection's first take on a fence consumes too: RabbitMQ 3.10.8 can bring a
        # quorum queue made just before its node was killed back without a leader, and a
        # basic.get on it ends in 541 after 60 s, closing the whole connection with every
        # lease on it; a consumer times out alone (FenceMissing says what to do). A fence
        # that answered once was made long before any later crash.
        first = await _take_pushed(session, queue, timeout)
        session.fences_known.add(queue)
        return first

    async def get_and_return(ch: AbstractChannel) -> Taken | None:
        message = await take(ch, queue)
        if message is None:
            return None
        try:
            return _count(message, version)
        finally:
            await give_back(ch, _tag(message))

    taken: Taken | None = await session.call(queue, get_and_return)
    if taken is None:
        taken = await _take_pushed(session, queue, timeout)
    return taken


async def _renew(session: Session, queue: str, timeout: float) -> int | None:
    """Take the fence message once more and replace it by one whose base is the token this
    take hands out: the next take gets that plus one, as it would have from the old
    message. Why: a quorum queue keeps its Raft log from the oldest message it holds, and
    a fence message is never acknowledged, so without a new message now and then its log
    (every take appends a checkout and a return) is never truncated, and its memory
    tables grow until the write-ahead log rolls over (docs/scaling.md). None when it did
    not happen (the message was not ours in time, or minted under another rule): the
    caller's own token stands. A failure after the commit was sent leaves a base above
    the caller's token, which is still unique."""
    version = broker_version(session)

    def renewed(message: DeliveredMessage) -> int | None:
        try:
            count, _ = _count(message, version)
        except _RuleChanged:
            return None
        return count + 1

    try:
        token = await _replace(session, queue, min(timeout, RENEW_WAIT), renewed)
    except TimeoutError:
        return None
    except (AMQPError, ConnectionError) as exc:
        log.debug("fence %r not renewed (%s): the earlier take's token stands", queue, exc)
        return None
    if token is not None:
        log.debug("fence %r renewed at base %d", queue, token)
    return token


async def _rebase(session: Session, queue: str, timeout: float) -> None:
    """Replace a fence message minted under another counting rule by one with a base
    above every token it can have produced (module docstring)."""
    rule = counting_rule(broker_version(session))
    old: list[tuple[int, str | None]] = []

    def rebased(message: DeliveredMessage) -> int | None:
        base, old_rule = parse_fence_body(message.body)
        if rule_matches(old_rule, rule):
            return None  # someone re-based it meanwhile
        old.append((base, old_rule))
        return base + REBASE_STEP

    try:
        new_base = await _replace(session, queue, timeout, rebased)
    except TimeoutError:
        raise FenceMissing(f"no fence message arrived from {queue!r} to re-base") from None
    if new_base is not None:
        [(base, old_rule)] = old
        log.warning(
            "fence %r was minted under counting rule %s, the broker now counts by %s: "
            "re-based from %d to %d (fencing tokens jump once)",
            queue,
            old_rule or "dc (amqp-locks 0.1)",
            rule,
            base,
            new_base,
        )


async def _replace(
    session: Session,
    queue: str,
    timeout: float,
    new_base: Callable[[DeliveredMessage], int | None],
) -> int | None:
    """Take the fence message of `queue` (pushed, TimeoutError after `timeout`) and, if
    ``new_base(message)`` gives a base, replace it in one AMQP transaction (ack + publish
    of a message with that base, minted under this broker's rule): the message is never
    lost nor doubled, even if we die in between. Returns that base, or None when
    `new_base` declined (closing the channel returns the message as it came)."""
    rule = counting_rule(broker_version(session))
    ch = await session.raw_channel(publisher_confirms=False)  # tx and confirms exclude
    try:
        await begin_transaction(ch)
        message = await _first_pushed(ch, queue, timeout)
        base = new_base(message)
        if base is None:
            return None
        await replace_and_commit(
            ch, _tag(message), queue, fence_body(base, rule), Basic.Properties(delivery_mode=2)
        )
        return base
    finally:
        await close_quietly(ch)


async def _first_pushed(ch: AbstractChannel, queue: str, timeout: float) -> DeliveredMessage:
    """The first message the broker pushes from `queue` to a prefetch-1 consumer on `ch`
    (TimeoutError after `timeout`); it stays unacked on `ch`, as does any later one,
    until the caller settles it or closes the channel."""
    got: asyncio.Future[DeliveredMessage] = asyncio.get_running_loop().create_future()

    async def on_message(message: DeliveredMessage) -> None:
        if not got.done():
            got.set_result(message)

    await consume_unacked(ch, queue, on_message, prefetch=1)
    return await asyncio.wait_for(got, timeout)


async def _take_pushed(session: Session, queue: str, timeout: float) -> Taken:
    async with _Pushed(session, queue) as pushed:
        await pushed.start()
        message = await pushed.first(timeout)
        if message is None:
            raise FenceMissing(
                f"no fence message arrived from {queue!r} within {timeout:.0f}s: it was purged, "
                "dropped by a delivery limit (an operator policy 'delivery-limit' overrides "
                "x-delivery-limit: -1; docs/compatibility.md), or is held by a frozen client "
                "(it comes back when that connection ends); or the queue has no leader"
            )
        await pushed.settle(message)
        try:
            return _count(message, broker_version(session))
        finally:
            await give_back(pushed.ch, _tag(message))
