"""The exclusive-queue mutex `N`: the seed's administration mutex, and ``Mutex`` on one node.

Declaring the exclusive queue `N` succeeds for exactly one connection at a time; the others
get 405 RESOURCE_LOCKED (costing only a channel). The broker deletes the queue when the
holder's connection closes or dies, which is what releases a crashed holder. This is the
same lock as a persistent semaphore's administration mutex of that name: holding
``Mutex(broker, "images")`` blocks ``SemaphoreAdmin(broker, "images")`` and vice versa.

Two acquires through one Broker share its connection, for which re-declaring its own
exclusive queue would succeed; the session's ``held`` set makes the second one wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from .errors import AdminLockTimeout, PreconditionFailed, QueueNotFound, ResourceLocked
from .fencing import take_token
from .names import mutex_queue, sentinel_queue, wakeup_queue
from .queue_lease import LeaseState, grant
from .transport.broker import BrokerCore
from .transport.session import Session
from .transport.shield import CUT_SETTLE, settled_within, within
from .waiting import Backoff, acquire_loop


async def mutex_held(session: Session, name: str) -> bool | None:
    """True: the exclusive queue `name` is held by a connection; False: it exists unheld
    (a queue that is not a mutex); None: no such queue (the mutex is free)."""
    queue = mutex_queue(name)
    if queue in session.held:  # held through this very connection (the declare would pass)
        return True
    try:
        await session.declare_passive_counts(queue)
    except ResourceLocked:
        return True
    except QueueNotFound:
        return None
    return False


async def mutex_fence(state: LeaseState) -> int:
    """The mutex's fencing token: the next value of its shared fence shard (fencing.py)."""
    return await take_token(state.session, state.name)


async def try_mutex(
    core: BrokerCore, session: Session, name: str, *, fencing: bool
) -> LeaseState | None:
    """One attempt: declare `N` exclusive; None if someone (maybe this process) holds it."""
    queue = mutex_queue(name)
    if queue in session.held:
        return None
    session.held.add(queue)
    state = LeaseState(
        core=core,
        session=session,
        kind="mutex",
        name=name,
        number=1,
        held_queue=queue,
        watch_queues=(queue,),
        must_exist=(),
        notice_key=wakeup_queue(name, "mutex"),
        sentinels=sentinel_queue(name, "mutex"),
    )
    try:
        granted = await grant(state, None, fence=mutex_fence if fencing else None)
    except ResourceLocked:
        if await session.exists_passive(queue):
            # We may use it, so it is not another connection's exclusive queue.
            raise PreconditionFailed(
                f"queue {queue!r} exists but is not exclusive, so it can never be locked; "
                "delete it or choose another lock name",
                queue,
            ) from None
        return None
    if not granted:  # deleted by someone between our declare and our consume
        return None
    return state


async def acquire_mutex(
    core: BrokerCore,
    name: str,
    *,
    blocking: bool,
    timeout: float | None,
    fencing: bool,
    backoff: Backoff,
) -> LeaseState | None:
    return await acquire_loop(
        core,
        wakeup_queue(name, "mutex"),
        sentinel_queue(name, "mutex"),
        lambda s, _hint: try_mutex(core, s, name, fencing=fencing),
        blocking=blocking,
        timeout=timeout,
        backoff=backoff,
    )


async def _release(state: LeaseState | None) -> None:
    if state is not None:
        await state.release()


@contextlib.asynccontextmanager
async def held_mutex(
    core: BrokerCore, name: str, timeout: float | None, backoff: Backoff
) -> AsyncIterator[LeaseState]:
    """Hold the mutex for a block (the administration mutex uses this). The wait for it
    ends within `timeout` + 1 s even when the broker stops answering (`within`)."""
    state = await within(
        acquire_mutex(core, name, blocking=True, timeout=timeout, fencing=False, backoff=backoff),
        timeout,
        _release,
        # No connection at all is "broker down", never "another administrator holds it".
        cut=lambda: core.unconnected_error(timeout or 0.0, f"administration mutex {name!r}"),
    )
    if state is None:
        raise AdminLockTimeout(
            f"administration mutex {name!r} is held by another administrator; gave up after "
            f"{timeout}s"
        )
    try:
        yield state
    finally:
        # Its caller is answered within CUT_SETTLE even if the broker does not answer the
        # delete (the release goes on; a connection that stays silent is dropped by the
        # watchdog, which frees the mutex with it).
        await settled_within(state.release(), CUT_SETTLE)
