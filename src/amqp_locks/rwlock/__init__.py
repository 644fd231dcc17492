"""Read-write lock: many readers or one writer, on reader tokens and a writer's turn.

Lock `N` uses the queues of ``B = "N.rwlock"`` (docs/rwlock.md has the whole story):

- ``B-readers`` (durable): ``R`` reader tokens. A **reader** consumes it with prefetch 1
  and consumer priority 0 and holds one token unacknowledged, as a token-semaphore holder
  does: the broker hands a token back when the reader releases it, closes its channel or
  dies. So at most ``R`` readers hold at once.
- ``B-writer`` (durable): one **turn** token. A writer first takes the turn (prefetch 1),
  so writers never split the reader tokens between them, then consumes ``B-readers`` with
  no prefetch limit and consumer priority 1. The broker hands every token that is free, or
  becomes free, to that higher-priority consumer and none to the readers: once a writer
  waits, new readers wait behind it, and nobody polls. The writer holds the lock when it
  holds all ``R`` tokens: no reader does.
- A writer releases in two steps: closing the tokens' channel returns all ``R`` tokens
  (the broker answers close-ok once the queue has requeued them, and the readers waiting
  at that moment get them first); then it returns the turn to the next writer, who waits
  for those readers. Read and write phases alternate: neither side starves.
- R is carried by the readers queue's ``x-max-length`` stamp. Each queue is made, with
  its tokens (R reader tokens; the turn), by the acquire that finds it missing, through
  a test-and-set declaration: exactly one racer fills it, with no administration mutex
  (admin.py says how; ``readers`` tokens, default 64). Unused, the queues expire (the
  writer queue after 60 s, the readers queue after 90 s) and the next use makes them
  again. Locks of earlier releases keep their ledger
  ``B-ledger`` (``{"readers": R}``) and never expire.
- Fencing: every grant, read or write, takes the next value of one counter, the fence
  shard of ``B`` (fencing.py), *after* it holds its tokens. A writer's token is above
  every token granted before it, a reader's above every earlier writer's.

The broker taking tokens back (queue deleted: consumer cancelled; channel closed, e.g. by
``consumer_timeout``; connection lost or silent) marks the hold lost at once.

Where each part lives: `admin.py` names the queues, sets the lock up and reads its status;
`protocol.py` waits for tokens and the turn, holds them (`HoldState`) and gives them back;
`lock.py` is the public ``ReadWriteLock`` with its ``read_lock`` and ``write_lock``.
"""

from .admin import (
    DEFAULT_READERS,
    MAX_READERS,
    RWLockStatus,
    base_name,
    ledger_queue,
    read_rwlock,
    read_status,
    readers_queue,
    setup,
    writer_queue,
)
from .lock import ReadLock, ReadWriteLock, WriteLock
from .protocol import NONBLOCKING_GRACE, HoldState, acquire_read, acquire_write

__all__ = [
    "DEFAULT_READERS",
    "MAX_READERS",
    "NONBLOCKING_GRACE",
    "HoldState",
    "RWLockStatus",
    "ReadLock",
    "ReadWriteLock",
    "WriteLock",
    "acquire_read",
    "acquire_write",
    "base_name",
    "ledger_queue",
    "read_rwlock",
    "read_status",
    "readers_queue",
    "setup",
    "writer_queue",
]
