"""First-use token queues: a binary token semaphore made by its first user, gone when unused.

Cluster mode's mutex `M` is the token semaphore `M.mutex` (mutex.py). Its queue is not set
up by an administrator: the first acquire that finds it missing (404) makes it, with no
administration mutex and no ledger, and the broker deletes it once nobody uses it.

- **Expiry.** The token queue is the usual quorum lock queue (`token_arguments`: delivery
  limit, consumer timeout, 4.3's consumer-disconnected timeout) plus ``x-expires``
  (:data:`EXPIRES_MS`, `features.NAME_EXPIRES_MS`). A queue is *used* while it has a
  consumer: a holder (its token unacked on its channel) or a waiter keeps it; a free token
  sitting ready does not. Measured on 3.10.8 and 4.3.6: an unused quorum queue holding a
  ready message is deleted 60.3-60.4 s after its last use with ``x-expires: 60000`` (with
  3 000 ms: 5-6 s; the broker checks on a timer), while one whose message is held stays;
  passive declares (status readers, the tests' polls) do not count as use.
- **Test-and-set.** ``x-max-length`` only counts ready messages, so "publish if the queue is
  empty" would let a second token in while the first is held. Instead each attempt declares
  with its own random ``x-max-length`` in [2**40, 2**62) (a *stamp*; no queue ever holds
  that many messages, so it limits nothing). RabbitMQ compares ``x-max-length`` when a queue
  is declared again and refuses a different value with 406 PRECONDITION_FAILED, so of all
  racers exactly one, the creator, gets its declaration accepted; every other one learns
  that the queue exists and simply waits (consumes). A queue made by the earlier release
  (`TokenAdmin.setup`: no ``x-expires``, a ledger) refuses our declaration the same way, and
  is used as it is.
- **Declaration and token in one write.** The creator sends the declaration and the
  publish of the one token (id 1, persistent, mandatory, confirmed) together
  (`Session.declare_and_publish`): the broker routes the publish right behind an accepted
  declaration and drops it behind a refused one (the channel is closed by the 406, and a
  closing channel discards what follows). So a loser's token never lands anywhere, and
  no client round trip separates the two; but they are not atomic (below).
- **Fencing.** The token carries no counter (`tokens.fencing.shard_headers`): each grant
  takes its fencing token from the lock's fence shard (`fencing.take_token`), after it
  holds the token, as a one-node mutex does. So tokens rise across the queue's
  incarnations whatever time passes between them, and stay near 2**51 (a BIGINT), where
  an epoch shifted by 32 bits would not.

Residual window (docs/cluster.md, "First use and expiry of a mutex"): the broker handles
the publish after the declaration, which makes a quorum queue (a raw quorum declaration's
time: 8-40 ms here); a creator whose connection ends meanwhile (it dies, is cut off, or its
node crashes) leaves the queue without its token: measured by aborting the connection 0-2
ms after the write, 39 of 40 times on 3.10.8, 40 of 40 on 4.3.6
(`benchmarks/first_use_facts.py`). Such a queue has no
token: waiters wait until their timeout, and the queue expires :data:`EXPIRES_MS` after the
last one left; the next user makes it again. `TokenAdmin("M.mutex").repair()` re-publishes
the missing token at once.
"""

from __future__ import annotations

import random
from typing import Any

from ..names import token_queue
from ..transport.features import NAME_EXPIRES_MS
from ..transport.session import Session
from .admin import token_arguments
from .fencing import shard_headers
from .message import token_properties

#: How long a first-use token queue lives once nobody uses it (ms). Read at each
#: declaration, so a test may lower it in its own process.
EXPIRES_MS = NAME_EXPIRES_MS
#: The stamps' range: far above any queue length, within AMQP's signed 64-bit integers.
STAMP_RANGE = (2**40, 2**62)
#: The id of a first-use queue's one token.
TOKEN_ID = 1

_random = random.SystemRandom()


def new_stamp() -> int:
    return _random.randrange(*STAMP_RANGE)


def fresh_arguments(session: Session, stamp: int) -> dict[str, Any]:
    """A first-use token queue's arguments: the token queue's, expiring, stamped."""
    return {**token_arguments(session, True), "x-expires": EXPIRES_MS, "x-max-length": stamp}


async def create(session: Session, name: str) -> bool:
    """Make the first-use token queue of the token semaphore `name` with its one token,
    unless someone else's queue of that name exists: the stamped declaration and the token
    in one write (test-and-set). True when we made it."""
    return await session.declare_and_publish(
        token_queue(name),
        fresh_arguments(session, new_stamp()),
        str(TOKEN_ID).encode(),
        token_properties(name, TOKEN_ID, shard_headers()),
    )
