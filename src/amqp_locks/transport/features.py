"""What the connected broker's version changes for us: queue arguments and counters.

One place for every version rule (docs/compatibility.md has the table and the sources):

- RabbitMQ 4.x can deny transient non-exclusive queues (4.3.6 permits them by default;
  a node with ``deprecated_features.permit.transient_nonexcl_queues = false`` refuses them
  with a connection-level 541): every queue we share between connections is durable
  (classic with ``x-expires`` on one node, quorum in cluster mode) or exclusive.
- Quorum queues on 4.x get a default delivery limit of 20 and would drop a never-acked
  token or fence message after 20 returns: we set ``x-delivery-limit: -1`` (unlimited on
  4.x; on 3.x ``-1`` means "drop at the first return", so the argument is left out there).
- 4.3 keeps messages held by a consumer on a lost node for ``consumer_disconnected_timeout``
  (60 s) before returning them; ``x-consumer-disconnected-timeout`` sets it per queue: the
  Broker's ``lock_delay`` (10 s by default), which a cut-off holder's guard must beat.
- 4.3 moved the "returned this many times" count from ``x-delivery-count`` to the new
  ``x-acquired-count`` (``x-delivery-count`` now counts failed deliveries only).
- ``x-consumer-timeout`` is accepted per queue from 3.12; 4.3 refuses it on classic queues.
- Before 4.0 a queue deleted and declared again at once does not cancel its consumers:
  the channel consumes the new queue by name, hollow (:func:`cancels_reach_holders`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .line_args import CONSUMER_TIMEOUT_MS

if TYPE_CHECKING:
    from .session import Session

#: How long a per-name queue lives once nobody uses it (no consumer, no get, no declare):
#: a released name costs the broker nothing a minute later (issue 30 asks for 2 minutes;
#: the broker's expiry sweep runs within seconds of this).
NAME_EXPIRES_MS = 60_000
#: The earlier release's expiry of the wake-up and sentinel queues; a queue made by it
#: refuses a declaration with :data:`NAME_EXPIRES_MS` (406) and is used as it is.
OLD_HELPER_EXPIRES_MS = 600_000
HELPER_EXPIRES_MS = NAME_EXPIRES_MS


def broker_version(session: Session) -> tuple[int, int]:
    """The broker's (major, minor) version, from the connection's server properties."""
    return session.version


def quorum_arguments(version: tuple[int, int], *, lock_delay_ms: int | None) -> dict[str, Any]:
    """Arguments of a quorum queue whose messages are held unacked and returned (tokens,
    fences, sentinels): never dropped after N returns; on 4.3, returned from a lost node
    `lock_delay_ms` after the broker notices the loss (the Broker's ``lock_delay``,
    quorum_guard.py: a cut-off holder is told first).

    4.3 compares ``x-consumer-disconnected-timeout`` when a queue is declared again (406
    if it differs), so it goes only on queues declared by setup or administration (token
    and fence queues: `lock_delay_ms`), not on those every waiter declares (None): one
    made on 4.2 would refuse every declaration after an upgrade to 4.3."""
    args: dict[str, Any] = {"x-queue-type": "quorum"}
    if version >= (4, 0):
        args["x-delivery-limit"] = -1
    if version >= (4, 3) and lock_delay_ms is not None:
        args["x-consumer-disconnected-timeout"] = lock_delay_ms
    return args


def lock_queue_arguments(session: Session) -> dict[str, Any]:
    """:func:`quorum_arguments` of a queue whose messages are locks or fences, with this
    session's lock delay."""
    return quorum_arguments(broker_version(session), lock_delay_ms=session.timing.lock_delay_ms)


def min_lock_delay_ms(session: Session) -> int:
    """The shortest lock delay an existing lock queue may have for this session (cluster
    mode: ``ClusterTiming.min_delay_ms``; one node has no node to lose: 0)."""
    return session.timing.min_delay_ms if session.cluster else 0


def consumer_timeout_arguments(version: tuple[int, int], quorum: bool) -> dict[str, Any]:
    """``x-consumer-timeout`` where the broker accepts it on this queue type."""
    if version >= (3, 12) and (quorum or version < (4, 3)):
        return {"x-consumer-timeout": CONSUMER_TIMEOUT_MS}
    return {}


def acquired_count_header(version: tuple[int, int]) -> str:
    """The header that counts every return of a quorum-queue message on this broker."""
    return "x-acquired-count" if version >= (4, 3) else "x-delivery-count"


def counting_rule(version: tuple[int, int]) -> str:
    """Which counter this broker line keeps, and under which storage: a fence message
    minted under one rule and read under another must be re-based (fencing.py)."""
    if version >= (4, 3):
        return "acq43"
    if version >= (4, 0):
        return "dc40"
    return "dc3"


#: A wake-up notice nobody took within a minute is stale (waiters re-check on a back-off).
NOTICE_TTL_MS = 60_000


def helper_queue(session: Session, *, wakeups: bool) -> dict[str, Any]:
    """``queue_declare`` keywords for a queue waiters or holders share: the wake-up queue
    (`wakeups`) or the sentinel queue. One node: a durable classic queue expiring when
    unused (4.x refuses transient shared queues); the wake-up queue is also auto-deleted
    when its last waiter leaves, so notices nobody waits for are dropped. Cluster: a quorum
    queue, which survives the death of a node; quorum queues cannot auto-delete, so stale
    notices expire instead (sentinels never do: one is returned only when a holder dies)."""
    if not session.cluster:
        args: dict[str, Any] = {"x-expires": HELPER_EXPIRES_MS}
        return {"durable": True, "auto_delete": wakeups, "arguments": args}
    version = broker_version(session)
    args = {**quorum_arguments(version, lock_delay_ms=None), "x-expires": HELPER_EXPIRES_MS}
    if wakeups:
        args["x-message-ttl"] = NOTICE_TTL_MS
    return {"durable": True, "arguments": args}


def cancels_reach_holders(session: Session) -> bool:
    """Whether deleting a queue that is made again at once still tells its consumers
    (basic.cancel): 4.0.5 and 4.3.6 told 3 of 3 holders. RabbitMQ 3.x's channel, when a
    queue it consumes ends, consumes it again by name instead (rabbit_channel
    ``queue_down_consumer_action``, meant for mirrored queues' failover; a quorum queue
    refuses ``x-cancel-on-ha-failover``, the consume argument that would turn it off),
    and for a quorum queue the consumer it makes is hollow. Measured on 3.10.8, with the
    queue declared again in the next round trip: 0 of 3 holders told, on the deleting
    connection or another; 3 waiters took the new queue's 3 tokens (0 ready, 3
    consumers) and were handed none, until their channels' close returned them. With
    0.2 s between the delete and the declaration, every consumer was cancelled. So before
    4.0 a queue is replaced only while nobody holds one of its tokens, and a waiter
    checks, while its queue is short of tokens, whether the queue's stamp (fresh.py: each
    creation's own) is still the one it waited on, and else waits again on a new channel
    (tokens/heal.py, ``Plan.on_replaced``)."""
    return broker_version(session) >= (4, 0)
