"""The persistent semaphore in cluster mode: its slots are the tokens of a quorum queue.

The seed's protocol holds slot k with the exclusive queue `B[k]`. On a Khepri cluster
(RabbitMQ 4.2+) a dead node's exclusive queues stay until the node returns, so a slot held
through it would stay held. In cluster mode the semaphore `N` is therefore the quorum token
semaphore ``N.slots`` (queue ``N.slots.semaphore``; docs/tokens.md, docs/protocol.md
section 11): one token per slot, its id the slot number; a holder keeps its token unacked,
the broker returns it when the holder releases, dies or its node is lost, and pushes it to
the next waiter. The seed's administration maps onto the token semaphore's:

- create C: C tokens, ids 1..C; add X: X new ids; max: the ledger's count;
- remove X: takes X tokens out as they are free (held slots go once released; ``wait``
  bounds how long); destroy: deletes the queue and its ledger, which cancels holders
  (told "queue deleted");
- holders: the slot numbers the holders report; ``overshoot`` and ``ascending`` have
  nothing to act on (no slot queues) and are ignored; the fencing token is the slot
  token's own counter, so ``repair_fence`` does not apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from ..errors import (
    AccessRefused,
    ConfigurationError,
    ModeMismatch,
    SemaphoreNotFound,
    TokenSemaphoreNotFound,
)
from ..held import HeldState
from ..holders import read_holders
from ..names import slot_queue, slots_name, token_queue
from ..records import HOLDER_TIMEOUT
from ..shape import SLOTS
from ..tokens.admin import TokenAdminCore
from ..tokens.client import TokenSemaphore
from ..tokens.ledger import read_ledger_settled, read_token
from ..transport.broker import BrokerLike

__all__ = ["ClusterSlots", "acquire_slot", "slots_name"]


def _missing(name: str) -> SemaphoreNotFound:
    return SemaphoreNotFound(
        f"semaphore {name!r} does not exist in cluster mode ({token_queue(slots_name(name))!r}"
        " missing): create it with SemaphoreAdmin.create() through a cluster-mode Broker"
    )


async def acquire_slot(
    broker: BrokerLike, name: str, *, blocking: bool, timeout: float | None
) -> HeldState | None:
    """Wait for a slot token (push); its id is the slot number."""
    tokens = TokenSemaphore(broker, slots_name(name), quorum=True)
    try:
        return await tokens.wait_permit(blocking, timeout)
    except TokenSemaphoreNotFound:
        session = await broker.core.session()
        seed = False
        with contextlib.suppress(AccessRefused):  # permissions cover only our queues
            seed = await session.exists_passive(slot_queue(name, 1))
        if seed:
            raise ModeMismatch(
                f"semaphore {name!r} was created in single-node mode ({slot_queue(name, 1)!r}"
                " exists) but this Broker is in cluster mode: both kinds of client could hold"
                " a slot at once. Recreate it through a cluster-mode Broker, or give every"
                " client the same mode"
            ) from None
        raise _missing(name) from None


class ClusterSlots:
    """The administration of semaphore `name` in cluster mode (see the module docstring)."""

    def __init__(self, broker: BrokerLike, name: str, mutex_timeout: float | None) -> None:
        self.broker = broker
        self.name = name
        self.tokens = TokenAdminCore(
            broker, slots_name(name), quorum=True, mutex_timeout=mutex_timeout, kind=SLOTS
        )

    async def _ids(self) -> list[int]:
        session = await self.broker.core.session()
        ledger = await read_ledger_settled(session, self.tokens.name)
        return [] if ledger is None else list(ledger.ids)

    async def max_slots(self) -> int:
        return len(await self._ids())

    async def create(self, slots: int) -> int:
        return await self.tokens.setup(slots)

    async def destroy(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(slots removed, slots still held when they were)."""
        ids = await self._ids()
        held = await self.holders()
        await self.tokens.destroy()
        return tuple(sorted(ids, reverse=True)), tuple(held)

    async def add_slots(self, count: int) -> int:
        if not await self._ids():
            raise _missing(self.name)
        await self.tokens.add_permits(count)
        return await self.max_slots()

    async def remove_slots(self, count: int, wait: float | None) -> tuple[int, ...]:
        """The slots taken out: free ones at once, held ones as they are released within
        `wait` seconds (None: until `count` are out)."""
        if not await self._ids():
            raise _missing(self.name)
        return tuple(await self.tokens.remove_permits(count, wait))

    async def holders(self, timeout: float = HOLDER_TIMEOUT) -> list[int]:
        """Held slot numbers, as their holders report them (a holder that does not answer
        within `timeout` is counted by the queue but cannot be named)."""
        records = await read_holders(self.broker.core, read_token, self.tokens.name, timeout)
        return sorted({r.number for r in records if r.number is not None})

    async def wait_for_holders(
        self, slots: Sequence[int], timeout: float | None, interval: float
    ) -> list[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        now = set(await self.holders())  # one holder query per round, not one per slot
        held = [k for k in slots if k in now]
        while held and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(interval)
            now = set(await self.holders())
            held = [k for k in held if k in now]
        return held

    @staticmethod
    def no_fence() -> ConfigurationError:
        return ConfigurationError(
            "repair_fence does not apply in cluster mode: each slot token carries its own "
            "rising counter (docs/protocol.md section 11)"
        )
