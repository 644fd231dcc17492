"""The ledger `N.semaphore-ledger`: the configured count and the token ids in circulation,
and what it is compared with (status: ready tokens; audit: tokens seen).

One persistent JSON record, e.g. ``{"version": 3, "permits": 2, "ids": [1, 4],
"quorum": false, "next_id": 5}``. Reading takes every record unacked and returns them all
by closing the channel (the newest version wins; several exist only after a crash
mid-write). Writing publishes the new record confirmed, then acks the older ones.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace

from ..errors import LockError, QueueNotFound, TokenSemaphoreNotFound
from ..holders import Reading
from ..names import token_ledger_queue, token_queue
from ..records import Kind, LockStatus
from ..transport.broker import BrokerCore
from ..transport.channel_ops import ack, take
from ..transport.errors import channel_error
from ..transport.session import Session
from ..transport.shield import close_quietly
from . import fresh
from .message import delivery_tag


def ledger_queue(name: str) -> str:
    return token_ledger_queue(name)


@dataclass(frozen=True)
class Ledger:
    """The configured count, the ids in circulation, the queue type, and the next id:
    ids are never reused, so a quorum token's per-id delivery count stays monotonic."""

    permits: int
    ids: list[int]
    quorum: bool = False
    next_id: int = 0
    #: A first-use queue's (tokens/fresh.py): no ledger queue, tokens fenced by shard.
    first_use: bool = False

    def with_ids(self, ids: list[int]) -> Ledger:
        return Ledger(len(ids), ids, self.quorum, max([self.next_id, *(i + 1 for i in ids)]))


async def read_ledger(session: Session, name: str) -> Ledger | None:
    """The newest ledger record, or None when there is none."""
    queue = ledger_queue(name)
    ch = await session.open_channel()
    try:
        best: Ledger | None = None
        best_version = -1
        try:
            while True:
                message = await take(ch, queue)
                if message is None:
                    break
                record = json.loads(message.body)
                if record["version"] > best_version:
                    best_version = record["version"]
                    ids = [int(i) for i in record["ids"]]
                    best = Ledger(
                        int(record["permits"]),
                        ids,
                        bool(record.get("quorum", False)),
                        int(record.get("next_id", max(ids, default=0) + 1)),
                    )
        except Exception as exc:
            raise channel_error(exc, queue) from exc
        session.ledger_versions[name] = best_version
        return best
    finally:
        await close_quietly(ch)  # every record goes back (unacked)


#: How long a read waits for a ledger record that another reader holds (seconds).
LEDGER_WAIT = 5.0


async def read_ledger_settled(session: Session, name: str) -> Ledger | None:
    """The ledger, or None when the semaphore has none (no ledger queue, or no tokens
    yet). A reader (``status``, ``holders``, ``max_slots``) takes the ledger record off
    its queue for a moment, and on a quorum queue the record it gives back may reach the
    queue after another reader's `basic.get` (measured on 4.3.6: a read right after
    another found none), so a read that finds none proves nothing while tokens exist.
    Tokens exist when the token queue has ready ones or consumers (every held token has
    its holder's consumer); then the ledger is read again until the record is back."""
    deadline = asyncio.get_running_loop().time() + LEDGER_WAIT
    pause = 0.01
    while True:
        try:
            ledger = await read_ledger(session, name)
        except QueueNotFound:
            return None  # no ledger queue: a first-use queue, or not set up
        if ledger is not None:
            return ledger
        try:
            ready, consumers = await session.declare_passive_counts(token_queue(name))
        except QueueNotFound:
            return None
        if ready == 0 and consumers == 0:
            return None
        if asyncio.get_running_loop().time() >= deadline:
            raise LockError(
                f"token semaphore {name!r} has tokens ({ready} ready, {consumers} "
                f"consumers) but its ledger {ledger_queue(name)!r} stayed empty for "
                f"{LEDGER_WAIT:g} s; run repair() or destroy() and set it up again"
            )
        await asyncio.sleep(pause)  # a reader puts the record back within a round trip
        pause = min(0.2, pause * 2)


def first_use_ledger(permits: int = 1, quorum: bool = True) -> Ledger:
    """What a first-use token queue (tokens/fresh.py) has instead of a ledger: `permits`
    permits, ids 1..permits (a mutex's: one quorum permit, id 1)."""
    return Ledger(permits, list(range(1, permits + 1)), quorum, permits + 1, first_use=True)


async def require_ledger(session: Session, name: str, default: Ledger | None = None) -> Ledger:
    """The ledger, or TokenSemaphoreNotFound: every admin call but setup needs one.
    `default`: what a semaphore without a ledger has (a mutex's first-use queue:
    :func:`first_use_ledger`), provided its token queue exists. Without one, a first-use
    queue's count is read from its stamp (tokens/fresh.py)."""
    ledger = await read_ledger_settled(session, name)
    if ledger is None and default is not None and await session.exists_passive(token_queue(name)):
        return default
    if ledger is None:
        held = await fresh.held_permits(session, name)
        if held is not None:
            return first_use_ledger(*held)
        raise TokenSemaphoreNotFound(
            f"token semaphore {name!r} is not set up: run TokenSemaphore.setup(permits)"
        )
    return ledger


async def write_ledger(session: Session, name: str, ledger: Ledger) -> None:
    """Publish the new record (confirmed), then drop the older ones."""
    queue = ledger_queue(name)
    if name not in session.ledger_versions:  # forgotten (a bounded map): read it again
        await read_ledger(session, name)
    version = session.ledger_versions.get(name, -1) + 1
    body = json.dumps(
        {
            "version": version,
            "permits": ledger.permits,
            "ids": ledger.ids,
            "quorum": ledger.quorum,
            "next_id": ledger.next_id,
        }
    )
    await session.publish("", queue, body.encode(), persistent=True)
    ch = await session.open_channel()
    try:
        while True:
            message = await take(ch, queue)
            if message is None:
                break
            if json.loads(message.body)["version"] < version:
                await ack(ch, delivery_tag(message))
    finally:
        await close_quietly(ch)  # the newest record goes back
    session.ledger_versions[name] = version


@dataclass(frozen=True)
class TokenStatus:
    permits: int
    ready: int
    held: int
    consumers: int
    waiting: int


async def read_status(session: Session, name: str, default: Ledger | None = None) -> TokenStatus:
    """Permits (the ledger, else `default`), ready tokens and consumers (one passive
    declare)."""
    ledger = await require_ledger(session, name, default)
    ready, consumers = await session.declare_passive_counts(token_queue(name))
    held = max(0, ledger.permits - ready)
    return TokenStatus(ledger.permits, ready, held, consumers, max(0, consumers - held))


async def read_token(core: BrokerCore, name: str, default: Ledger | None = None) -> Reading | None:
    """The token semaphore `name` as a lock status (None: not set up). `default`: what
    it has without a ledger (a first-use queue: :func:`first_use_ledger`)."""
    session = await core.session()
    if not await session.exists_passive(token_queue(name)):
        return None
    try:
        st = await read_status(session, name, default)
    except TokenSemaphoreNotFound:
        return None
    status = LockStatus(name, "token", st.permits, st.held, st.ready, (), st.consumers, st.waiting)
    return Reading(status)


async def read_token_as(
    core: BrokerCore, name: str, kind: Kind, wire: str, default: Ledger | None = None
) -> Reading | None:
    """Cluster mode: the mutex or semaphore `name` of `kind`, which is the token semaphore
    `wire` on the broker (docs/protocol.md section 11); `default` as for `read_token`."""
    reading = await read_token(core, wire, default)
    if reading is None:
        return None
    return Reading(replace(reading.status, name=name, kind=kind), wire)


@dataclass(frozen=True)
class Audit:
    permits: int
    seen: tuple[int, ...]
    missing: tuple[int, ...]
    surplus: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return not self.missing and not self.surplus


def audit_of(ledger: Ledger, seen: list[int]) -> Audit:
    """Compare the tokens seen with the ledger: ids missing, ids seen twice or unknown."""
    counts: dict[int, int] = {}
    for i in seen:
        counts[i] = counts.get(i, 0) + 1
    missing = tuple(i for i in ledger.ids if i not in counts)
    surplus = tuple(sorted(i for i, n in counts.items() if n > 1 or i not in ledger.ids))
    return Audit(ledger.permits, tuple(sorted(counts)), missing, surplus)
