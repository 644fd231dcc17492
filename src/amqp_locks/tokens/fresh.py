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
  own 406, so a user giving another count gets a LockError naming both.
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
(`benchmarks/first_use_facts.py`). Such a queue has no
token: waiters wait until their timeout, and the queue expires :data:`EXPIRES_MS` after the
last one left; the next user makes it again. `TokenAdmin("M.mutex").repair()` re-publishes
the missing token at once (`TokenAdmin(name).repair()` for a semaphore: it reads N from
the stamp).
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import LockError, PreconditionFailed, QueueNotFound
from ..names import token_queue
from ..stamps import is_stamp, new_stamp, permits_of
from ..transport.features import NAME_EXPIRES_MS
from ..transport.line_args import held_value
from ..transport.session import Session
from .arguments import token_arguments
from .fencing import shard_headers
from .message import token_properties

#: How long a first-use token queue lives once nobody uses it (ms). Read at each
#: declaration, so a test may lower it in its own process.
EXPIRES_MS = NAME_EXPIRES_MS
def fresh_arguments(session: Session, stamp: int, quorum: bool = True) -> dict[str, Any]:
    """A first-use token queue's arguments: the token queue's, expiring, stamped."""
    return {**token_arguments(session, quorum), "x-expires": EXPIRES_MS, "x-max-length": stamp}


#: What :func:`create` found: it made the queue; found a first-use queue with our count;
#: found a queue made otherwise (an administrator's, with a ledger), whose count it
#: could not read.
Created = Literal["made", "found", "other"]


async def create(session: Session, name: str, permits: int = 1, quorum: bool = True) -> Created:
    """Make the first-use token queue of the token semaphore `name` with its `permits`
    tokens (ids 1..permits), unless a queue of that name exists: the stamped declaration
    and the tokens in one write (test-and-set). Raises LockError when the existing queue's
    stamp says another count."""
    queue = token_queue(name)
    messages = [
        (str(k).encode(), token_properties(name, k, shard_headers()))
        for k in range(1, permits + 1)
    ]
    try:
        await session.declare_and_publish(
            queue, fresh_arguments(session, new_stamp(permits), quorum), messages
        )
    except PreconditionFailed as exc:
        if "inequivalent arg" not in str(exc):
            raise
        stamp = held_value(str(exc), "x-max-length")
        if stamp is None or not is_stamp(stamp):
            return "other"
        if permits_of(stamp) != permits:
            raise mismatch(name, permits, permits_of(stamp)) from None
        return "found"
    return "made"


def mismatch(name: str, ours: int, theirs: int, how: str = "made on first use") -> LockError:
    return LockError(
        f"token semaphore {name!r} was {how} with {theirs} permit(s), not {ours}: every "
        "user of a name must give the same count"
    )


async def held_permits(session: Session, name: str) -> tuple[int, bool] | None:
    """(permit count, quorum) of the first-use queue of `name`, read from its stamp
    (`Session.held_max_length`); None when the queue is missing or is not a first-use
    queue of this release (made by `TokenAdmin.setup`, with a ledger)."""
    for quorum in (session.cluster, not session.cluster):  # a queue of either type
        try:
            stamp = await session.held_max_length(
                token_queue(name), fresh_arguments(session, 0, quorum)
            )
        except QueueNotFound:
            return None
        if stamp is not None:
            return (permits_of(stamp), quorum) if is_stamp(stamp) else None
    return None
