"""Token semaphore, administration: setup, add/remove permits, status, audit, repair,
destroy. Every action but `status` holds the administration mutex `N`.

:class:`TokenAdminCore` holds the operations as coroutines run on the Broker's I/O loop;
:class:`TokenAdmin` is its sync facade and `amqp_locks.aio.TokenAdmin` its asyncio one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from ..admin_mutex import held_mutex
from ..errors import ConfigurationError, LockError
from ..fencing import ensure_name_fence, fence_arguments
from ..names import fence_queue, quorum_mutex_name, token_queue, validate_name
from ..replication import choose_quorum
from ..shape import MUTEX, SEMAPHORE, shape_headers
from ..transport.broker import BrokerCore, BrokerLike
from ..transport.channel_ops import publish_all
from ..transport.features import cancels_reach_holders, min_lock_delay_ms
from ..transport.line_args import DISCONNECTED
from ..transport.session import Session
from ..transport.shield import admin_deadline, answered
from ..waiting import Backoff, check_timeout
from . import fresh
from .arguments import token_arguments
from .drain import collect, drain
from .fencing import mint_headers, shard_headers
from .ledger import (
    Audit,
    Ledger,
    TokenStatus,
    audit_of,
    first_use_ledger,
    ledger_queue,
    read_ledger_settled,
    read_status,
    require_ledger,
    write_ledger,
)
from .message import token_properties
from .shapes import read_token_shape

log = logging.getLogger("amqp_locks.tokens")

#: How long an admin call waits for the administration mutex by default (seconds).
MUTEX_TIMEOUT = 30.0


async def declare_queues(session: Session, name: str, quorum: bool) -> None:
    """Declare the token queue and, if missing, the ledger."""
    await session.declare(
        token_queue(name),
        durable=True,
        arguments=token_arguments(session, quorum),
        min_delay_ms=min_lock_delay_ms(session),
    )
    # A quorum semaphore's ledger is replicated too, or losing its node would stop
    # status/audit/admin. An existing ledger is kept whatever its type.
    ledger = ledger_queue(name)
    if not await session.exists_passive(ledger):
        args = fence_arguments(session) if quorum else None
        await session.declare(ledger, durable=True, arguments=args)


def _resizable(ledger: Ledger, name: str) -> Ledger:
    """A first-use queue's count is fixed by its stamp (tokens/fresh.py): refuse to change it."""
    if ledger.first_use:
        raise LockError(
            f"token semaphore {name!r} was made on first use with {ledger.permits} "
            "permit(s), a count its users give and its queue's stamp fixes: give the new "
            "count under a new name (the old queue expires once unused)"
        )
    return ledger


async def publish_tokens(
    session: Session,
    name: str,
    ids: list[int],
    quorum: bool,
    first_use: bool = False,
    kind: str = SEMAPHORE,
    permits: int | None = None,
) -> None:
    """Publish tokens `ids` (persistent, mandatory, confirmed, all in flight at once).
    A first-use queue's tokens take their fencing tokens from the shard (tokens/fresh.py):
    no per-name fence is made for them. Each says its queue's shape (shape.py): `kind`,
    `permits` (None: a set-up semaphore, whose count is its ledger's) and the lock delay
    the queue was declared with, read from the queue."""
    queue = token_queue(name)
    if first_use:
        headers = shard_headers()
    else:
        await ensure_name_fence(session, name)
        headers = await mint_headers(session, name, quorum)
    _, delay = await read_token_shape(session, name, need_delay=quorum)
    held = {} if delay is None else {DISCONNECTED: delay}
    headers = {**headers, **shape_headers(kind, permits, held)}

    tokens = [(str(i).encode(), token_properties(name, i, headers)) for i in ids]
    await session.call(queue, lambda ch: publish_all(ch, queue, tokens))


def _positive(x: int, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ConfigurationError(f"{what} must be an int >= 1, got {x!r}")
    return x


class TokenAdminCore:
    """The admin operations of the token semaphore `name`, as coroutines on the I/O loop.

    Both facades (:class:`TokenAdmin`, `aio.TokenAdmin`) only submit these, so neither
    re-implements a step nor blocks a thread while a drain or audit waits.
    """

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        quorum: bool | None = None,
        mutex_timeout: float | None = MUTEX_TIMEOUT,
        first_use: bool | None = None,
        kind: str | None = None,
    ) -> None:
        self.broker = broker
        self.name = validate_name(name, admin=True)
        self.quorum = choose_quorum(broker, quorum, f"token semaphore {name!r}")
        self.mutex_timeout = check_timeout(mutex_timeout)
        if first_use is None:  # cluster mode's mutexes are made on first use (mutex.py)
            first_use = self.name.endswith(quorum_mutex_name(""))
        #: The kind its tokens say (shape.py): a mutex's, the slots of cluster mode's
        #: semaphore (semaphore/cluster.py), or a token semaphore's.
        self.kind = kind or (MUTEX if first_use else SEMAPHORE)
        #: What status/audit/repair take for the ledger of a first-use queue, which has
        #: none (tokens/fresh.py); None: a semaphore without a ledger is not set up.
        self.default_ledger = first_use_ledger() if first_use else None

    @property
    def _core(self) -> BrokerCore:
        return self.broker.core

    @contextlib.asynccontextmanager
    async def _mutex(self) -> AsyncIterator[Session]:
        """Hold the administration mutex `N`; yields the session that holds it."""
        async with held_mutex(self._core, self.name, self.mutex_timeout, Backoff()) as m:
            yield m.session

    async def setup(self, permits: int) -> int:
        """See :meth:`TokenAdmin.setup`."""
        permits = _positive(permits, "permits")
        async with self._mutex() as session:
            await declare_queues(session, self.name, self.quorum)
            ledger = await self._existing_ledger(session)
            if ledger is not None:
                if ledger.permits != permits:
                    raise LockError(
                        f"token semaphore {self.name!r} already has {ledger.permits} permits; "
                        "use add_permits()/remove_permits() to change it"
                    )
                return permits
            ids = list(range(1, permits + 1))
            await publish_tokens(session, self.name, ids, self.quorum, kind=self.kind)
            await write_ledger(session, self.name, Ledger(0, [], self.quorum).with_ids(ids))
            log.info("set up token semaphore %r with %d permits", self.name, permits)
            return permits

    async def _existing_ledger(self, session: Session) -> Ledger | None:
        """The ledger, or None for a semaphore that has no tokens yet: publishing again
        after a read that found none while another reader held the record would double
        the permits (`read_ledger_settled`)."""
        return await read_ledger_settled(session, self.name)

    async def add_permits(self, count: int) -> list[int]:
        """See :meth:`TokenAdmin.add_permits`."""
        count = _positive(count, "count")
        async with self._mutex() as session:
            ledger = _resizable(await require_ledger(session, self.name), self.name)
            start = max(ledger.next_id, 1)
            new = list(range(start, start + count))
            await publish_tokens(session, self.name, new, ledger.quorum, kind=self.kind)
            await write_ledger(session, self.name, ledger.with_ids(ledger.ids + new))
            log.info("added permits %s to %r", new, self.name)
            return new

    async def remove_permits(self, count: int, timeout: float | None = None) -> list[int]:
        """See :meth:`TokenAdmin.remove_permits`."""
        count = _positive(count, "count")
        timeout = check_timeout(timeout)
        deadline = admin_deadline(self.mutex_timeout, timeout)
        async with self._mutex() as session:
            what = f"remove_permits of {self.name!r}"
            return await answered(self._remove(session, count, timeout), timeout, deadline, what)

    async def _remove(self, session: Session, count: int, timeout: float | None) -> list[int]:
        ledger = _resizable(await require_ledger(session, self.name), self.name)
        want = min(count, ledger.permits)
        removed = await drain(session, self.name, want, timeout, ack=True)
        kept = [i for i in ledger.ids if i not in removed]
        await write_ledger(session, self.name, ledger.with_ids(kept))
        log.info("removed permits %s from %r", removed, self.name)
        return removed

    async def status(self) -> TokenStatus:
        """See :meth:`TokenAdmin.status`."""
        # Read-only: no admin mutex, so status works while an admin drains or audits.
        return await read_status(await self._core.session(), self.name, self.default_ledger)

    async def audit(self, timeout: float = 5.0) -> Audit:
        """See :meth:`TokenAdmin.audit`."""
        return await self._answered(self._audit, timeout, "audit")

    async def _answered(
        self,
        step: Callable[[Session, float], Coroutine[Any, Any, Audit]],
        timeout: float,
        what: str,
    ) -> Audit:
        """`step(session, wait)` under the admin mutex, answered within the mutex's wait
        plus `timeout` (its own wait for holders' tokens)."""
        wait = float(check_timeout(timeout) or 0.0)
        deadline = admin_deadline(self.mutex_timeout, wait)
        async with self._mutex() as session:
            return await answered(step(session, wait), wait, deadline, f"{what} of {self.name!r}")

    async def _audit(self, session: Session, wait: float) -> Audit:
        ledger = await require_ledger(session, self.name, self.default_ledger)
        return audit_of(ledger, await collect(session, self.name, ledger, wait))

    async def repair(self, timeout: float = 5.0) -> Audit:
        """See :meth:`TokenAdmin.repair`."""
        return await self._answered(self._repair, timeout, "repair")

    async def _repair(self, session: Session, wait: float) -> Audit:
        ledger = await require_ledger(session, self.name, self.default_ledger)
        queue = token_queue(self.name)
        # Counted while our own drain consumer is there (a count without it did not come
        # from the queue's leader: heal.FAILED_STAT): every other consumer holds a token
        # or waits for one.
        others: list[int] = []
        seen = await collect(session, self.name, ledger, wait, drop_surplus=True, others=others)
        result = audit_of(ledger, seen)
        if not result.missing:
            return result
        consumers = others[0]
        if consumers < 0:
            raise LockError(
                f"repair of {self.name!r}: permits {list(result.missing)} did not come back "
                f"within {wait:g}s, and {queue!r} could not say who holds them (its leader "
                "did not answer the count in time: a partition, or a busy node). Nothing "
                "was changed; run repair again"
            )
        if ledger.first_use:
            if consumers and not cancels_reach_holders(session):
                raise LockError(
                    f"repair of {self.name!r}: permits {list(result.missing)} did not come "
                    f"back within {wait:g}s while {consumers} consumer(s) hold or wait on "
                    f"{queue!r}, and on RabbitMQ 3.x its holders would not be told of a "
                    "replaced queue (a quorum queue declared again at once loses their "
                    "cancel). Run repair when nobody holds or waits"
                )
            # Replaced, never refilled: a token that may still come back (held through a
            # lost node, by a frozen holder) dies with the queue, so there is never a
            # second one; its holder, if any, is told (its consumer is cancelled). The
            # test-and-set makes it again at once (waiters racing it are refused).
            await session.delete(queue)
            await fresh.create(session, self.name, ledger.permits, ledger.quorum)
            log.warning(
                "replaced first-use token queue %r, which lacked permits %s",
                queue,
                result.missing,
            )
            return result
        if consumers:
            # A holder's token is not among those collected: publishing its id again
            # would make two holders. Held and lost cannot be told apart here.
            raise LockError(
                f"repair of {self.name!r}: permits {list(result.missing)} did not come back "
                f"within {wait:g}s while {consumers} consumer(s) hold or wait on {queue!r}; "
                "re-publishing them could duplicate a held token. Run repair when nobody "
                "holds or waits (or with a timeout longer than the longest hold)"
            )
        await publish_tokens(
            session,
            self.name,
            list(result.missing),
            ledger.quorum,
            ledger.first_use,
            self.kind,
            None,  # a set-up queue's count is the ledger's (add/remove_permits change it)
        )
        log.warning("re-published missing permits %s of %r", result.missing, self.name)
        return result

    async def destroy(self, *, purge_fence: bool = False) -> None:
        """See :meth:`TokenAdmin.destroy`."""
        async with self._mutex() as session:
            await session.delete(token_queue(self.name))
            await session.delete(ledger_queue(self.name))
            if purge_fence:
                await session.delete(fence_queue(self.name))
                session.fences_known.discard(fence_queue(self.name))


class TokenAdmin:
    """Administer the token semaphore `name` (sync; `amqp_locks.aio.TokenAdmin` awaits).

    ``quorum`` makes the token queue (and ledger) quorum queues, decided at `setup`;
    ``mutex_timeout`` bounds the wait for the administration mutex
    (:class:`~amqp_locks.errors.AdminLockTimeout` after it). `acquire`, `release` and
    `status` never take that mutex. ``first_use``: the semaphore is a first-use queue
    (tokens/fresh.py), whose status, audit and repair take one permit (id 1) for the
    ledger it does not have; default: names of cluster mode's mutexes (``M.mutex``).
    """

    def __init__(
        self,
        broker: BrokerLike,
        name: str,
        *,
        quorum: bool | None = None,
        mutex_timeout: float | None = MUTEX_TIMEOUT,
        first_use: bool | None = None,
    ) -> None:
        self._ops = TokenAdminCore(
            broker, name, quorum=quorum, mutex_timeout=mutex_timeout, first_use=first_use
        )
        self.broker = broker
        self.name = self._ops.name

    @property
    def _core(self) -> BrokerCore:
        return self.broker.core

    def setup(self, permits: int) -> int:
        """Declare the token queue and publish exactly `permits` tokens. Idempotent: a
        semaphore already set up with the same count is left alone; another count is
        refused (use add_permits/remove_permits). Returns the count."""
        return self._core.run(self._ops.setup(permits))

    def add_permits(self, count: int) -> list[int]:
        """Publish `count` new tokens (new ids: ids are never reused); returns their ids."""
        return self._core.run(self._ops.add_permits(count))

    def remove_permits(self, count: int, timeout: float | None = None) -> list[int]:
        """Take `count` tokens out of circulation (a top-priority consumer acks them),
        waiting up to `timeout` for held ones to come back. Returns the removed ids
        (fewer than `count` if the timeout passed first)."""
        return self._core.run(self._ops.remove_permits(count, timeout))

    def status(self) -> TokenStatus:
        """Permits configured, tokens ready in the queue, held (configured - ready) and
        consumers (holders + waiters + drains): the ledger and one passive declare."""
        return self._core.run(self._ops.status())

    def audit(self, timeout: float = 5.0) -> Audit:
        """Take every token with a top-priority consumer for up to `timeout` seconds (held
        ones are seen when they come back), then return them all. Ids never seen are
        reported missing (lost, or held all along); ids seen twice are surplus. Waiters get
        no token while the audit runs."""
        return self._core.run(self._ops.audit(timeout))

    def repair(self, timeout: float = 5.0) -> Audit:
        """Audit, then ack surplus duplicates and make missing permits whole. A first-use
        queue (no ledger) is replaced by one with all its tokens: a missing token that
        may still come back dies with the old queue. A set-up queue gets the ids not seen
        re-published, only while no consumer holds or waits on it (else LockError: a
        held token would be duplicated); after a node loss, wait out the lock delay
        first (a token held through the lost node is not counted as a consumer)."""
        return self._core.run(self._ops.repair(timeout))

    def destroy(self, *, purge_fence: bool = False) -> None:
        """Delete the token queue and its ledger (holders are told: consumer cancelled).
        The fence queue `N-fence` stays, so fencing tokens keep rising if `N` is set up
        again; ``purge_fence`` deletes it too (nothing of `N` is left on the broker)."""
        self._core.run(self._ops.destroy(purge_fence=purge_fence))

    def __repr__(self) -> str:
        return f"TokenAdmin({self.name!r})"
