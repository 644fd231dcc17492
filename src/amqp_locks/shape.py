"""A lock's shape, carried on its tokens and checked on every grant.

Two clients that disagree on what a queue is do not exclude each other: a ``Mutex`` on a
queue made with two permits has two holders, a 3-permit semaphore on one re-made with 5
holds 5, a client that needs a lock delay of 6 s on a queue made with 2 s can be granted
away before it is told (docs/cluster.md, "Every client agrees on a lock's shape"). A
declaration cannot catch this: a refused test-and-set's 406 names the stamp first, and a
consume declares nothing. So every token amqp-locks mints says the shape of its queue:

- ``amqp-locks-kind``: :data:`MUTEX`, :data:`SEMAPHORE`, :data:`SLOTS`,
  :data:`READERS` or :data:`WRITER`;
- ``amqp-locks-permits``: the count the queue was made with (a mutex's 1, a first-use
  semaphore's N, a read-write lock's R); absent on the tokens of a semaphore set up by an
  administrator (``TokenAdmin.setup``), whose count is its ledger's and changes with
  ``add_permits``/``remove_permits``;
- ``amqp-locks-lock-delay``: the queue's ``x-consumer-disconnected-timeout`` in ms;
  absent where the queue has none (classic queues, RabbitMQ before 4.3).

Every grant compares them with what the client expects (:class:`Expected`) before the
token is handed to the holder, and on a mismatch gives the token back (its channel is
closed) and raises :class:`~amqp_locks.errors.LockShapeMismatch`, naming the queue, both
values and the fix (:func:`mismatch` has the rules). What a header does not say is read
from the queue's arguments, once per queue and session (``Session.shapes_read``, forgotten
when the session sees the queue gone): a token of an earlier release (no kind header), or
a set-up semaphore's token given to a client that expects a count (the ledger's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import LockShapeMismatch, QueueNotFound
from .transport.features import min_lock_delay_ms
from .transport.line_args import DISCONNECTED
from .transport.session import Session
from .transport.wire import DeliveredMessage

KIND_HEADER = "amqp-locks-kind"
PERMITS_HEADER = "amqp-locks-permits"
DELAY_HEADER = "amqp-locks-lock-delay"

#: Cluster mode's mutex ``M`` (queue ``M.mutex.semaphore``): one permit.
MUTEX = "mutex"
#: A token semaphore (first use: its count fixed by its users; set up: by its ledger).
SEMAPHORE = "semaphore"
#: Cluster mode's persistent semaphore ``N`` (queue ``N.slots.semaphore``).
SLOTS = "slots"
#: A read-write lock's reader tokens (``N.rwlock-readers``) and writer turn.
READERS = "rwlock-readers"
WRITER = "rwlock-writer"
#: Every kind a token semaphore's queue can hold.
TOKEN_KINDS = frozenset({MUTEX, SEMAPHORE, SLOTS})

_WHAT = {
    MUTEX: "a mutex",
    SEMAPHORE: "a token semaphore",
    SLOTS: "a cluster-mode semaphore's slots",
    READERS: "a read-write lock's reader tokens",
    WRITER: "a read-write lock's writer turn",
}


def token_kind(name: str, permits: int) -> str:
    """The kind a token semaphore `name` of `permits` mints: cluster mode's mutex `M` is
    the one-permit semaphore ``M.mutex`` (names.quorum_mutex_name)."""
    return MUTEX if permits == 1 and name.endswith(".mutex") else SEMAPHORE


def shape_headers(kind: str, permits: int | None, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The shape headers of a token minted into a queue declared with `arguments`."""
    headers: dict[str, Any] = {KIND_HEADER: kind}
    if permits is not None:
        headers[PERMITS_HEADER] = permits
    delay = arguments.get(DISCONNECTED)
    if isinstance(delay, int) and not isinstance(delay, bool):
        headers[DELAY_HEADER] = delay
    return headers


@dataclass(frozen=True)
class Shape:
    """What a queue is: its kind, permit count and lock delay (None: not said)."""

    kind: str | None
    permits: int | None
    delay_ms: int | None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def carried(message: DeliveredMessage) -> Shape | None:
    """The shape a token says; None for a token of an earlier release (no kind header)."""
    props = message.header.properties if message.header else None
    headers = (props.headers or {}) if props is not None else {}
    kind = headers.get(KIND_HEADER)
    if isinstance(kind, bytes):
        kind = kind.decode(errors="replace")
    if not isinstance(kind, str):
        return None
    return Shape(kind, _int(headers.get(PERMITS_HEADER)), _int(headers.get(DELAY_HEADER)))


@dataclass(frozen=True)
class Expected:
    """What a client expects of the tokens it is granted: one of `kinds`, `permits`
    (None: any count) and, in cluster mode, a lock delay its quorum guard can beat."""

    kinds: frozenset[str]
    permits: int | None
    #: The client, for messages ("Mutex 'orders'").
    what: str


def mismatch(
    queue: str, held: Shape, expected: Expected, min_delay_ms: int, how: str = "made"
) -> str | None:
    """Why a token of `queue` with shape `held` must not be granted (None: it may).

    - permits: when the client gives a count, the queue's must be the same (not said,
      and not readable either: accepted; a set-up semaphore's is its ledger's);
    - kind: the token's must be one the client accepts (not said: any);
    - lock delay: at least `min_delay_ms`, what this client's quorum guard needs
      (``quorum_timeout + 1 s`` in cluster mode, ``features.min_lock_delay_ms``; 0 on one
      node, which has no node to lose). A longer one is safe (the broker re-grants later
      than the holder is told) and is used as it is; a queue without the argument
      follows the broker's own rule (before 4.3: the nodes' ``net_ticktime``, which
      ``ClusterTiming.check_line`` warns about; 4.3: 60 s), as declarations do.
    """
    if None not in (expected.permits, held.permits) and held.permits != expected.permits:
        return (
            f"lock queue {queue!r} was {how} with {held.permits} permit(s), not "
            f"{expected.permits} as {expected.what} expects: users of one name that give "
            "other counts could hold more permits than one of them allows. Give every "
            "user the same count, or use another name (a first-use queue expires a "
            "minute after its last user left; a set-up one changes with "
            "add_permits/remove_permits)"
        )
    if held.kind is not None and held.kind not in expected.kinds:
        wanted = " or ".join(sorted(_WHAT.get(k, k) for k in expected.kinds))
        return (
            f"lock queue {queue!r} holds the tokens of {_WHAT.get(held.kind, held.kind)}, but"
            f" {expected.what} expects {wanted}: two kinds of lock on one queue do not "
            "exclude each other. Use another name for one of them (a first-use queue expires"
            " a minute after its last user left)"
        )
    if held.delay_ms is not None and held.delay_ms < min_delay_ms:
        return (
            f"lock queue {queue!r} has a lock delay (x-consumer-disconnected-timeout) of "
            f"{held.delay_ms} ms, but {expected.what} needs at least {min_delay_ms} ms (this"
            " Broker's quorum_timeout + 1 s): a holder cut off with its node could be granted"
            " away before it is told. Give every client the same lock_delay, or delete the "
            "queue while nobody holds or waits for it (docs/cluster.md, 'Every client agrees"
            " on a lock's shape')"
        )
    return None


#: Reads (permits, lock delay ms) from a queue's arguments; its argument says whether
#: the delay is needed (a probe costs a round trip).
Reader = Callable[[bool], Awaitable[tuple[int | None, int | None]]]


async def check(
    session: Session, queue: str, message: DeliveredMessage, expected: Expected, read: Reader
) -> None:
    """Raise :class:`LockShapeMismatch` when the token `message` of `queue` must not be
    granted to this client (:func:`mismatch`); what the token does not say is read with
    `read`, once per queue and session."""
    min_delay_ms = min_lock_delay_ms(session)
    said = carried(message)
    shape = said
    need_permits = expected.permits is not None and (said is None or said.permits is None)
    if need_permits or (said is None and min_delay_ms > 0):
        known = session.shapes_read.get(queue)
        if known is None:  # one read per queue and session: whatever a later grant needs
            known = await read(min_delay_ms > 0)
            session.shapes_read[queue] = known
        permits, delay = known
        if said is None:
            shape = Shape(None, permits, delay)
        else:
            counted = said.permits if said.permits is not None else permits
            shape = Shape(said.kind, counted, said.delay_ms)
    assert shape is not None
    why = mismatch(queue, shape, expected, min_delay_ms)
    if why is not None:
        held, wanted = _values(shape, expected, min_delay_ms)
        raise LockShapeMismatch(why, queue, held=held, wanted=wanted)


def _values(shape: Shape, expected: Expected, min_delay_ms: int) -> tuple[object, object]:
    """(held, wanted) of the first rule `shape` breaks, for the error's attributes."""
    if expected.permits is not None and shape.permits not in (None, expected.permits):
        return shape.permits, expected.permits
    if shape.kind is not None and shape.kind not in expected.kinds:
        return shape.kind, sorted(expected.kinds)
    return shape.delay_ms, min_delay_ms


def delay_refusal(queue: str, held_ms: int, what: str, min_delay_ms: int) -> LockShapeMismatch:
    """A queue found (by a refused creation or a declaration) with a lock delay shorter
    than this client needs."""
    why = mismatch(
        queue, Shape(None, None, held_ms), Expected(frozenset(), None, what), min_delay_ms
    )
    assert why is not None
    return LockShapeMismatch(why, queue, held=held_ms, wanted=min_delay_ms)


def permits_refusal(
    queue: str, held: int, wanted: int, what: str, how: str = "made"
) -> LockShapeMismatch:
    """A queue found with another permit count than this client gives (`how`: "made",
    "set up")."""
    why = mismatch(queue, Shape(None, held, None), Expected(frozenset(), wanted, what), 0, how)
    assert why is not None
    return LockShapeMismatch(why, queue, held=held, wanted=wanted)


async def held_delay(session: Session, queue: str, arguments: dict[str, Any]) -> int | None:
    """The lock delay `queue` was declared with, read by a declaration the broker refuses
    whether the queue exists or not (``Session.held_argument``; 4.3+ only: an older line
    does not check the argument). None: no such argument, or the queue is gone."""
    if session.version < (4, 3):
        return None
    try:
        return await session.held_argument(queue, arguments, DISCONNECTED)
    except QueueNotFound:
        return None


def forget(session: Session, *queues: str) -> None:
    """The session saw these queues gone: what it read of them is stale."""
    for queue in queues:
        session.shapes_read.pop(queue, None)
        session.running_seen.pop(queue, None)
        session.quiet_since.pop(queue, None)
