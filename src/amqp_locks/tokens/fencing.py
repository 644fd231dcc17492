"""Where a token's fencing token comes from (see the package docstring).

A quorum token counts its own returns; a classic token carries (epoch, count) in its
headers, raised by every polite release; a token the broker gave back (or one minted under
another counting rule) takes a fresh value from the lock's fence queue `N-fence`.
"""

from __future__ import annotations

from typing import Any

from ..fencing import rule_matches, take_epoch, take_token
from ..transport.features import acquired_count_header, broker_version, counting_rule
from ..transport.session import Session
from ..transport.wire import DeliveredMessage
from .message import (
    BASE_HEADER,
    CARRIED,
    COUNT_HEADER,
    DELIVERY_COUNT,
    EPOCH_HEADER,
    FENCE,
    FENCING_HEADER,
    SHARD,
    headers_of,
    int_header,
    text,
)

#: (epoch, count) a classic holder's fencing token was made of; its release publishes the
#: token again with count + 1. None: the release returns the token as it came.
Carry = tuple[int, int] | None


async def mint_headers(session: Session, name: str, quorum: bool) -> dict[str, Any]:
    """Headers for newly published tokens. A quorum token's counter is its return count,
    which restarts at 0 for a new message; its base (its epoch, one fresh `N-fence`
    token, shifted by 32 bits, rising for ever) keeps a re-published id's tokens above its
    earlier ones. A classic token carries (that fresh epoch, count 0)."""
    epoch = await take_epoch(session, name)
    if quorum:
        rule = counting_rule(broker_version(session))
        # The epoch, not its shifted base: an epoch re-based by a broker upgrade is above
        # 2**40 (fencing.py), and an AMQP header holds a signed 64-bit integer at most.
        return {FENCING_HEADER: rule, EPOCH_HEADER: epoch}
    return {FENCING_HEADER: CARRIED, EPOCH_HEADER: epoch, COUNT_HEADER: 0}


def shard_headers() -> dict[str, Any]:
    """Headers of a token whose queue is made on first use and expires when unused: its
    grants take their fencing tokens from the lock's fence shard, one per grant (a value
    near 2**51, which fits a BIGINT; an epoch << 32 from a shard would not)."""
    return {FENCING_HEADER: SHARD}


async def fencing_for(
    session: Session, name: str, message: DeliveredMessage, fencing: bool
) -> tuple[int, Carry, bool]:
    """(fencing token, carry, quorum) of a token just delivered to us. Costs a round trip
    only when the token cannot tell its own value (see the module docstring)."""
    if text(headers_of(message).get(FENCING_HEADER)) == SHARD:
        return (await take_token(session, name) if fencing else 0), None, True
    own = await _quorum_fencing(session, name, message)
    if own is not None:
        return own, None, True
    token, carry = await _classic_fencing(session, name, message, fencing)
    return token, carry, False


async def _quorum_fencing(session: Session, name: str, message: DeliveredMessage) -> int | None:
    """A quorum token's fencing token from its own return count; None for a classic one."""
    headers = headers_of(message)
    source = text(headers.get(FENCING_HEADER))
    if source in (None, FENCE, CARRIED):
        return None
    version = broker_version(session)
    epoch = int_header(headers, EPOCH_HEADER)
    # A token minted by an earlier amqp-locks carries the shifted base itself.
    base = epoch << 32 if epoch is not None else int_header(headers, BASE_HEADER) or 0
    rule = None if source == DELIVERY_COUNT else source
    if not rule_matches(rule, counting_rule(version)):
        # Minted under another counting rule: its count may have restarted. A fresh fence
        # value shifted like a base is above every token this permit produced so far.
        return (await take_epoch(session, name) << 32) + 1
    value = headers.get(acquired_count_header(version), 0)
    return base + (int(value) if isinstance(value, int) else 0) + 1


def carried_fencing(message: DeliveredMessage, fencing: bool) -> tuple[int, Carry] | None:
    """A classic token's (fencing token, carry) from the counter it carries, when the last
    holder released it politely; None when it carries none (or the broker gave it back:
    redelivered), and the fence queue must say."""
    headers = headers_of(message)
    if text(headers.get(FENCING_HEADER)) != CARRIED:
        return None
    epoch, count = int_header(headers, EPOCH_HEADER), int_header(headers, COUNT_HEADER)
    redelivered = bool(getattr(message.delivery, "redelivered", False))
    if epoch is not None and count is not None and not redelivered and 0 <= count < 2**32:
        return (epoch << 32 | count if fencing else 0), (epoch, count)
    return None


async def _classic_fencing(
    session: Session, name: str, message: DeliveredMessage, fencing: bool
) -> tuple[int, Carry]:
    """A classic token's (fencing token, carry): its carried counter when the last holder
    released it politely, else a fresh epoch from the fence queue."""
    known = carried_fencing(message, fencing)
    if known is not None:
        return known
    if not fencing:
        return 0, None  # returned as it came: the next fenced holder mints an epoch
    epoch = await take_epoch(session, name)
    return epoch << 32, (epoch, 0)
