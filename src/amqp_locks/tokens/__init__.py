"""Token semaphore: the RabbitMQ blog's design, with what the blog leaves to the reader.

The durable queue `N.semaphore` holds one message per permit. A holder consumes with
prefetch 1 and manual ack and *never* acks: the broker keeps the delivered token unacked
on the holder's channel and gives it back to the queue when the holder rejects it (the
polite release), closes its channel or connection, or crashes. Waiting is pure push: every
waiter is a consumer, and the broker delivers the next free token to the waiter with the
highest consumer priority (`x-priority`).

What the blog leaves open, and how it is handled here:
- A token must never be acked by a holder: the API never exposes the delivery.
- A timed-out or cancelled waiter closes its channel, which returns any token that
  arrived after it stopped waiting: no token is ever stranded.
- The broker taking a token back (consumer cancelled because the queue was deleted, channel
  closed by `consumer_timeout`, connection lost) marks the permit lost at once.
- Altering the count: `add_permits` publishes new tokens; `remove_permits` drains tokens
  with a consumer of the highest priority and acks them, waiting for held ones to return.
- Integrity: the administration mutex `N` serialises admin actions; a ledger message in
  `N.semaphore-ledger` records the configured count and the token ids, so `setup` is
  idempotent and `audit`/`repair` can find missing or surplus tokens.
- Fencing: quorum token queues count returns per token (`x-delivery-count`, from 4.3
  `x-acquired-count`: `transport.features`). A classic token *carries* its counter
  (`epoch`, `count` headers; fencing token ``epoch << 32 | count``): a polite release acks
  it and publishes it again with ``count + 1`` in one AMQP transaction, so it is never lost
  nor doubled, and the next holder reads its fencing token for free. Only a token the
  broker gave back (``redelivered``: a holder died, was cut off or timed out, and may have
  used a value the message does not record) takes a fresh epoch from the lock's fence
  queue `N-fence`, above every value handed out before. A quorum token minted under
  another counting rule (the broker was upgraded across 3.13 -> 4.0 or 4.2 -> 4.3 since
  `setup`) falls back to the fence queue, shifted above every per-token value, until the
  tokens are published anew. Either way a protected resource keeps the highest token per
  (lock name, permit id) and refuses lower ones.
- Broker limits: RabbitMQ 3.12+ takes `x-consumer-timeout` per queue and the queue is
  declared with it (one year); on 3.10/3.11 only the global `consumer_timeout` exists and
  must be raised in rabbitmq.conf (the private dev node does). On 4.x quorum queues get
  `x-delivery-limit: -1`, or the default limit of 20 would drop a token after 20 hand-offs.

Where each part lives: `client.py` waits for a token and holds it (`acquire_permit`,
`TokenSemaphore`); `permit.py` is the held token (loss watching, the polite release);
`fencing.py` and `message.py` say what a token carries and how it becomes a fencing token;
`admin.py` (`TokenAdmin`) sets up, resizes, audits and destroys; `ledger.py` is the record of
the configured count and ids; `drain.py` the top-priority consumers of remove/audit/repair.
"""

from ..errors import TokenSemaphoreNotFound
from .admin import MUTEX_TIMEOUT, TokenAdmin, TokenAdminCore
from .arguments import token_arguments
from .client import NONBLOCKING_GRACE, TokenSemaphore, acquire_permit
from .drain import DRAIN_PRIORITY, MAX_PRIORITY
from .ledger import Audit, Ledger, TokenStatus, ledger_queue, read_status
from .permit import PermitState

__all__ = [
    "DRAIN_PRIORITY",
    "MAX_PRIORITY",
    "MUTEX_TIMEOUT",
    "NONBLOCKING_GRACE",
    "Audit",
    "Ledger",
    "PermitState",
    "TokenAdmin",
    "TokenAdminCore",
    "TokenSemaphore",
    "TokenSemaphoreNotFound",
    "TokenStatus",
    "acquire_permit",
    "ledger_queue",
    "read_status",
    "token_arguments",
]
