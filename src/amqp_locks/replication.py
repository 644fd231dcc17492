"""Which queue type a lock's shared queues get: replicated (quorum) in cluster mode.

A classic queue lives on one node: when that node dies, its waiters fail or wait until it
returns. So in cluster mode (``Broker([...])`` or ``cluster=True``) every lock that takes
``quorum=`` defaults to quorum queues, and asking for classic ones is refused when the
lock object is made (:class:`~amqp_locks.errors.NotReplicated`), not at the first fault.
"""

from __future__ import annotations

from .errors import NotReplicated
from .transport.broker import BrokerLike


def choose_quorum(broker: BrokerLike, quorum: bool | None, what: str) -> bool:
    """`quorum` as given, or (None) whether the broker is a cluster; refuses
    ``quorum=False`` in cluster mode."""
    cluster = broker.core.cluster
    if quorum is None:
        return cluster
    if cluster and not quorum:
        raise NotReplicated(
            f"{what}: quorum=False asks for classic queues, which live on one node, but the "
            "Broker is in cluster mode (several URLs or cluster=True): a node's death would "
            "stop the lock or fail its waiters. Leave quorum unset (quorum queues) or "
            "pass quorum=True"
        )
    return bool(quorum)
