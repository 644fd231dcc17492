"""Mutex: one holder at a time, cluster-wide.

On one node (the seed's protocol) the mutex `N` is the exclusive queue `N`, the same lock
as a persistent semaphore's administration mutex of that name (admin_mutex.py): holding
``Mutex(broker, "images")`` blocks ``SemaphoreAdmin(broker, "images")`` and vice versa.

In cluster mode an exclusive queue cannot carry the lock: on a Khepri cluster (RabbitMQ
4.2+) a dead node's exclusive queues stay until the node returns, so the lock would stay
held. There the mutex is a binary token semaphore on the quorum queue ``N.mutex.semaphore``
(tokens/): one token, held unacked by its holder, returned by the broker when the holder
releases, dies or its node is lost, and pushed to the next waiter. Nobody sets it up: the
acquire that finds the queue missing makes it, with its one token, by a test-and-set
declaration (no administration mutex, no ledger), and the broker deletes it a minute after
its last holder or waiter left (tokens/fresh.py). A creator whose connection ends while the
broker makes the queue leaves it without its token: waiters then wait until their timeout,
and `TokenAdmin(broker, "N.mutex").repair()` gives it back (tokens/fresh.py, "Residual
window"). Its fencing token is taken, per grant, from the
lock's fence shard (fencing.py) on a pooled prefetch-1 channel: one round trip after the
token's delivery when warm, no channel opened (tests/test_round_trips.py), and it keeps rising when
the queue expires and is made again, which a count carried by the token (restarting with
a new message) could not promise without a fence read at each creation. A queue set up by
the earlier release (``TokenAdmin.setup``, with a ledger) is used as it is: its tokens
carry their own count above an epoch, no fence read per grant. Every connection's quorum
guard (transport/quorum_guard.py) tells a holder cut off from the majority before the
majority can grant the token again.
"""

from __future__ import annotations

import asyncio

from .admin_mutex import acquire_mutex, mutex_held
from .errors import AccessRefused, ConnectionLost, ModeMismatch
from .held import HeldState
from .holders import HOLDER_TIMEOUT, HolderQueries, HolderRecord, Reading, pick_holder
from .lockobject import LockObject
from .names import quorum_mutex_name, token_queue, validate_name
from .records import LockStatus
from .tokens.client import TokenSemaphore
from .tokens.ledger import first_use_ledger, read_token_as
from .transport.broker import BrokerCore, BrokerLike
from .waiting import Backoff


async def read_mutex(core: BrokerCore, name: str) -> Reading | None:
    """Mutex `name` as a lock status (None: no such queue, a free mutex). On one node an
    existing but unheld queue `name` reads as a free mutex: it is not one."""
    if core.cluster:  # a first-use queue has no ledger: one permit
        wire = quorum_mutex_name(name)
        return await read_token_as(core, name, "mutex", wire, first_use_ledger())
    held = await mutex_held(await core.session(), name)
    if held is None:
        return None
    return Reading(LockStatus(name, "mutex", 1, int(held), 1 - int(held)))


class Mutex(LockObject, HolderQueries):
    """A distributed mutex: the exclusive queue `name` on one node, a quorum token in
    cluster mode (see the module docstring).

    ``fencing=True`` (default) gives every grant a fencing token that rises strictly (one
    node and cluster mode alike: from the lock's fence shard, fencing.py). ``backoff``
    bounds the fallback polling for crashed holders on one node; clean releases wake
    waiters at once. ``timeout`` / ``blocking`` are what
    ``with mutex as lease:`` waits (default: for ever); it raises
    :class:`~amqp_locks.errors.LockTimeout` when the mutex was not obtained.
    """

    kind = "mutex"
    reentrant_with = False

    @staticmethod
    async def own_status(core: BrokerCore, name: str) -> Reading:
        return await read_mutex(core, name) or Reading(LockStatus(name, "mutex", 1, 0, 1))

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        fencing: bool = True,
        backoff: Backoff | None = None,
    ) -> None:
        self.broker = broker
        self.name = validate_name(name)
        self.fencing = fencing
        self.backoff = backoff or Backoff()
        self._init_wait(blocking, timeout)
        #: Cluster mode's binary token semaphore (None on one node).
        self._token: TokenSemaphore | None = None
        if broker.core.cluster:
            self._token = TokenSemaphore(
                broker, quorum_mutex_name(self.name), quorum=True, fencing=fencing, first_use=True
            )
            self._token.as_mutex(f"Mutex {self.name!r}")

    async def _wait(self, blocking: bool, timeout: float | None) -> HeldState | None:
        if self._token is None:
            # The mode check (a passive declare, once per name and connection) overlaps
            # the acquire instead of coming before it: a name's first acquire pays one
            # round trip less. A grant made while the check fails is given back.
            check = asyncio.ensure_future(self._check_mode())
            acquire = asyncio.ensure_future(
                acquire_mutex(
                    self.broker.core,
                    self.name,
                    blocking=blocking,
                    timeout=timeout,
                    fencing=self.fencing,
                    backoff=self.backoff,
                )
            )
            handed = False
            try:
                await asyncio.wait({check, acquire}, return_when=asyncio.FIRST_EXCEPTION)
                if check.done() and check.exception() is not None:
                    acquire.cancel()  # a cancelled acquire undoes a grant half made
                    await asyncio.gather(acquire, return_exceptions=True)
                    check.result()  # raises ModeMismatch (or the check's error)
                state = await acquire
                await check
                handed = True
                return state
            finally:
                for task in (check, acquire):
                    if not task.done():
                        task.cancel()
                if not handed and acquire.done() and not acquire.cancelled():
                    granted = acquire.exception() is None and acquire.result()
                    if granted:  # granted, but the check failed or we were cancelled
                        await asyncio.shield(granted.release())
        # A missing queue is made on first use (tokens/fresh.py).
        return await self._token.wait_permit(blocking, timeout)

    async def _check_mode(self) -> None:
        """Once per connection: refuse a mutex that cluster-mode clients hold as a token
        (they and we would not exclude each other). One passive declare, never a probe
        publish: a message routed into a token queue could be taken for a token."""
        queue = token_queue(quorum_mutex_name(self.name))
        while True:
            session = await self.broker.core.session()
            if self.name in session.modes_checked:
                return
            try:
                used = await session.exists_passive(queue)
                break
            except AccessRefused:  # permissions cover only our own queues: cannot tell
                used = False
                break
            except ConnectionLost:
                # The acquire beside us waits on a new connection (or gives up within its
                # timeout, as `within` bounds both); the check goes with it.
                continue
        if used:
            raise ModeMismatch(
                f"mutex {self.name!r} is used in cluster mode ({queue!r} exists), but this "
                "Broker is in single-node mode: both kinds of client could hold it at once. "
                "Give this Broker every node's URL (or cluster=True)"
            )
        session.modes_checked.add(self.name)

    def holder(self, timeout: float = HOLDER_TIMEOUT) -> HolderRecord | None:
        """Who holds the mutex: None when it is free; a record with ``holder_id=None``
        when it is held but the holder did not answer within `timeout` seconds (frozen,
        cut off, or without holder records). One passive declare, then one query."""
        return pick_holder(self.holders(timeout))
