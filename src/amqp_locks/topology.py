"""What every lock is on the broker, in one table: per lock kind and mode, each queue (or
exchange), its name, type, arguments, lifetime and the code that makes it.

Names come from names.py (its suffix tables give the name budget), arguments from the
functions named here; docs/protocol.md's section "Every queue of every lock" is rendered
from this table (``python -m amqp_locks.topology``) and tests/test_topology.py keeps the
two equal, checks that every name function gives what the code declares, and that every
function named here exists. Change a lock's wire here first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from . import names

#: The modes: one node (exclusive queues), cluster mode (quorum tokens), either.
Mode = str
ONE_NODE, CLUSTER, ANY = "one node", "cluster", "any"


@dataclass(frozen=True)
class Queue:
    """One queue (or exchange) of a lock kind."""

    kind: str
    mode: Mode
    #: The queue's name for lock `N` (names.py), as the code builds it.
    name: Callable[[str], str]
    #: Type and flags.
    what: str
    #: Where its arguments are built (``module:function`` or ``module:CONSTANT``).
    arguments: str
    #: What it holds.
    holds: str
    #: How long it lives.
    lifetime: str
    #: Who declares it (``module:function``).
    creator: str


def _slot(name: str) -> str:
    return names.slot_queue(name, 1)


def _holder(name: str) -> str:
    return names.holder_queue(name, 1)


def _tombstone(name: str) -> str:
    return names.slot_tombstone(name, 1)


def _rw(role: str) -> Callable[[str], str]:
    def name(n: str) -> str:
        return names.rwlock_queue(n, role)  # type: ignore[arg-type]

    name.__name__ = f"rwlock_queue_{role}"
    return name


def _waiting(queue: Callable[[str], str]) -> Callable[[str], str]:
    def name(n: str) -> str:
        return f"{queue(n)}-waiting"

    name.__name__ = f"{queue.__name__}_waiting"
    return name


def _cluster_mutex(name: str) -> str:
    return names.token_queue(names.quorum_mutex_name(name))


def _cluster_slots(name: str) -> str:
    return names.token_queue(names.slots_name(name))


def _helper_queues(kind: str, mode: Mode, infix: str, wakes: str) -> tuple[Queue, Queue]:
    """The two helper queues of a kind whose waiters sleep until woken: its wake-up queue
    (`wakes` says what else wakes them) and its holders' sentinel queue."""
    return (
        Queue(
            kind,
            mode,
            lambda n: names.wakeup_queue(n, infix),
            "durable classic, auto-delete (quorum in cluster mode)",
            "amqp_locks.transport.features:helper_queue",
            f"wake-up notices for waiters{wakes}",
            "its last waiter leaves, or 60 s unused",
            "amqp_locks.transport.wakeups:subscribe",
        ),
        Queue(
            kind,
            mode,
            lambda n: names.sentinel_queue(n, infix),
            "durable classic (quorum in cluster mode)",
            "amqp_locks.transport.features:helper_queue",
            "one sentinel per holder, returned when it dies",
            "60 s unused",
            "amqp_locks.queue_lease:LeaseState",
        ),
    )


QUEUES: tuple[Queue, ...] = (
    # --- persistent semaphore (the seed) ------------------------------------------------
    Queue(
        "semaphore",
        ONE_NODE,
        _slot,
        "durable classic (quorum with quorum=True)",
        "amqp_locks.semaphore.admin:SLOT_ARGS",
        "slot k exists (`N-k-A`, k = 1..C)",
        "until an administrator removes it",
        "amqp_locks.semaphore.admin:SemaphoreAdminCore",
    ),
    Queue(
        "semaphore",
        ONE_NODE,
        _holder,
        "exclusive",
        "amqp_locks.semaphore.client:HOLDER_ARGS",
        "slot k is held (`N-k-B`)",
        "release, or its connection's end",
        "amqp_locks.queue_lease:grant",
    ),
    Queue(
        "semaphore",
        ONE_NODE,
        names.quorum_marker,
        "durable classic (quorum slots only)",
        "amqp_locks.semaphore.burial:TOMBSTONE_ARGS",
        "the slots are quorum queues: clients look at their tombstones first",
        "from before the first slot to after the last",
        "amqp_locks.semaphore.admin:SemaphoreAdminCore",
    ),
    Queue(
        "semaphore",
        ONE_NODE,
        _tombstone,
        "durable classic (quorum slots only)",
        "amqp_locks.semaphore.burial:TOMBSTONE_ARGS",
        "quorum slot k is being removed (`N-0k-A`): it counts as missing",
        "BURY_GRACE (10 s) before its slot's delete, until just after it",
        "amqp_locks.semaphore.admin:SemaphoreAdminCore",
    ),
    Queue(
        "semaphore",
        CLUSTER,
        _cluster_slots,
        "quorum token semaphore `N.slots`",
        "amqp_locks.tokens.arguments:token_arguments",
        "one token per slot",
        "until an administrator removes it",
        "amqp_locks.semaphore.cluster:ClusterSlots",
    ),
    *_helper_queues("semaphore", ANY, "sem", " (a release, new slots)"),
    # --- mutex, and every administration mutex -------------------------------------------
    Queue(
        "mutex",
        ONE_NODE,
        names.mutex_queue,
        "exclusive",
        "(none)",
        "the mutex is held (also a semaphore's or token semaphore's admin mutex)",
        "release, or its connection's end",
        "amqp_locks.queue_lease:grant",
    ),
    *_helper_queues("mutex", ONE_NODE, "mutex", ""),
    Queue(
        "mutex",
        CLUSTER,
        _cluster_mutex,
        "quorum, stamped `x-max-length`",
        "amqp_locks.tokens.fresh:fresh_arguments",
        "the one token `N.mutex.semaphore`",
        "60 s unused (`x-expires`)",
        "amqp_locks.tokens.fresh:create",
    ),
    # --- token semaphore (the blog) ------------------------------------------------------
    Queue(
        "token semaphore",
        ANY,
        names.token_queue,
        "durable classic or quorum; first use: stamped `x-max-length`",
        "amqp_locks.tokens.fresh:fresh_arguments",
        "one token per permit, with its shape headers (shape.py)",
        "first use: 60 s unused; set up: until destroyed",
        "amqp_locks.tokens.fresh:create",
    ),
    Queue(
        "token semaphore",
        ANY,
        names.token_ledger_queue,
        "durable (set up by an administrator)",
        "amqp_locks.tokens.arguments:token_arguments",
        "the ledger record (count, ids)",
        "until destroyed",
        "amqp_locks.tokens.admin:TokenAdminCore",
    ),
    Queue(
        "token semaphore",
        ANY,
        names.token_waiting_queue,
        "durable classic, auto-delete",
        "amqp_locks.tokens.heal:WAITING_QUEUE",
        "nothing: waiters of 1 s consume it (holders = consumers - registered)",
        "its last waiter leaves, or 60 s unused",
        "amqp_locks.tokens.heal:watch",
    ),
    # --- read-write lock -----------------------------------------------------------------
    Queue(
        "read-write lock",
        ANY,
        _rw("readers"),
        "durable classic or quorum, stamped (R)",
        "amqp_locks.rwlock.admin:lock_arguments",
        "R reader tokens",
        "90 s unused",
        "amqp_locks.rwlock.admin:ensure_readers",
    ),
    Queue(
        "read-write lock",
        ANY,
        _rw("writer"),
        "durable classic or quorum, stamped",
        "amqp_locks.rwlock.admin:lock_arguments",
        "the writer's turn (body R)",
        "60 s unused (never outlives the readers queue)",
        "amqp_locks.rwlock.admin:ensure_writer",
    ),
    Queue(
        "read-write lock",
        ANY,
        _waiting(_rw("readers")),
        "durable classic, auto-delete",
        "amqp_locks.tokens.heal:WAITING_QUEUE",
        "nothing: registered readers",
        "its last waiter leaves, or 60 s unused",
        "amqp_locks.tokens.heal:watch",
    ),
    Queue(
        "read-write lock",
        ANY,
        _waiting(_rw("writer")),
        "durable classic, auto-delete",
        "amqp_locks.tokens.heal:WAITING_QUEUE",
        "nothing: registered writers",
        "its last waiter leaves, or 60 s unused",
        "amqp_locks.tokens.heal:watch",
    ),
    # --- shared by every lock ------------------------------------------------------------
    Queue(
        "fencing",
        ANY,
        lambda n: names.fence_generation(names.fence_shard_index(n), 0),
        "durable quorum, one message; generation G of one of 16 shards (`...-g<G>`)",
        "amqp_locks.fencing:fence_arguments",
        "the counter of every lock of the shard: token = 2^52 + G * 2^24 + returns + 1",
        (
            "until generation G+1 exists: deleted lowest first, 10 s after G+1 is made (left "
            "by a process that closed sooner: 10 s after the next one finds or renews the shard)"
        ),
        "amqp_locks.fencing:ensure_fence",
    ),
    Queue(
        "fencing",
        ANY,
        lambda n: names.fence_marker(names.fence_shard_index(n)),
        "durable quorum, one of 16, `x-max-length` 4 (drop-head)",
        "amqp_locks.fencing:_marker_arguments",
        "that the shard's counter was ever made, and hints of its newest generations",
        "for ever (a fixed set)",
        "amqp_locks.fencing:ensure_fence",
    ),
    Queue(
        "fencing",
        ANY,
        lambda n: names.fence_tombstone(names.fence_shard_index(n), 0),
        "durable classic, holds nothing",
        "amqp_locks.fencing:TOMBSTONE_ARGS",
        "generation G is superseded (made in the write that makes G+1)",
        "deleted with generation G",
        "amqp_locks.fencing:_supersede",
    ),
    Queue(
        "holder records",
        ANY,
        lambda n: names.holder_key(n),
        "routing key on the durable direct exchange `amqp-locks.holders`",
        "amqp_locks.transport.holders:QUEUE_ARGUMENTS",
        "a binding of the holder's exclusive record queue per held name",
        "10 s after the name's last lease there",
        "amqp_locks.transport.holders:HolderResponder",
    ),
    Queue(
        "celery once",
        ANY,
        names.claim_exchange,
        "durable fanout exchange, auto-delete",
        "amqp_locks.celery.once:_declare_claim",
        "the claim: the key is busy while it exists",
        "its last binding goes",
        "amqp_locks.celery.once:_declare_claim",
    ),
    Queue(
        "celery once",
        ONE_NODE,
        lambda _: "amqp-locks.once-alive.<uuid>",
        "exclusive, one per connection",
        "amqp_locks.celery.once:_make_alive",
        "nothing: a running call binds it to its claim (the claim goes with the connection)",
        "its connection's end",
        "amqp_locks.celery.once:_make_alive",
    ),
    Queue(
        "celery once",
        CLUSTER,
        lambda _: "amqp-locks.once-alive.<uuid>",
        "quorum, `x-expires` 1 s, consumed by its connection, one per connection",
        "amqp_locks.celery.once:_consumed_queue",
        "nothing: a running call binds it to its claim",
        "1 s after its consumer's connection or node is gone (+ a quorum tick)",
        "amqp_locks.celery.once:_consumed_queue",
    ),
)


def resolve(ref: str) -> object:
    """The object a ``module:attribute`` reference names (ImportError/AttributeError)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def markdown(example: str = "N") -> str:
    """The table docs/protocol.md carries, with lock name `example`."""
    rows = [
        "| kind | mode | name (lock `N`) | type | arguments | holds | lives until | made by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for q in QUEUES:
        rows.append(
            f"| {q.kind} | {q.mode} | `{q.name(example)}` | {q.what} | `{q.arguments}` | "
            f"{q.holds} | {q.lifetime} | `{q.creator}` |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - docs generation
    print(markdown(), end="")
