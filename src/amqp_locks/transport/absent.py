"""A declaration caught between two dirty reads: RabbitMQ's 404 "absent" for a queue that
exists, and the bounded retry every racing declaration of a shared queue goes through."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiormq.exceptions import ChannelNotFoundEntity

from ..errors import QueueNotFound

log = logging.getLogger("amqp_locks.transport")
T = TypeVar("T")

#: How long a declaration the broker answered with 404 is tried again (s).
ABSENT_WAIT = 2.0
#: How often it is asked (s).
ABSENT_POLL = 0.02


async def while_absent(queue: str, declaration: Callable[[], Awaitable[T]]) -> T:
    """Run the (non-passive) `declaration` of `queue`, again while the broker answers
    404 "absent", for at most :data:`ABSENT_WAIT` seconds. A declaration makes a
    missing queue, so its 404 means the queue's record was caught half written: the
    channel looks the queue up by two dirty reads, the live table and then the durable
    one (``rabbit_amqqueue:not_found_or_absent_dirty``, read in 3.10.8, 4.0.5 and
    4.3.4: "the chances of an inconsistency are small, and only affect the error
    kind"), and a creation (or delete) committed between them reads as "home node ...
    of durable queue ... is down or inaccessible". Seen once, in CI on 4.0.5: one of 4
    clients racing to make a first-use token queue got it (never met by 10,000 raw
    racing declarations, idle and loaded). Asked again, the declaration finds the queue
    made (406 to a loser of the test-and-set) or makes it.
    A queue whose home node is really down (a classic queue in a cluster) still
    raises its 404 (QueueNotFound, naming it, or aiormq's ChannelNotFoundEntity where the
    caller maps errors itself) after :data:`ABSENT_WAIT`. The declaration opens a
    channel of its own or goes through the session's pool: the 404 closed the one it
    used."""
    deadline = time.monotonic() + ABSENT_WAIT
    while True:
        try:
            return await declaration()
        except (QueueNotFound, ChannelNotFoundEntity) as exc:
            if time.monotonic() >= deadline:
                raise
            log.debug("declaring %r: %s; asking again", queue, exc)
        await asyncio.sleep(ABSENT_POLL)
