"""A tooz driver on RabbitMQ: ``[coordination] backend_url = rabbit://user:pass@host:5672/``.

Registered under the ``tooz.backends`` entry point for ``amqp://``, ``amqps://`` and
``rabbit://`` (OpenStack's ``transport_url`` scheme). Install with ``amqp-locks[tooz]``;
this is the only package that imports tooz. docs/tooz.md is the operator's guide.

Every coordinator owns one :class:`amqp_locks.Broker` (one AMQP connection); whatever the
coordinator holds is tied to that connection, so it vanishes when the process dies, like
ZooKeeper's ephemeral nodes:

* a **lock** is an :class:`amqp_locks.ReadWriteLock` named ``tooz.<L>.lock`` (queues
  ``tooz.<L>.lock.rwlock-*``; docs/rwlock.md): an exclusive hold is its write hold, a
  shared hold a read hold. Both are unacknowledged deliveries, returned by the broker the
  moment the holder's connection dies; waiters are consumers, woken by the broker's push.
  Fencing tokens come from ``tooz.<L>.lock-fence``, the counter earlier versions' mutex
  locks used. (:mod:`.locks`)
* a **group** is the durable queue ``tooz.<G>.group``, holding one snapshot message (the
  member records: id, capabilities, times; the last leader announced). It is read and
  rewritten only under the mutex ``tooz.<G>.group-lock`` (basic.get, then requeue or
  publish-then-ack; a reader picks the highest version, so a crash between the publish and
  the ack loses nothing). The list of groups is the same kind of snapshot in
  ``tooz.groups``, under ``tooz.groups.lock``. (:mod:`.snapshot`, :mod:`.groups`)
* a **member** is alive while its exclusive queue ``tooz.<G>.member.<M>`` exists. A record
  whose queue is gone (its process died) is not a member; readers drop such records. One
  pipelined round of mandatory publishes checks every member at once.
* the **leader** of a group holds the mutex ``tooz.<G>.leader`` and the exclusive queue
  ``tooz.<G>.leader.<M>``, and writes its id into the group's snapshot; ``get_leader``
  returns that id only while that queue exists. (:mod:`.leaders`)

``<G>``, ``<M>``, ``<L>`` are the ids themselves when they are short and made of letters,
digits, ``_``, ``:`` and ``-``; otherwise ``~`` + hex, or ``#`` + SHA-256 for long ids
(:mod:`.names`).

The layers, lowest first: :mod:`.names` (queue names, backend URLs), :mod:`.snapshot`
(snapshot messages, error translation), :mod:`.base` (the connection and the snapshot
transaction), :mod:`.locks`, :mod:`.groups`, :mod:`.leaders`, :mod:`.driver` (the class
the entry point names). The driver drives the Broker's session directly for the queue
operations the public lock classes do not offer (basic.get of a snapshot, probes,
consumer counts); see ``DriverBase.session``.
"""

from __future__ import annotations

from ..extras import unavailable

try:
    import tooz  # noqa: F401  (checked here, before any module of the package needs it)
except ImportError:  # the extra is not installed
    raise unavailable("the tooz driver (amqp_locks.tooz_driver)", "tooz") from None

from .driver import AmqpDriver
from .locks import AmqpLock
from .names import broker_urls, encode_id

__all__ = ["AmqpDriver", "AmqpLock", "broker_urls", "encode_id"]
