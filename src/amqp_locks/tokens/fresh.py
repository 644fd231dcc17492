"""First-use token queues: a token semaphore made by its first user, gone when unused.

Cluster mode's mutex `M` is the token semaphore `M.mutex` (mutex.py) with one permit; a
Celery key with ``lock_limit=N`` is one with N permits (``TokenSemaphore(first_use=True,
permits=N)``). Its queue is not set up by an administrator: the first acquire that finds it
missing (404) makes it, with no administration mutex and no ledger, and the broker deletes
it once nobody uses it.

- **Expiry.** The token queue is the usual quorum lock queue (`token_arguments`: delivery
  limit, consumer timeout, 4.3's consumer-disconnected timeout; on one node a semaphore
  with ``quorum=False`` uses a classic token queue's) plus ``x-expires``
  (:data:`EXPIRES_MS`, `features.NAME_EXPIRES_MS`). A queue is *used* while it has a
  consumer: a holder (its token unacked on its channel) or a waiter keeps it; a free token
  sitting ready does not. Measured on 3.10.8 and 4.3.6: an unused quorum queue holding a
  ready message is deleted 60.3-60.4 s after its last use with ``x-expires: 60000`` (with
  3 000 ms: 5-6 s; the broker checks on a timer), while one whose message is held stays;
  passive declares (status readers, the tests' polls) do not count as use.
- **Test-and-set.** ``x-max-length`` only counts ready messages, so "publish if the queue is
  empty" would let a second token in while the first is held. Instead each attempt declares
  with its own random ``x-max-length`` in [2**40, 2**62) (a *stamp*, stamps.py; no queue ever holds
  that many messages, so it limits nothing). RabbitMQ compares ``x-max-length`` when a queue
  is declared again and refuses a different value with 406 PRECONDITION_FAILED, so of all
  racers exactly one, the creator, gets its declaration accepted; every other one learns
  that the queue exists and simply waits (consumes). A queue made by the earlier release
  (`TokenAdmin.setup`: no ``x-expires``, a ledger) refuses our declaration the same way, and
  is used as it is.
- **The count lives in the stamp** (stamps.py). A stamp's low 20 bits are the
  permit count, the rest random: a queue needs no ledger to say how many permits it has.
  Anyone can read it without changing anything (`Session.held_max_length`: a declaration
  with ``x-max-length: -1``, which the broker refuses whether the queue exists or not,
  naming the stamp in the first case); a creator that loses the race reads it from its
  own 406, so a user giving another count gets a LockShapeMismatch naming both; each
  token says the count too (shape.py), and every grant checks it.
- **Declaration and tokens in one write.** The creator sends the declaration and the
  publishes of the tokens (ids 1..N, persistent, mandatory, confirmed) together
  (`Session.declare_and_publish`): the broker routes the publish right behind an accepted
  declaration and drops it behind a refused one (the channel is closed by the 406, and a
  closing channel discards what follows). So a loser's tokens never land anywhere, and
  no client round trip separates the two; but they are not atomic (below).
- **Fencing.** The token carries no counter (`tokens.fencing.shard_headers`): each grant
  takes its fencing token from the lock's fence shard (`fencing.take_token`), after it
  holds the token, as a one-node mutex does. So tokens rise across the queue's
  incarnations whatever time passes between them, and stay near 2**51 (a BIGINT), where
  an epoch shifted by 32 bits would not.

Residual window (docs/cluster.md, "First use and expiry of a mutex"): the broker handles
the publish after the declaration, which makes a quorum queue (a raw quorum declaration's
time: 8-40 ms here); a creator whose connection ends meanwhile (it dies, is cut off, or its
node crashes) leaves the queue without its token (or some of its N tokens: fewer permits,
never more): measured by aborting the connection 0-2
ms after the write, 39 of 40 times on 3.10.8, 40 of 40 on 4.3.6
(`benchmarks/first_use_facts.py`). Such a queue has no token: its waiters notice and
replace it (tokens/heal.py: within ``lock_delay`` + 2-4 s of its first waiter's
registration, which comes :data:`RUNNING_WAIT` after it arrived), and
`TokenAdmin("M.mutex").repair()` re-publishes the missing token at once
(`TokenAdmin(name).repair()` for a semaphore: it reads N from the stamp).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Literal

from ..errors import PreconditionFailed, QueueNotFound
from ..names import token_queue
from ..shape import delay_refusal, forget, held_delay, permits_refusal, shape_headers, token_kind
from ..stamps import is_stamp, new_stamp, permits_of
from ..transport.features import NAME_EXPIRES_MS, min_lock_delay_ms
from ..transport.line_args import held_value
from ..transport.refusals import inequivalent
from ..transport.session import Session
from .arguments import token_arguments
from .fencing import shard_headers
from .message import token_properties

#: How long a first-use token queue lives once nobody uses it (ms). Read at each
#: declaration, so a test may lower it in its own process.
EXPIRES_MS = NAME_EXPIRES_MS


#: The longest a waiter whose queue was deleted under it waits for the delete to finish
#: before it makes the queue again (:func:`until_deleted`).
DELETE_WAIT = 5.0


async def until_deleted(session: Session, queue: str) -> None:
    """After the broker cancelled our consumer because `queue` was deleted (a waiter's
    heal, an expiry, an operator): wait until the delete finished before anything is sent
    to the queue again. 3.10 cancels a quorum queue's consumers once its
    Raft members stop, before it drops the queue's record; a ``basic.consume`` in between
    (our first use's test-and-set is refused, the queue still "exists", and we consume)
    meets no member and the broker closes the whole connection (541; CI, 3.10.8,
    ``{badmatch,{error,noproc}}`` in ``rabbit_quorum_queue:consume``). A passive declare
    then answers 0 ready and 0 consumers without a crash (``stat`` of a queue with no
    leader): polled (``Session.wait_running``) until the queue is gone (404) or made
    again (a token or a consumer), at most :data:`DELETE_WAIT` seconds (nothing tells us
    when the record goes). Once
    thought 3.x only; 4.3.6 did it once too (rehearsal 19: a heal's delete, then a
    waiter's consume, 541 ``failed consuming from quorum queue ...: noproc``). Where the
    delete is already done, this costs one passive declare (404)."""
    forget(session, queue)  # what we saw of it is stale
    with contextlib.suppress(QueueNotFound):  # gone: done
        await session.wait_running(queue, DELETE_WAIT)


#: The longest a consume of a first-use quorum queue waits for the queue to run
#: (:func:`until_running`).
RUNNING_WAIT = 5.0
#: How long a session trusts that a queue it saw running still runs: under the queue's
#: expiry (``x-expires``, 60 s after its last use), so only a delete by hand or by a heal
#: and a new creation in between can make it wrong.
RUNNING_FRESH = 30.0


async def until_running(session: Session, queue: str) -> None:
    """Before consuming from the first-use quorum queue `queue`: wait until it runs
    (``Session.wait_running``). A quorum queue's record exists before its Raft member
    runs; meanwhile another client's declaration is refused (406: the record exists) and
    a ``basic.consume`` closes the consumer's whole connection, dropping every other lock
    held on it (541 noproc). Both a loser of the creation race (it consumes right after
    its 406) and a client whose first consume lands in that window are hit: measured on
    4.0.5 with raw aiormq, a consume right after a refused declaration lost its
    connection in 3 of 50 two-client races, and 4 Brokers racing on 20 fresh names lost
    connections in 4 of 6 test runs (none with this check, 6 runs).

    A running first-use queue has a token ready or a consumer (its holders, its
    waiters). One that has shown neither for :data:`RUNNING_WAIT` seconds, counted from
    this session's first such answer and across its acquires (a standby retrying short
    acquires), is consumed anyway: a queue whose creator died before its tokens landed,
    which its first waiter then heals (heal.py). A queue this session saw running less
    than :data:`RUNNING_FRESH` ago is not asked again: one round trip on a session's
    first acquire of a name, none on the next ones. Raises QueueNotFound when the queue
    is missing (the caller makes it)."""
    now = time.monotonic()
    seen = session.running_seen.get(queue)
    if seen is not None and now - seen < RUNNING_FRESH:
        return
    quiet = session.quiet_since.get(queue)
    if quiet is None or now - quiet > RUNNING_FRESH:
        quiet = session.quiet_since[queue] = now
    left = quiet + RUNNING_WAIT - now
    if left <= 0:
        return  # quiet for RUNNING_WAIT already: consume (and heal)
    if await session.wait_running(queue, left):
        saw_running(session, queue)


def saw_running(session: Session, queue: str) -> None:
    """`queue` runs now: it just answered a consume of ours (or a passive declare)."""
    session.running_seen[queue] = time.monotonic()
    session.quiet_since.pop(queue, None)


def fresh_arguments(session: Session, stamp: int, quorum: bool = True) -> dict[str, Any]:
    """A first-use token queue's arguments: the token queue's, expiring, stamped."""
    return {**token_arguments(session, quorum), "x-expires": EXPIRES_MS, "x-max-length": stamp}


#: What :func:`create` found: it made the queue; found a first-use queue with our count;
#: found a queue made otherwise (an administrator's, with a ledger), whose count it
#: could not read.
Created = Literal["made", "found", "other"]


async def create(
    session: Session,
    name: str,
    permits: int = 1,
    quorum: bool = True,
    kind: str | None = None,
    what: str | None = None,
) -> Created:
    """Make the first-use token queue of the token semaphore `name` with its `permits`
    tokens (ids 1..permits, their headers saying the queue's shape, shape.py: `kind`,
    default `shape.token_kind`), unless a queue of that name exists: the stamped
    declaration and the tokens in one write (test-and-set). A queue found instead is
    checked as a grant would check its tokens: LockShapeMismatch when its stamp says
    another count, or (cluster mode, 4.3+) its lock delay is shorter than this client
    needs (`what` names the client in the message)."""
    queue = token_queue(name)
    forget(session, queue)  # found missing (or never seen): what we read of it is stale
    what = what or f"token semaphore {name!r}"
    arguments = fresh_arguments(session, new_stamp(permits), quorum)
    headers = {
        **shard_headers(),
        **shape_headers(kind or token_kind(name, permits), permits, arguments),
    }
    messages = [
        (str(k).encode(), token_properties(name, k, headers)) for k in range(1, permits + 1)
    ]
    try:
        await session.declare_and_publish(queue, arguments, messages)
    except PreconditionFailed as exc:
        if inequivalent(exc) is None:
            raise
        stamp = held_value(exc, "x-max-length")
        found: Created = "found" if stamp is not None and is_stamp(stamp) else "other"
        if stamp is not None and found == "found" and permits_of(stamp) != permits:
            raise permits_refusal(queue, permits_of(stamp), permits, what) from None
        await _check_delay(session, queue, stamp if found == "found" else None, quorum, what)
        return found
    return "made"


async def _check_delay(
    session: Session, queue: str, stamp: int | None, quorum: bool, what: str
) -> None:
    """Refuse a queue found with a lock delay shorter than this client needs: the 406
    that told us it exists named the stamp, compared before the delay."""
    need = min_lock_delay_ms(session)
    if need <= 0:
        return
    args = fresh_arguments(session, stamp, quorum) if stamp else token_arguments(session, quorum)
    held = await held_delay(session, queue, args)
    if held is not None and held < need:
        raise delay_refusal(queue, held, what, need)


async def held_permits(session: Session, name: str) -> tuple[int, bool] | None:
    """(permit count, quorum) of the first-use queue of `name`, read from its stamp
    (`Session.held_max_length`); None when the queue is missing or is not a first-use
    queue of this release (made by `TokenAdmin.setup`, with a ledger)."""
    for quorum in session.queue_types:  # a queue of either type
        try:
            stamp = await session.held_max_length(
                token_queue(name), fresh_arguments(session, 0, quorum)
            )
        except QueueNotFound:
            return None
        if stamp is not None:
            return (permits_of(stamp), quorum) if is_stamp(stamp) else None
    return None
