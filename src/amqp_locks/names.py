"""What a lock name is on the broker: the one place that maps a user's lock name to the
names of its queues (and of the other broker objects it needs), and that says which
lock names are valid.

**The rule.** A lock name is any ``str`` of 1 to :data:`MAX_NAME_CHARS` characters without
control characters (Unicode category Cc) or lone surrogates (Cs), not starting with
``amq.`` (reserved by AMQP), and not ending with ``.mutex``, ``.slots`` or ``.rwlock``: in
cluster mode ``Mutex("X")`` *is* the token semaphore ``X.mutex``, a semaphore ``X``'s
slots are the token semaphore ``X.slots``, and ``X.rwlock`` is read-write lock ``X``'s
administration mutex, so a lock of one of those names would be another lock's queue.
(:class:`~amqp_locks.tokens.admin.TokenAdmin` accepts ``X.mutex`` and ``X.slots``: that is
how an operator administers those token semaphores.) Anything else is refused with
:class:`~amqp_locks.errors.InvalidName` before any broker call.

**The mapping.** Every queue of lock key ``K`` (the user's name, or one of the compound
keys above) is ``base(K) + suffix`` with a suffix from :data:`QUEUE_SUFFIXES`. The base is
``K`` itself when ``K`` is *readable*: only characters every AMQP client accepts in a
queue name (:data:`SAFE_CHARS`, the AMQP client's queue-name domain), short enough
(:data:`READABLE_MAX`, 239 bytes, for the general queues; :data:`TOKEN_READABLE_MAX` and
:data:`RWLOCK_READABLE_MAX`, 97 and 92, for the queues made by a stamped test-and-set,
whose 406 refusal must keep the stamp: :data:`REFUSAL_OVERHEAD`), not ending with a
suffix (:data:`RESERVED_ENDINGS`: ``X-fence`` would be lock ``X``'s fence queue) and not
ending like an escaped base. Other keys are *escaped*: their first 23 characters with
every unsafe one replaced by ``_``, then ``#`` and 32 base32 characters (160 bits) of the
SHA-256 of their UTF-8: ``caf_#<32 chars>`` for ``café``. So every name valid before 0.3
that uses only safe characters keeps exactly its queues wherever they worked, and:

- two keys never share a base (readable bases never end like an escaped one, escaped
  ones differ in their digest), and
- one lock's base plus a suffix is never another lock's base plus another suffix: an
  escaped base ends in the digest, which no suffix contains; a readable base never ends
  with a suffix, and no suffix is another suffix with a non-empty head
  (tests/test_names.py checks this on every suffix, and injectivity with Hypothesis).

Holder records bind by the general base (:func:`holder_key`), a token's message id is
built from it (:func:`token_message_id`), and a Celery claim exchange maps the same way
within the 127 characters AMQP clients allow an exchange name (:func:`claim_exchange`).
docs/protocol.md section 1.1 has the rule and the argument.

A persistent semaphore ``N`` owns ``N`` (admin mutex), ``N-k-A`` (slots), ``N-k-B``
(holders), with quorum slots ``N-0-A`` (their marker) and ``N-0k-A`` (slot k's tombstone
while it is removed), ``N-fence`` (an earlier release's fencing counter), the wake-up queues
``N-sem-wakeups`` / ``N-mutex-wakeups`` and the sentinel queues ``N-sem-watch`` /
``N-mutex-watch``; a mutex ``N`` on one node owns ``N`` and the mutex wake-up and
sentinel queues; a token semaphore ``N.semaphore`` (and an earlier release's
``N.semaphore-ledger``); a read-write lock ``N.rwlock-readers``, ``-writer``, ``-ledger``
and the administration mutex ``N.rwlock`` (itself a key: ``N.rwlock``, ``N.rwlock-1-A``...).
Versions before 0.2 named the wake-up and sentinel queues ``-waiters`` and ``-sentinels``:
those endings stay reserved.
"""

from __future__ import annotations

import base64
import hashlib
import re
import unicodedata
import zlib
from typing import Literal

from .errors import ConfigurationError, InvalidName

MAX_QUEUE_NAME_BYTES = 255
#: The AMQP client (and the AMQP 0-9-1 spec's grammar) refuse exchange names longer than this.
MAX_EXCHANGE_NAME_CHARS = 127
#: The largest slot number whose queue names we promise to fit (`N-9999999-A`).
MAX_SLOT_DIGITS = 7
#: The longest lock name, in characters (of any size: a longer one is hashed anyway).
MAX_NAME_CHARS = 255

#: The characters every AMQP client accepts in a queue or exchange name (the
#: AMQP client's ``queue-name`` domain: ``^[a-zA-Z0-9-_.:@#,/+ ]*$``).
SAFE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:@#,/+ ")

#: Suffixes of the queues no test-and-set declares (names of up to 239 bytes stay readable).
GENERAL_SUFFIXES: tuple[str, ...] = (
    "",  # a mutex, a semaphore's (or a token semaphore's) administration mutex
    "-{k}-A",  # {k}: a slot number, 1..9,999,999
    "-{k}-B",
    "-0{k}-A",  # slot k's tombstone (quorum slots: semaphore/burial.py)
    "-0-A",  # the marker of a semaphore whose slots are quorum queues
    "-fence",
    "-sem-wakeups",
    "-mutex-wakeups",
    "-sem-watch",
    "-mutex-watch",
)
#: Suffixes of releases before 0.2 (still reserved, so their queues are never reused).
OLD_SUFFIXES: tuple[str, ...] = (
    "-sem-waiters",
    "-mutex-waiters",
    "-sem-sentinels",
    "-mutex-sentinels",
)
#: Suffixes of the token and read-write lock queues: made by a stamped test-and-set
#: declaration whose 406 refusal must carry the stamp (:data:`TOKEN_READABLE_MAX`).
STAMPED_SUFFIXES: tuple[str, ...] = (
    ".semaphore",
    ".semaphore-ledger",
    ".semaphore-waiting",
    ".rwlock-readers",
    ".rwlock-writer",
    ".rwlock-ledger",
    ".rwlock-readers-waiting",
    ".rwlock-writer-waiting",
)
QUEUE_SUFFIXES = GENERAL_SUFFIXES + STAMPED_SUFFIXES


def suffix_instances(k: int = 10**MAX_SLOT_DIGITS - 1) -> list[str]:
    """Every suffix with slot number `k` filled in."""
    return [s.format(k=k) for s in QUEUE_SUFFIXES + OLD_SUFFIXES]


#: The longest general suffix (``-mutex-sentinels``, 16): the budget of a readable base.
LONGEST_SUFFIX = max(
    len(s.format(k=10**MAX_SLOT_DIGITS - 1)) for s in GENERAL_SUFFIXES + OLD_SUFFIXES
)
#: The longest readable base of a general queue, in bytes (239, the limit before 0.3).
READABLE_MAX = MAX_QUEUE_NAME_BYTES - LONGEST_SUFFIX
#: A 406 refusal's reply text is an AMQP short string (255 bytes; RabbitMQ cuts a longer
#: one short): "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'Q' in
#: vhost 'V': received 'S' but current is 'S'" with 19-digit stamps is 147 bytes besides
#: Q and V (3.10.8 and 4.3.6: 255 bytes whole at Q + V = 108, cut at 109). The stamp the
#: test-and-set reads is at its end.
REFUSAL_OVERHEAD = 147
#: The longest readable base of a token semaphore's queues (97) and of a read-write lock's
#: (92): their refusals fit on the vhost ``/`` with ``.semaphore`` and ``.rwlock-readers``
#: (a ledger is never stamped; it shares its token queue's base).
TOKEN_READABLE_MAX = MAX_QUEUE_NAME_BYTES - REFUSAL_OVERHEAD - len("/") - len(".semaphore")
RWLOCK_READABLE_MAX = MAX_QUEUE_NAME_BYTES - REFUSAL_OVERHEAD - len("/") - len(".rwlock-readers")
#: An escaped base keeps at most this many characters of the name before its digest, so
#: it is at most 56 characters long: a stamped queue's refusal fits on a vhost of up to
#: :data:`MAX_VHOST_CHARS` characters.
ESCAPED_HEAD = 23
MAX_VHOST_CHARS = 32

#: Endings a readable base may not have: each would make it another base plus a suffix.
RESERVED_ENDINGS = re.compile(
    r"(-\d+-[AB]|-fence|-waiters|-sentinels|-wakeups|-watch|\.semaphore(-ledger|-waiting)?"
    r"|\.rwlock-(readers|writer|ledger)(-waiting)?)$"
)
#: Endings of the compound keys the library builds itself (refused as lock names).
COMPOUND_ENDINGS = (".mutex", ".slots", ".rwlock")

#: Where an escaped base's digest starts, and its length in base32 characters.
ESCAPE_MARK = "#"
DIGEST_CHARS = 32
_ESCAPED = re.compile(re.escape(ESCAPE_MARK) + "[a-z2-7]{" + str(DIGEST_CHARS) + "}$")


class CompoundName(str):
    """A lock key the library builds from a user's name (``X.mutex``, ``X.slots``,
    ``X.rwlock``): accepted by :func:`validate_name`, which refuses such a name from a
    user."""

    __slots__ = ()


def _readable(key: str, room: int) -> bool:
    return (
        len(key) <= room  # characters first: cheap, and a safe character is one byte
        and all(c in SAFE_CHARS for c in key)
        and not _ESCAPED.search(key)
        and not RESERVED_ENDINGS.search(key)
    )


def _digest(key: str) -> str:
    raw = hashlib.sha256(key.encode("utf-8")).digest()
    return base64.b32encode(raw).decode("ascii")[:DIGEST_CHARS].lower()


def _base(key: str, room: int) -> str:
    if _readable(key, room):
        return key
    head = "".join(c if c in SAFE_CHARS else "_" for c in key[:ESCAPED_HEAD])
    return head + ESCAPE_MARK + _digest(key)


def queue_base(key: str) -> str:
    """The base of the general queues of lock key `key` (:data:`GENERAL_SUFFIXES`): `key`
    itself when readable, else its escaped form (module docstring). At most
    :data:`READABLE_MAX` bytes, safe characters only."""
    return _base(key, READABLE_MAX)


def token_base(key: str) -> str:
    """The base of token semaphore `key`'s queues: readable up to
    :data:`TOKEN_READABLE_MAX` bytes, else escaped."""
    return _base(key, TOKEN_READABLE_MAX)


def rwlock_base(key: str) -> str:
    """The base of read-write lock `key`'s queues: readable up to
    :data:`RWLOCK_READABLE_MAX` bytes, else escaped."""
    return _base(key, RWLOCK_READABLE_MAX)


def is_readable(key: str) -> bool:
    """Whether `key`'s queues carry it as it is (not escaped)."""
    return _readable(key, READABLE_MAX)


def holder_key(name: str) -> str:
    """The routing key holder records of lock `name` bind and are asked by."""
    return queue_base(name)


def token_message_id(name: str, ident: object) -> str:
    """A token's message id (``N#id``): a short string whatever the name's length."""
    return f"{queue_base(name)}#{ident}"


def claim_exchange(name: str) -> str:
    """The claim exchange of Celery key `name` (``N.once``, celery/once.py), within the
    127 characters AMQP clients allow an exchange name."""
    return _base(name, MAX_EXCHANGE_NAME_CHARS - len(".once")) + ".once"


def standalone_queue(name: str) -> str:
    """A queue named by the library outside any lock (a probe queue, a tooz group):
    `name` when it is safe, else escaped the same way, within 255 bytes."""
    safe = all(c in SAFE_CHARS for c in name) and not _ESCAPED.search(name)
    return name if safe and len(name) <= MAX_QUEUE_NAME_BYTES else _base(name, 255)


def validate_name(name: str, *, admin: bool = False) -> str:
    """Return `name` if it can name a lock, else raise :class:`InvalidName` saying why.
    ``admin``: also accept ``X.mutex`` and ``X.slots`` (the token semaphores of cluster
    mode's mutex and semaphore ``X``, which their administration names)."""
    if not isinstance(name, str):
        raise InvalidName(f"lock name must be a str, not {type(name).__name__}")
    if isinstance(name, CompoundName):
        return name
    if not name:
        raise InvalidName("lock name must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidName(
            f"lock name is {len(name)} characters long; at most {MAX_NAME_CHARS} are allowed"
        )
    if name.startswith("amq."):
        raise InvalidName(f"lock name {name!r}: names starting with 'amq.' are reserved by AMQP")
    for c in name:
        if unicodedata.category(c) in ("Cc", "Cs"):
            what = "a lone surrogate" if unicodedata.category(c) == "Cs" else "a control character"
            raise InvalidName(f"lock name {name!r} contains {what} (U+{ord(c):04X})")
    for ending in COMPOUND_ENDINGS:
        if name.endswith(ending) and not (admin and ending != ".rwlock"):
            base = name[: -len(ending)]
            raise InvalidName(f"lock name {name!r} ends with {ending!r}: {_OWNER[ending](base)}")
    return name


_OWNER = {
    ".mutex": lambda x: (
        f"in cluster mode it is the token semaphore of Mutex({x!r}), so the two would share "
        f"a queue; use Mutex(b, {x!r}) itself, TokenAdmin(b, {x + '.mutex'!r}) to "
        "administer it, or another name"
    ),
    ".slots": lambda x: (
        f"in cluster mode it holds the slots of semaphore {x!r}, so the two would share a "
        f"queue; administer it with TokenAdmin(b, {x + '.slots'!r}), or choose another name"
    ),
    ".rwlock": lambda x: (
        f"it is the administration mutex of read-write lock {x!r}; choose another name"
    ),
}


def mutex_queue(name: str) -> str:
    """The exclusive queue whose existence is mutex `name` held (one node), also the
    administration mutex of a semaphore or token semaphore `name`."""
    return queue_base(name)


def slot_queue(name: str, k: int) -> str:
    """`A[k]`: the durable queue whose existence is slot k."""
    return f"{queue_base(name)}-{k}-A"


def holder_queue(name: str, k: int) -> str:
    """`B[k]`: the exclusive queue whose existence means slot k is held."""
    return f"{queue_base(name)}-{k}-B"


def slot_tombstone(name: str, k: int) -> str:
    """`T[k]`: a classic queue whose existence means quorum slot k is being removed
    (semaphore/burial.py). A leading zero no slot number has keeps it apart from `A[k]`."""
    return f"{queue_base(name)}-0{k}-A"


def quorum_marker(name: str) -> str:
    """`M`: a classic queue whose existence means semaphore `name`'s slots are quorum
    queues, which a client must not touch unlooked (semaphore/burial.py). Slot 0 is no slot."""
    return f"{queue_base(name)}-0-A"


def fence_queue(name: str) -> str:
    """The quorum queue holding the one fence message of lock `name`: a shard's (below), or
    an earlier release's per-name fence, which fencing.py no longer reads."""
    return f"{queue_base(name)}-fence"


#: How many fencing counters every lock shares (fencing.py): a fixed set of quorum queues,
#: so a released name leaves no fence behind. Never change it: a name's shard must not move.
FENCE_SHARDS = 16


def fence_shard_lock(name: str) -> str:
    """The lock that guards the repair of the fence shard lock `name` counts on (its queues:
    :func:`fence_marker`, :func:`fence_generation`); a stable hash of the name picks one of
    :data:`FENCE_SHARDS`."""
    return shard_lock(zlib.crc32(name.encode("utf-8")) % FENCE_SHARDS)


def shard_lock(k: int) -> str:
    """Fence shard number `k`'s lock name (its queue: that name + ``-fence``)."""
    return f"amqp-locks-shard-{k:02d}"


def fence_shard(name: str) -> str:
    """The shared quorum queue whose one fence message counted lock `name`'s grants before the
    generations (``amqp-locks-shard-KK-fence``, 71753d0); no longer read or made (fencing.py)."""
    return fence_queue(fence_shard_lock(name))


def fence_shard_index(name: str) -> int:
    """Which of the :data:`FENCE_SHARDS` counters lock `name` counts on (stable hash)."""
    return zlib.crc32(name.encode("utf-8")) % FENCE_SHARDS


def fence_marker(k: int) -> str:
    """Fence shard `k`'s marker queue: exists once the shard's counter was ever made (so a
    counter deleted by hand is told from one never made), and holds the newest generation
    number as a hint for a client that looks for it (fencing.py)."""
    return f"amqp-locks-fence-{k:02d}"


def fence_tombstone(k: int, g: int) -> str:
    """Made with generation g+1 of fence shard `k`: generation `g` is superseded, even if
    g+1 is deleted by hand later (fencing.py). A classic queue that holds nothing."""
    return f"amqp-locks-fence-{k:02d}-g{g}-done"


def fence_generation(k: int, g: int) -> str:
    """Generation `g` of fence shard `k`: a quorum queue holding one counter message
    (fencing.py). A newer generation makes every older one unusable."""
    return f"amqp-locks-fence-{k:02d}-g{g}"


def slots_name(name: str) -> str:
    """The token semaphore that holds semaphore `name`'s slots in cluster mode
    (semaphore/cluster.py)."""
    return CompoundName(f"{name}.slots")


def quorum_mutex_name(name: str) -> str:
    """The token semaphore that is mutex `name` in cluster mode (mutex.py)."""
    return CompoundName(f"{name}.mutex")


def rwlock_admin_name(name: str) -> str:
    """The administration mutex of read-write lock `name` (rwlock/admin.py)."""
    return CompoundName(f"{name}.rwlock")


def token_queue(name: str) -> str:
    """The token semaphore's queue (the blog's `N.semaphore`)."""
    return f"{token_base(name)}.semaphore"


def token_waiting_queue(name: str) -> str:
    """The queue a first-use token semaphore's waiters consume from while they wait (it
    never holds a message): its consumer count tells holders from waiters (tokens/heal.py)."""
    return f"{token_base(name)}.semaphore-waiting"


def token_ledger_queue(name: str) -> str:
    """The ledger queue of token semaphore `name` (tokens/ledger.py)."""
    return f"{token_base(name)}.semaphore-ledger"


def rwlock_queue(name: str, role: Literal["readers", "writer", "ledger"]) -> str:
    """Read-write lock `name`'s ``readers``, ``writer`` or ``ledger`` queue."""
    return f"{rwlock_base(name)}.rwlock-{role}"


def wakeup_queue(name: str, kind: str) -> str:
    """The queue whose notices wake one waiter of lock `name` ("sem" or "mutex")."""
    return f"{queue_base(name)}-{kind}-wakeups"


def sentinel_queue(name: str, kind: str) -> str:
    """The queue of holders' sentinels: one returns to it when a holder dies."""
    return f"{queue_base(name)}-{kind}-watch"


def check_slot_number(k: int) -> int:
    """Slots are numbered 1..9,999,999 (the queue-name budget in :data:`MAX_SLOT_DIGITS`)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigurationError(f"slot number must be an int, not {type(k).__name__}")
    if not 1 <= k < 10**MAX_SLOT_DIGITS:
        raise ConfigurationError(f"slot number {k} out of range 1..{10**MAX_SLOT_DIGITS - 1}")
    return k
