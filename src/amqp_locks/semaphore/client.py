"""Persistent semaphore, client side: acquire (the seed's 7 steps), verify, relinquish.

A semaphore `N` with `C` slots is the durable queues `A[1..C]` (`N-k-A`); slot k is held
while the exclusive queue `B[k]` (`N-k-B`) exists. Acquire, as the seed lays it out:

1. for L from 1, probe `A[L]`;                         2. missing: acquire fails;
3. probe `B[L]`;                                       4. exists: L += 1, go to 1;
5. declare `B[L]` exclusive;                           6. RESOURCE_LOCKED: new channel,
7. success: verify, return L (and a fencing token).       random skew, L = 1, go to 1.

Steps 1-4 run as *pipelined* probes: a window of `A` and `B` probes goes out at once and
the answers are read in order, so a search over k slots costs one round trip per window
(windows double, starting from the size last seen), not 2k round trips; quorum slots are
looked at their tombstones first, one more round trip (burial.py). Step 7's verification
is the consume on `A[L]` that also watches for the slot's removal (404 there: the slot
vanished, undo, retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from ..errors import (
    AccessRefused,
    AcquireRacesExceeded,
    ConfigurationError,
    ModeMismatch,
    ResourceLocked,
    SemaphoreNotFound,
)
from ..fencing import take_token
from ..held import HeldState
from ..holders import HolderQueries, Reading
from ..lease import Lease
from ..lockobject import LockObject
from ..names import (
    holder_queue,
    sentinel_queue,
    slot_queue,
    slot_tombstone,
    slots_name,
    token_queue,
    validate_name,
    wakeup_queue,
)
from ..queue_lease import LeaseState, grant
from ..transport.broker import BrokerCore, BrokerLike
from ..transport.session import Session
from ..waiting import Backoff, acquire_loop
from .burial import Look, look, still_there
from .cluster import acquire_slot
from .slots import first_window, read_semaphore, windows

log = logging.getLogger("amqp_locks.semaphore")

#: `B` queues drop every probe message, like `A` queues.
HOLDER_ARGS = {"x-max-length": 0}


async def semaphore_fence(state: LeaseState) -> int:
    """The semaphore's fencing token: the next value of its shared fence shard
    (fencing.py; a missing shard is made on the way)."""
    return await take_token(state.session, state.name)


async def _check_mode(session: Session, name: str) -> None:
    """A semaphore without slot queues may exist in cluster mode (semaphore/cluster.py):
    say so instead of "no slots" (a passive declare, on this error path only)."""
    queue = token_queue(slots_name(name))
    used = False
    with contextlib.suppress(AccessRefused):  # permissions cover only our queues
        used = await session.exists_passive(queue)
    if used:
        raise ModeMismatch(
            f"semaphore {name!r} was created in cluster mode ({queue!r} exists), but this "
            "Broker is in single-node mode: give it every node's URL (or cluster=True)"
        )


class _Race(Exception):
    """Step 6: another connection declared `B[L]` between our probe and our declare."""


async def _claim(
    core: BrokerCore, session: Session, name: str, k: int, seen: Look
) -> LeaseState | None:
    """Steps 5 and 7 for slot k, found free by `seen`: declare `B[k]`, watch `A[k]`/`B[k]`,
    take a fencing token.

    Returns None when `A[k]` vanished meanwhile; raises :class:`_Race` on RESOURCE_LOCKED.
    """
    if not await still_there(session, name, k, seen):
        return None
    b = holder_queue(name, k)
    a = slot_queue(name, k)
    session.held.add(b)
    state = LeaseState(
        core=core,
        session=session,
        kind="semaphore",
        name=name,
        number=k,
        held_queue=b,
        watch_queues=(a, b),
        must_exist=(a,),
        tombstone=slot_tombstone(name, k) if seen.quorum else None,
        notice_key=wakeup_queue(name, "sem"),
        sentinels=sentinel_queue(name, "sem"),
    )
    try:
        granted = await grant(state, HOLDER_ARGS, fence=semaphore_fence)
    except ResourceLocked:
        raise _Race(b) from None
    if not granted:
        log.info("slot %d of %r vanished during acquire", k, name)
        return None
    return state


async def claim_slot(core: BrokerCore, session: Session, name: str, k: int) -> LeaseState | None:
    """Hold slot k itself when it exists and is free (None when not): for tools that place
    holders at chosen slots (benchmarks/latency.py); ``acquire()`` searches instead."""
    seen = await look(session, name, [k], holders=True)
    if not seen.alive[0] or seen.held[0]:
        return None
    try:
        return await _claim(core, session, name, k, seen)
    except _Race:
        return None


async def try_acquire(
    core: BrokerCore,
    session: Session,
    name: str,
    *,
    max_races: int,
    race_skew: float,
    hint: int | None = None,
) -> LeaseState | None:
    """One pass of the seed's algorithm; None when every slot is held.

    `hint` is the slot a wake-up notice said was just freed: it is tried first (the seed
    allows starting anywhere), which spares the woken waiter the full search.
    """
    races = 0
    if hint is None:
        # The slot this process released last: likely free again, and (in a big, nearly
        # full semaphore) far cheaper to look at first than a search from slot 1.
        hint = session.slot_hints.get(name)
    if hint is not None and hint >= 1:
        seen = await look(session, name, [hint], holders=True)
        if seen.alive[0] and not seen.held[0] and holder_queue(name, hint) not in session.held:
            try:
                state = await _claim(core, session, name, hint, seen)
            except _Race:
                races += 1
            else:
                if state is not None:
                    return state
    while True:
        try:
            for window in windows(first_window(session, name)):
                ks = list(window)
                seen = await look(session, name, ks, holders=True)
                a_exists, b_exists = seen.alive, seen.held
                for i, k in enumerate(ks):
                    if not a_exists[i]:  # step 2
                        session.size_hints[name] = k - 1
                        if k == 1:
                            await _check_mode(session, name)
                            raise SemaphoreNotFound(
                                f"semaphore {name!r} has no slots ({slot_queue(name, 1)!r} does "
                                "not exist): create it with SemaphoreAdmin.create()"
                            )
                        return None
                    if b_exists[i] or holder_queue(name, k) in session.held:  # step 4
                        continue
                    state = await _claim(core, session, name, k, seen)  # steps 5, 7
                    if state is not None:
                        return state
                    return None  # A[k] vanished: the semaphore shrank under us
        except _Race as race:  # step 6
            races += 1
            if races > max_races:
                raise AcquireRacesExceeded(
                    f"semaphore {name!r}: lost {races} declare races in a row (last on "
                    f"{race.args[0]!r}); raise max_races or reduce contention"
                ) from None
            await asyncio.sleep(random.uniform(0, race_skew))


class PersistentSemaphore(LockObject, HolderQueries):
    """Client of the persistent semaphore `name` (created by :class:`SemaphoreAdmin`).

    ``max_races`` bounds the second-stage (RESOURCE_LOCKED) retries of one attempt,
    ``race_skew`` is the largest random pause after such a race, ``backoff`` the fallback
    polling while blocked (clean releases wake waiters at once). ``timeout`` / ``blocking``
    are what ``with sem as slot:`` waits (default: for ever); it raises
    :class:`~amqp_locks.errors.LockTimeout` when no slot was obtained.
    """

    kind = "semaphore"

    @staticmethod
    async def own_status(core: BrokerCore, name: str) -> Reading:
        reading = await read_semaphore(core, name)
        if reading is None:
            raise SemaphoreNotFound(f"semaphore {name!r} does not exist (no slots)")
        return reading

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        max_races: int = 16,
        race_skew: float = 0.02,
        backoff: Backoff | None = None,
    ) -> None:
        if max_races < 0:
            raise ConfigurationError(f"max_races must be >= 0, got {max_races}")
        if race_skew < 0:
            raise ConfigurationError(f"race_skew must be >= 0, got {race_skew}")
        self.broker = broker
        self.name = validate_name(name)
        self.max_races = max_races
        self.race_skew = race_skew
        self.backoff = backoff or Backoff()
        self._init_wait(blocking, timeout)

    async def _wait(self, blocking: bool, timeout: float | None) -> HeldState | None:
        core = self.broker.core
        if core.cluster:  # slots are quorum tokens (semaphore/cluster.py)
            return await acquire_slot(self.broker, self.name, blocking=blocking, timeout=timeout)
        return await acquire_loop(
            core,
            wakeup_queue(self.name, "sem"),
            sentinel_queue(self.name, "sem"),
            lambda s, hint: try_acquire(
                core, s, self.name, max_races=self.max_races, race_skew=self.race_skew, hint=hint
            ),
            blocking=blocking,
            timeout=timeout,
            backoff=self.backoff,
        )

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Lease | None:
        """Hold a slot: a :class:`Lease`, or None when not blocking / timed out.

        Raises :class:`SemaphoreNotFound` when the semaphore has no slots.
        """
        return super().acquire(blocking, timeout)
