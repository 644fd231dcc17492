"""Queue names of every lock, and the validation that keeps locks from colliding.

A persistent semaphore `N` owns the queues `N` (admin mutex), `N-k-A` (slots), `N-k-B`
(holders), `N-fence` (fencing counter), the wake-up queues `N-sem-wakeups` and
`N-mutex-wakeups` and the sentinel queues `N-sem-watch` and `N-mutex-watch`; a token
semaphore owns `N.semaphore` (and a mutex `M` in cluster mode is the token semaphore
`M.mutex`); a read-write lock `N.rwlock` (its admin mutex),
`N.rwlock-readers`, `-writer`, `-ledger` and `-fence`. (Versions before 0.2 named the
wake-up and sentinel queues `-waiters` and `-sentinels` and declared them transient; the
new names keep old and new clients of one lock from refusing each other's declarations
during an upgrade.) A name that ends like one of those suffixes could alias another
lock's queue, so it is refused.
"""

from __future__ import annotations

import re
import zlib

from .errors import ConfigurationError, InvalidName

MAX_QUEUE_NAME_BYTES = 255
#: The largest slot number whose queue names we promise to fit (`N-1000000-A`).
MAX_SLOT_DIGITS = 7
_LONGEST_SUFFIX = max(len("-") + MAX_SLOT_DIGITS + len("-A"), len("-mutex-sentinels"))

_RESERVED = re.compile(
    r"(-\d+-[AB]|-fence|-waiters|-sentinels|-wakeups|-watch|\.semaphore(-ledger)?"
    r"|\.rwlock(-readers|-writer|-ledger)?)$"
)


def validate_name(name: str) -> str:
    """Return `name` if it can name a lock, else raise :class:`InvalidName` saying why."""
    if not isinstance(name, str):
        raise InvalidName(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidName("lock name must not be empty")
    if name.startswith("amq."):
        raise InvalidName(f"lock name {name!r}: names starting with 'amq.' are reserved by AMQP")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidName(f"lock name {name!r} contains control characters")
    size = len(name.encode("utf-8"))
    if size + _LONGEST_SUFFIX > MAX_QUEUE_NAME_BYTES:
        raise InvalidName(
            f"lock name is {size} bytes of UTF-8; at most "
            f"{MAX_QUEUE_NAME_BYTES - _LONGEST_SUFFIX} bytes fit once suffixed "
            f"(queue names are AMQP short strings of at most {MAX_QUEUE_NAME_BYTES} bytes)"
        )
    match = _RESERVED.search(name)
    if match:
        raise InvalidName(
            f"lock name {name!r} ends with {match.group(0)!r}, which could collide with the "
            "queues of another lock (slot/holder/fence/token queues use that suffix)"
        )
    return name


def slot_queue(name: str, k: int) -> str:
    """`A[k]`: the durable queue whose existence is slot k."""
    return f"{name}-{k}-A"


def holder_queue(name: str, k: int) -> str:
    """`B[k]`: the exclusive queue whose existence means slot k is held."""
    return f"{name}-{k}-B"


def fence_queue(name: str) -> str:
    """The quorum queue holding the one fence message of lock `name`: a shard's (below), or
    an earlier release's per-name fence, which fencing.py no longer reads."""
    return f"{name}-fence"


#: How many fencing counters every lock shares (fencing.py): a fixed set of quorum queues,
#: so a released name leaves no fence behind. Never change it: a name's shard must not move.
FENCE_SHARDS = 16


def fence_shard_lock(name: str) -> str:
    """The lock that guards the repair of the fence shard lock `name` counts on (its queue
    is :func:`fence_shard`); a stable hash of the name picks one of :data:`FENCE_SHARDS`."""
    return shard_lock(zlib.crc32(name.encode("utf-8")) % FENCE_SHARDS)


def shard_lock(k: int) -> str:
    """Fence shard number `k`'s lock name (its queue: that name + ``-fence``)."""
    return f"amqp-locks-shard-{k:02d}"


def fence_shard(name: str) -> str:
    """The shared quorum queue whose one fence message counts lock `name`'s grants."""
    return fence_queue(fence_shard_lock(name))


def slots_name(name: str) -> str:
    """The token semaphore that holds semaphore `name`'s slots in cluster mode
    (semaphore/cluster.py)."""
    return f"{name}.slots"


def quorum_mutex_name(name: str) -> str:
    """The token semaphore that is mutex `name` in cluster mode (mutex.py)."""
    return f"{name}.mutex"


def token_queue(name: str) -> str:
    """The token semaphore's queue (the blog's `N.semaphore`)."""
    return f"{name}.semaphore"


def wakeup_queue(name: str, kind: str) -> str:
    """The queue whose notices wake one waiter of lock `name` ("sem" or "mutex")."""
    return f"{name}-{kind}-wakeups"


def sentinel_queue(name: str, kind: str) -> str:
    """The queue of holders' sentinels: one returns to it when a holder dies."""
    return f"{name}-{kind}-watch"


def check_slot_number(k: int) -> int:
    """Slots are numbered 1..9,999,999 (the queue-name budget in :data:`MAX_SLOT_DIGITS`)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigurationError(f"slot number must be an int, not {type(k).__name__}")
    if not 1 <= k < 10**MAX_SLOT_DIGITS:
        raise ConfigurationError(f"slot number {k} out of range 1..{10**MAX_SLOT_DIGITS - 1}")
    return k
