"""The class tooz's entry point names: the parts of the driver put together."""

from __future__ import annotations

import contextlib

from tooz import coordination

from .groups import GroupsMixin
from .leaders import LeadersMixin
from .locks import AmqpLock
from .names import as_bytes


class AmqpDriver(LeadersMixin, GroupsMixin):
    """tooz coordination on RabbitMQ (see the package docstring and docs/tooz.md).

    URL: ``amqp://user:pass@host:5672/vhost``, ``amqps://...`` or oslo.messaging's
    ``rabbit://user:pass@host1:5672,user:pass@host2:5672/vhost`` (several nodes of one
    cluster). Options (query string): ``heartbeat`` (seconds, default 10: a vanished host's
    members, leaderships and locks are released within about two of them),
    ``connect_timeout`` (seconds, default 10), ``lock_timeout`` (seconds a group operation
    waits for the group's mutex, default 30).
    """

    CHARACTERISTICS = (
        coordination.Characteristics.NON_TIMEOUT_BASED,
        coordination.Characteristics.DISTRIBUTED_ACROSS_THREADS,
        coordination.Characteristics.DISTRIBUTED_ACROSS_PROCESSES,
        coordination.Characteristics.DISTRIBUTED_ACROSS_HOSTS,
        coordination.Characteristics.CAUSAL,
    )
    """Not timeout based (membership, leadership and locks end when the connection does,
    not when a TTL lapses); not linearizable under network partitions (RabbitMQ may grant
    a lock again while a partitioned holder still believes it holds it: use the locks'
    fencing tokens)."""

    def _stop(self) -> None:
        for group_id in list(self._leaders):
            with contextlib.suppress(Exception):
                self.stand_down_group_leader(group_id)
        self._close_broker()

    def get_lock(self, name: bytes) -> AmqpLock:
        return AmqpLock(self, as_bytes(name))
