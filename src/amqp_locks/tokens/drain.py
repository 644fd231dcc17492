"""Consumers above every waiter: `remove_permits` takes tokens out of circulation, `audit`
and `repair` look at every token. Both go ahead of all waiters (`DRAIN_PRIORITY`) and take
held tokens as their holders release them."""

from __future__ import annotations

import asyncio
import contextlib
import time

from ..names import token_queue
from ..transport.channel_ops import ack as ack_message
from ..transport.channel_ops import consume_unacked
from ..transport.session import Session
from ..transport.shield import close_quietly
from ..transport.wire import DeliveredMessage
from .ledger import Ledger
from .message import delivery_tag, token_id

#: Consumer priority of the drain consumer used by remove_permits/audit: above any waiter.
DRAIN_PRIORITY = 2**31 - 1
#: The highest priority a waiter may ask for.
MAX_PRIORITY = 2**31 - 2
#: After an audit saw every ledger id, how long it waits for duplicates right behind.
SURPLUS_GRACE = 0.2


async def drain(
    session: Session, name: str, count: int, timeout: float | None, *, ack: bool
) -> list[int]:
    """Take up to `count` tokens with the top-priority consumer; ack them if `ack`. Tokens
    beyond `count` go back when the channel closes."""
    if count <= 0:
        return []
    ch = await session.open_channel()
    taken: list[int] = []
    done = asyncio.Event()

    async def on_token(message: DeliveredMessage) -> None:
        if len(taken) >= count:
            return  # returned when the channel closes
        taken.append(token_id(message))
        if ack:
            await ack_message(ch, delivery_tag(message))
        if len(taken) >= count:
            done.set()

    try:
        await consume_unacked(
            ch, token_queue(name), on_token, prefetch=count, priority=DRAIN_PRIORITY
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout)
        return list(taken)
    finally:
        await close_quietly(ch)


async def collect(
    session: Session,
    name: str,
    ledger: Ledger,
    timeout: float,
    *,
    drop_surplus: bool = False,
    others: list[int] | None = None,
) -> list[int]:
    """Hold every token that shows up within `timeout` (or until every ledger id was
    seen); ack duplicates and unknown ids if `drop_surplus`; return the rest by closing
    the channel. `others`: append the token queue's consumers other than ours, counted
    while ours consumes, so that a count the queue's leader did not give (RabbitMQ's
    "0 ready, 0 consumers": tokens/heal.FAILED_STAT) shows as -1."""
    known = set(ledger.ids)
    ch = await session.open_channel()
    seen: list[int] = []
    enough = asyncio.Event()

    async def on_token(message: DeliveredMessage) -> None:
        permit = token_id(message)
        if drop_surplus and (permit in seen or permit not in known):
            await ack_message(ch, delivery_tag(message))
        seen.append(permit)
        if known <= set(seen):
            enough.set()

    try:
        await consume_unacked(ch, token_queue(name), on_token, prefetch=0, priority=DRAIN_PRIORITY)
        if others is not None:
            others.append((await session.declare_passive_counts(token_queue(name)))[1] - 1)
        deadline = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), timeout)
        # surplus tokens ready beside a complete set arrive right behind it
        await asyncio.sleep(min(SURPLUS_GRACE, max(0.0, deadline - time.monotonic())))
        return seen
    finally:
        await close_quietly(ch)
