"""Persistent semaphore, administration: every action under the administration mutex `N`.

- max: probe `A[1]`, `A[2]`, ... in order (pipelined windows); the first NO_ROUTE ends it.
- create C: declare `A[1..C]` in ascending order (a crash leaves a prefix, never a gap).
- destroy: delete `A[C..1]` in descending order, each after the previous delete-ok.
- add X: declare `A[C+1..C+X]`.  remove X: delete `A[C..max(0,C-X)+1]`, descending.
- overshoot T: also delete any `A` queue found in `C+1..C+T` (left by other tools, broker
  trouble, manual deletion).  ascending ("swiss cheese"): delete lowest first, so clients
  fail fast; the gaps it leaves are only safe with overshoot or expiry to prune them.
- holders / wait: probe `B` queues; after a slot is removed, its holder keeps it until it
  releases (the seed's largest limitation) - `wait_for_holders` polls until they have.
- quorum slots (``quorum=True``) have a marker, declared before the first slot and deleted
  after the last, and are buried before they are deleted (burial.py): every delete above
  waits BURY_GRACE (10 s) after the slots' tombstones. An action that finds tombstones a
  cut removal left finishes that removal (destroy, remove) or takes them back (create, add).

:class:`SemaphoreAdminCore` holds these actions as coroutines on the Broker's I/O loop;
:class:`SemaphoreAdmin` (sync) and `amqp_locks.aio.SemaphoreAdmin` only submit them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..admin_mutex import held_mutex
from ..errors import ConfigurationError, LockError, PreconditionFailed
from ..fencing import ensure_fence, repair_fence
from ..names import (
    MAX_SLOT_DIGITS,
    check_slot_number,
    fence_queue,
    fence_shard_lock,
    quorum_marker,
    slot_queue,
    slot_tombstone,
    validate_name,
    wakeup_queue,
)
from ..records import HOLDER_TIMEOUT
from ..replication import choose_quorum
from ..transport.broker import BrokerCore, BrokerLike
from ..transport.refusals import inequivalent
from ..transport.session import Session
from ..transport.shield import admin_deadline, answered
from ..waiting import Backoff, check_timeout
from . import burial
from .cluster import ClusterSlots
from .slots import find_max, held_slots, held_slots_among, survey

log = logging.getLogger("amqp_locks.semaphore.admin")

#: Slot queues drop every probe message (the seed's existence checks leave nothing behind).
SLOT_ARGS: dict[str, Any] = {"x-max-length": 0}
MAX_SLOTS = 10**MAX_SLOT_DIGITS - 1


def slot_arguments(quorum: bool) -> dict[str, Any]:
    return {**SLOT_ARGS, "x-queue-type": "quorum"} if quorum else dict(SLOT_ARGS)


def _count(x: int, what: str, minimum: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ConfigurationError(f"{what} must be an int, got {type(x).__name__}")
    if x < minimum:
        raise ConfigurationError(f"{what} must be >= {minimum}, got {x}")
    if x > MAX_SLOTS:
        raise ConfigurationError(f"{what} must be <= {MAX_SLOTS}, got {x}")
    return x


@dataclass(frozen=True)
class Removal:
    """What a destroy/remove did: slots deleted, found by overshoot, still held."""

    removed: tuple[int, ...]
    overshoot_removed: tuple[int, ...]
    still_held: tuple[int, ...]


class SemaphoreAdminCore:
    """The seed's admin actions on the persistent semaphore `name`, as coroutines on the
    Broker's I/O loop, each under the admin mutex. Both facades (:class:`SemaphoreAdmin`,
    `aio.SemaphoreAdmin`) only submit these: waiting for holders blocks no thread.

    Options: see :class:`SemaphoreAdmin`.
    """

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        mutex_timeout: float | None = 30.0,
        overshoot: int = 0,
        ascending: bool = False,
        quorum: bool | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.broker = broker
        self.name = validate_name(name)
        self.mutex_timeout = check_timeout(mutex_timeout)
        self.overshoot = _count(overshoot, "overshoot")
        self.ascending = ascending
        self.quorum = choose_quorum(broker, quorum, f"persistent semaphore {name!r}")
        self.backoff = backoff or Backoff()
        #: Cluster mode: the slots are tokens of a quorum queue (semaphore/cluster.py).
        self._cluster = (
            ClusterSlots(broker, self.name, self.mutex_timeout) if broker.core.cluster else None
        )

    # --- plumbing -----------------------------------------------------------------------

    @property
    def _core(self) -> BrokerCore:
        return self.broker.core

    @contextlib.asynccontextmanager
    async def _mutex(self) -> AsyncIterator[Session]:
        """Hold the admin mutex `N`; yields the session that holds it."""
        async with held_mutex(self._core, self.name, self.mutex_timeout, self.backoff) as m:
            yield m.session

    async def _survey(self, session: Session) -> tuple[int, tuple[int, ...], bool]:
        """(C, slots a cut removal left buried, whether the slots are quorum queues),
        marking quorum slots made before markers existed (:meth:`_unmarked_quorum`)."""
        c, buried, quorum = await survey(session, self.name)
        if not quorum and c:
            quorum = await self._unmarked_quorum(session, c)
        return c, buried, quorum

    async def _unmarked_quorum(self, session: Session, c: int) -> bool:
        """Whether slots without a marker are quorum queues (made by an earlier version):
        re-declaring the top one as a classic queue is refused on ``x-queue-type``. Such
        slots get their marker now, so clients look at their tombstones before touching
        them."""
        try:
            await session.declare(
                slot_queue(self.name, c), durable=True, arguments=slot_arguments(False)
            )
        except PreconditionFailed as exc:
            refusal = inequivalent(exc)
            if refusal is None or refusal.arg != "x-queue-type":
                raise
            await self._mark(session)
            log.warning("semaphore %r has quorum slots without a marker: marked", self.name)
            return True
        return False

    async def _mark(self, session: Session) -> None:
        await session.declare(
            quorum_marker(self.name), durable=True, arguments=burial.TOMBSTONE_ARGS
        )
        session.quorum_slots[self.name] = True

    async def _delete_slots(self, session: Session, ks: Sequence[int], quorum: bool) -> None:
        """Delete `A[k]` for ks in the given order, each after the previous delete-ok;
        quorum slots are buried BURY_GRACE first (burial.py) and their tombstones go last."""
        if quorum and ks:
            for k in ks:
                await session.declare(
                    slot_tombstone(self.name, k), durable=True, arguments=burial.TOMBSTONE_ARGS
                )
            log.info(
                "buried slots %s of %r: deleting them in %.1f s",
                list(ks),
                self.name,
                burial.BURY_GRACE,
            )
            await asyncio.sleep(burial.BURY_GRACE)
        for k in ks:
            await session.delete(slot_queue(self.name, k))
            log.info("deleted slot queue %r", slot_queue(self.name, k))
        if quorum:
            for k in ks:
                await session.delete(slot_tombstone(self.name, k))

    async def _unbury(self, session: Session, buried: Sequence[int], ks: Sequence[int]) -> None:
        """Take back the tombstones a cut removal left on slots `ks` (declared again)."""
        back = sorted(set(buried) & set(ks))
        for k in back:
            await session.delete(slot_tombstone(self.name, k))
        if back:
            log.warning(
                "slots %s of %r had tombstones a cut removal left: taken back", back, self.name
            )

    async def _strays(self, session: Session, c: int, t: int) -> list[int]:
        """The `A` queues found in C+1..C+T (overshoot), descending."""
        if t <= 0:
            return []
        ks = list(range(c + 1, min(c + t, MAX_SLOTS) + 1))
        found = await session.probe([slot_queue(self.name, k) for k in ks])
        stray = sorted((k for k, e in zip(ks, found, strict=True) if e), reverse=True)
        if stray:
            log.warning("overshoot deletes stray slot queues %s of %r", stray, self.name)
        return stray

    async def _declare_slots(self, session: Session, ks: Sequence[int]) -> None:
        args = slot_arguments(self.quorum)
        if self.quorum and ks:  # the marker before any quorum slot
            await self._mark(session)
        for k in ks:
            await session.declare(slot_queue(self.name, k), durable=True, arguments=args)

    def _notify(self, session: Session, slots: Sequence[int]) -> None:
        """Wake one waiter per new slot (at most 64), each told which slot to try."""
        session.notify_soon(wakeup_queue(self.name, "sem"), list(slots)[:64])

    # --- the seed's actions (documented on SemaphoreAdmin) ------------------------------

    async def max_slots(self) -> int:
        if self._cluster is not None:
            return await self._cluster.max_slots()
        async with self._mutex() as session:
            return await find_max(session, self.name)

    async def create(self, slots: int) -> int:
        slots = _count(slots, "slots", minimum=1)
        if self._cluster is not None:
            return await self._cluster.create(slots)
        async with self._mutex() as session:
            c, buried, quorum = await survey(session, self.name)
            if c not in (0, slots):
                raise LockError(
                    f"semaphore {self.name!r} already exists with {c} slots; "
                    "use add_slots()/remove_slots() to change it"
                )
            # Re-declaring existing slots is idempotent and checks their arguments (406).
            await self._declare_slots(session, range(1, slots + 1))
            if quorum and not self.quorum:  # a marker a cut quorum destroy left
                await session.delete(quorum_marker(self.name))
                session.quorum_slots[self.name] = False
            await self._unbury(session, buried, range(1, slots + 1))
            stray = await self._strays(session, slots, self.overshoot)
            await self._delete_slots(session, stray, self.quorum or quorum)
            await ensure_fence(session, self.name)
            self._notify(session, range(1, slots + 1))
            log.info("created semaphore %r with %d slots", self.name, slots)
            return slots

    async def destroy(self, *, purge_fence: bool = False) -> Removal:
        if self._cluster is not None:
            removed, still = await self._cluster.destroy()
            return Removal(removed, (), still)
        async with self._mutex() as session:
            c, buried, quorum = await self._survey(session)
            extra = await self._strays(session, c, self.overshoot)
            order = range(1, c + 1) if self.ascending else range(c, 0, -1)
            await self._delete_slots(session, _leftovers(extra, buried, order), quorum)
            if quorum:
                await session.delete(quorum_marker(self.name))
                session.quorum_slots[self.name] = False
            if purge_fence:
                await session.delete(fence_queue(self.name))
                session.fences_known.discard(fence_queue(self.name))
            held = await held_slots(session, self.name, c + self.overshoot)
            log.info("destroyed semaphore %r (%d slots)", self.name, c)
            return Removal(tuple(order), tuple(extra), tuple(held))

    async def add_slots(self, count: int) -> int:
        count = _count(count, "count", minimum=1)
        if self._cluster is not None:
            return await self._cluster.add_slots(count)
        async with self._mutex() as session:
            c, buried, quorum = await survey(session, self.name)
            if c == 0:
                raise LockError(f"semaphore {self.name!r} does not exist; create() it first")
            stray = await self._strays(session, c, self.overshoot)
            await self._delete_slots(session, stray, quorum)
            # Re-declaring the top slot with our arguments refuses (406) to mix classic and
            # quorum slots in one semaphore.
            await self._declare_slots(session, [c])
            if c + count > MAX_SLOTS:
                raise ConfigurationError(f"at most {MAX_SLOTS} slots, asked for {c + count}")
            await self._declare_slots(session, range(c + 1, c + count + 1))
            await self._unbury(session, buried, range(c + 1, c + count + 1))
            self._notify(session, range(c + 1, c + count + 1))
            log.info("added %d slots to %r: now %d", count, self.name, c + count)
            return c + count

    async def remove_slots(self, count: int, *, wait: float | None = 0) -> Removal:
        count = _count(count, "count", minimum=1)
        wait = check_timeout(wait) if wait is not None else None
        if self._cluster is not None:
            return Removal(await self._cluster.remove_slots(count, wait), (), ())
        # wait=0 waits for nothing: the body then has what is left of the admin mutex's
        # bound (none when mutex_timeout is None). Quorum slots wait for their burial too.
        bound = wait if self.mutex_timeout is not None else (wait or None)
        if bound is not None and self.quorum:
            bound += burial.BURY_GRACE
        deadline = admin_deadline(self.mutex_timeout, bound)
        async with self._mutex() as session:
            what = f"remove_slots of {self.name!r}"
            return await answered(self._remove(session, count, wait), bound, deadline, what)

    async def _remove(self, session: Session, count: int, wait: float | None) -> Removal:
        c, buried, quorum = await self._survey(session)
        extra = await self._strays(session, c, self.overshoot)
        doomed = list(range(c, max(0, c - count), -1))
        if self.ascending:
            doomed.reverse()
        await self._delete_slots(session, _leftovers(extra, buried, doomed), quorum)
        held = await held_slots_among(session, self.name, doomed)
        if held and wait != 0:
            held = await self._wait(session, held, wait)
        log.info("removed slots %s of %r; still held: %s", doomed, self.name, held)
        return Removal(tuple(doomed), tuple(extra), tuple(held))

    async def holders(self, *, beyond: int = 0) -> list[int]:
        beyond = _count(beyond, "beyond")
        if self._cluster is not None:
            return await self._cluster.holders()
        async with self._mutex() as session:
            c = await find_max(session, self.name)
            return await held_slots(session, self.name, c + beyond)

    async def wait_for_holders(
        self, slots: Sequence[int], timeout: float | None = None, *, interval: float = 0.1
    ) -> list[int]:
        timeout = check_timeout(timeout)
        if interval <= 0:
            raise ConfigurationError(f"interval must be > 0, got {interval}")
        wanted = [check_slot_number(k) for k in slots]
        what = f"wait_for_holders of {self.name!r}"
        if self._cluster is not None:
            polls = self._cluster.wait_for_holders(wanted, timeout, interval)
            # Its last round may start at the deadline and ask the holders for as long.
            bound = None if timeout is None else timeout + HOLDER_TIMEOUT
            return await answered(polls, bound, None, what)
        deadline = admin_deadline(self.mutex_timeout, timeout)
        async with self._mutex() as session:
            polls = self._wait(session, wanted, timeout, interval)
            return await answered(polls, timeout, deadline, what)

    async def _wait(
        self, session: Session, slots: Sequence[int], timeout: float | None, interval: float = 0.1
    ) -> list[int]:
        """Probe the `B` queues of `slots` every `interval` (an asyncio sleep on the I/O
        loop) until none exists or `timeout` passes; returns those still held."""
        deadline = None if timeout is None else time.monotonic() + timeout
        held = list(slots)
        while held:
            held = await held_slots_among(session, self.name, held)
            if not held or (deadline is not None and time.monotonic() >= deadline):
                break
            await asyncio.sleep(interval)
        return held

    async def repair_fence(self, base: int) -> bool:
        if isinstance(base, bool) or not isinstance(base, int) or base < 0:
            raise ConfigurationError(f"base must be an int >= 0, got {base!r}")
        if self._cluster is not None:
            raise self._cluster.no_fence()
        # The shard is shared by many locks: its own lock keeps two rebuilds from making
        # two counters.
        shard = fence_shard_lock(self.name)
        async with held_mutex(self._core, shard, self.mutex_timeout, self.backoff) as m:
            return await repair_fence(m.session, self.name, base)


def _leftovers(extra: Sequence[int], buried: Sequence[int], doomed: Sequence[int]) -> list[int]:
    """What a removal deletes, in order: the strays overshoot found and the slots a cut
    removal left buried (above the end, descending), then `doomed` in its order."""
    above = sorted(set(extra) | set(buried), reverse=True)
    return above + [k for k in doomed if k not in above]


class SemaphoreAdmin:
    """Administer the persistent semaphore `name`; every method holds its admin mutex.

    ``mutex_timeout`` bounds the wait for the mutex (:class:`AdminLockTimeout` after it),
    ``overshoot`` and ``ascending`` are the seed's options, ``quorum`` makes slot queues
    quorum queues (replicated; for clusters), decided at create time. The sync facade of
    :class:`SemaphoreAdminCore` (`amqp_locks.aio.SemaphoreAdmin` is the asyncio one).
    """

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        mutex_timeout: float | None = 30.0,
        overshoot: int = 0,
        ascending: bool = False,
        quorum: bool | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self._ops = SemaphoreAdminCore(
            broker,
            name,
            mutex_timeout=mutex_timeout,
            overshoot=overshoot,
            ascending=ascending,
            quorum=quorum,
            backoff=backoff,
        )
        self.broker = broker
        self.name = self._ops.name

    @property
    def _core(self) -> BrokerCore:
        return self.broker.core

    def max_slots(self) -> int:
        """The semaphore's number of slots C (0 if it does not exist)."""
        return self._core.run(self._ops.max_slots())

    def create(self, slots: int) -> int:
        """Create `A[1..slots]` (and its fence shard if missing). Idempotent for the same count;
        a semaphore that exists with another count is refused. Returns the count."""
        return self._core.run(self._ops.create(slots))

    def destroy(self, *, purge_fence: bool = False) -> Removal:
        """Delete every slot queue (descending unless ``ascending``); holders keep their
        `B` queues until they release (their ``verify()`` fails and ``lost`` is set).

        Its fence is a shared shard, kept, so tokens stay monotonic if the name is reused;
        ``purge_fence`` deletes a per-name `N-fence` an earlier release left."""
        return self._core.run(self._ops.destroy(purge_fence=purge_fence))

    def add_slots(self, count: int) -> int:
        """Add `count` slots; returns the new C. Waiters are woken."""
        return self._core.run(self._ops.add_slots(count))

    def remove_slots(self, count: int, *, wait: float | None = 0) -> Removal:
        """Remove `count` slots (down to max(0, C - count)), descending unless ``ascending``.

        Holders of removed slots are not interrupted: their leases are marked lost and they
        must release. ``wait`` > 0 polls up to that long for them to do so (None: forever).
        Quorum slots are buried 10 s before their delete (burial.py): the call takes that
        much longer.
        """
        return self._core.run(self._ops.remove_slots(count, wait=wait))

    def holders(self, *, beyond: int = 0) -> list[int]:
        """Slot numbers currently held (`B` exists), in 1..C+beyond; ``beyond`` finds
        holders of slots removed earlier."""
        return self._core.run(self._ops.holders(beyond=beyond))

    def wait_for_holders(
        self, slots: Sequence[int], timeout: float | None = None, *, interval: float = 0.1
    ) -> list[int]:
        """Poll the `B` queues of `slots` until none exists or `timeout` passes; returns
        the slots still held (empty: all relinquished)."""
        return self._core.run(self._ops.wait_for_holders(slots, timeout, interval=interval))

    def repair_fence(self, base: int) -> bool:
        """Rebuild the fencing counter of this lock's shard if it was deleted by hand (its
        marker exists, no generation does: grants raise FenceMissing until then), with every
        token above `base`: the highest token any resource accepted from a lock of that
        shard (the floor). A counter that only lost its message needs nothing: the library
        heals it (fencing.py). Returns whether it was rebuilt."""
        return self._core.run(self._ops.repair_fence(base))

    def __repr__(self) -> str:
        return f"SemaphoreAdmin({self.name!r})"
