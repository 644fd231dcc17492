"""Queues declared under another RabbitMQ line: the arguments that depend on the line.

Some queue arguments are sent only to the broker lines that need them (``features.py``):
``x-consumer-timeout`` from 3.12 (not on 4.3's classic queues), ``x-delivery-limit: -1``
from 4.0, ``x-consumer-disconnected-timeout`` from 4.3. A queue keeps the arguments it was
first declared with, and RabbitMQ refuses a declaration with other ones (406
``inequivalent arg``). So after an upgrade (a token queue made on 3.13, declared again on
4.0), or on a cluster in the middle of a rolling upgrade, our own declaration would fail.

When a 406 names one of these arguments, and the queue holds our own value of it or none,
the declaration is repeated the way the other line made it (:func:`other_line`), and a
WARNING says what the queue now lacks and which policy restores it
(:func:`other_line_warning`; docs/operations.md, "Upgrading RabbitMQ"). Any other
difference, or another value of one of these arguments, stays a
:class:`~amqp_locks.errors.PreconditionFailed`: it is not a queue we made.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .refusals import inequivalent

#: Unacked messages of a consumer on a lost node go back after this long (4.3+): the
#: default lock delay (quorum_guard.DEFAULT_LOCK_DELAY; a Broker may set its own).
CONSUMER_DISCONNECTED_TIMEOUT_MS = 10_000
DISCONNECTED = "x-consumer-disconnected-timeout"
#: A year: long lock holds keep token messages unacked (see docs/operations.md).
CONSUMER_TIMEOUT_MS = 365 * 24 * 3600 * 1000

#: The line-dependent arguments, with the one value amqp-locks ever gives each.
LINE_VALUES: dict[str, int] = {
    "x-consumer-timeout": CONSUMER_TIMEOUT_MS,
    "x-delivery-limit": -1,
    "x-consumer-disconnected-timeout": CONSUMER_DISCONNECTED_TIMEOUT_MS,
}

#: What a queue without the argument does, and the policy key that gives it back.
_WITHOUT = {
    "x-consumer-timeout": (
        "the broker's consumer_timeout (30 min by default) closes a channel that holds a "
        "token longer",
        "consumer-timeout",
    ),
    "x-delivery-limit": (
        "RabbitMQ 4.x's default delivery limit (20) drops a token or fence message after "
        "20 returns",
        "delivery-limit",
    ),
    "x-consumer-disconnected-timeout": (
        "a holder lost with its node keeps its token for the broker's "
        "consumer_disconnected_timeout (60 s by default) instead of the lock delay",
        "consumer-disconnected-timeout",
    ),
}

log = logging.getLogger("amqp_locks.transport")
#: Queues already logged (once per process and queue: waiters declare them again and again).
_noted: set[str] = set()


def parse_version(raw: object) -> tuple[int, int]:
    """(major, minor) from a ``server_properties['version']`` value such as ``b"4.0.5"``."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    parts = [*text.split("."), "0"]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return 3, 0


#: Per-name queues expire when unused (features.NAME_EXPIRES_MS); an earlier amqp-locks gave
#: its helper queues 10 minutes. Either value is safe: the queue is used as it was made.
EXPIRES = "x-expires"


def other_line(
    error: BaseException | str,
    arguments: Mapping[str, Any] | None,
    version: tuple[int, int],
    min_delay_ms: int = 0,
) -> dict[str, Any] | None:
    """The arguments to declare again with after the 406 `error`: ours with the one
    it names removed (the queue has none) or added with our value (the queue has ours);
    None when the difference is anything else, or is ``x-delivery-limit: -1`` on 3.x
    (which reads it as "drop at the first return").

    ``x-consumer-disconnected-timeout`` (the lock delay) may hold any value of at least
    `min_delay_ms` (another client's ``lock_delay``): the queue's own is used. A shorter
    one (an earlier amqp-locks gave 1 s) could grant a cut-off holder's lock before it
    is told, so it stays refused (:func:`short_delay`)."""
    m = inequivalent(error)
    if m is None or not m.read or (m.arg not in LINE_VALUES and m.arg != EXPIRES):
        return None
    arg, args = m.arg, dict(arguments or {})
    if arg == EXPIRES and arg in args:  # an earlier release's expiry (or none): its own
        if m.current is None:
            del args[arg]
            return args
        held = m.current_int
        if held is None:
            return None
        args[arg] = held
        return args
    if arg == EXPIRES:  # the queue expires and we declared without: not ours to adapt
        return None
    if m.current is None:
        if arg not in args:
            return None
        del args[arg]
        return args
    if arg == DISCONNECTED:
        held = m.current_int
        if held is None or held < min_delay_ms:
            return None
        args[arg] = held
        return args
    if arg in args or m.current != str(LINE_VALUES[arg]):
        return None
    if arg == "x-delivery-limit" and version < (4, 0):
        return None
    args[arg] = LINE_VALUES[arg]
    return args


def held_value(error: BaseException | str, arg: str) -> int | None:
    """The integer value of `arg` that the 406 `error` says the queue holds (None: the
    error names another argument, or the queue has none)."""
    m = inequivalent(error)
    if m is None or not m.read or m.arg != arg:
        return None
    return m.current_int


def names_argument(error: BaseException | str, arg: str) -> bool:
    """Whether the 406 `error` is an "inequivalent arg" refusal naming `arg`."""
    m = inequivalent(error)
    return m is not None and m.read and m.arg == arg


def short_delay(error: BaseException | str, min_delay_ms: int) -> int | None:
    """The lock delay (ms) of a queue the 406 `error` says is shorter than
    `min_delay_ms`, else None."""
    m = inequivalent(error)
    if m is None or not m.read or m.arg != DISCONNECTED:
        return None
    held = m.current_int
    return held if held is not None and held < min_delay_ms else None


def short_delay_message(queue: str, held_ms: int, min_delay_ms: int) -> str:
    """Why lock queue `queue`, made with a lock delay of `held_ms`, is refused."""
    return (
        f"lock queue {queue!r} was declared with x-consumer-disconnected-timeout {held_ms} ms"
        f" (an earlier amqp-locks gave 1000 ms, or a client has a shorter lock_delay): a "
        f"holder cut off with its node could be granted away before it is told (this "
        f"Broker's quorum_timeout needs a lock delay of at least {min_delay_ms} ms). A queue "
        "keeps its arguments: delete it while nobody holds or waits for the lock and set it "
        "up again (docs/cluster.md, 'Upgrading from a 1 s lock delay'), or give every client "
        "the same lock_delay"
    )


def other_line_warning(queue: str, sent: Mapping[str, Any], kept: Mapping[str, Any]) -> str:
    """What queue `queue` lacks of the arguments we `sent` (it was declared with `kept`), and
    the policy that makes up for it; empty when it lacks nothing (a newer line made it)."""
    missing = [arg for arg in LINE_VALUES if arg in sent and arg not in kept]
    if not missing:
        return ""
    effects = "; ".join(_WITHOUT[arg][0] for arg in missing)
    policy = ", ".join(f'"{_WITHOUT[arg][1]}": {LINE_VALUES[arg]}' for arg in missing)
    return (
        f"queue {queue!r} was declared by another RabbitMQ line without "
        f"{', '.join(missing)}; amqp-locks uses it as it is, but {effects}. Give it a "
        f"policy with {{{policy}}} (docs/operations.md, 'Upgrading RabbitMQ')"
    )


def note_other_line(queue: str, sent: Mapping[str, Any], kept: Mapping[str, Any]) -> None:
    """Log, once per process and queue, that `queue` was declared with `kept`, not `sent`."""
    if queue in _noted:
        return
    _noted.add(queue)
    if text := other_line_warning(queue, sent, kept):
        log.warning("%s", text)
    elif EXPIRES in sent and kept.get(EXPIRES) != sent[EXPIRES]:
        log.info(
            "queue %r was made by an earlier amqp-locks with x-expires %s, not %s ms: used "
            "as it is; it goes after its own expiry once unused",
            queue,
            kept.get(EXPIRES),
            sent[EXPIRES],
        )
    elif DISCONNECTED in sent and kept.get(DISCONNECTED) != sent[DISCONNECTED]:
        log.info(
            "queue %r has a lock delay of %s ms (another client's lock_delay), not %s ms: "
            "a node's loss frees its locks after the queue's own",
            queue,
            kept.get(DISCONNECTED),
            sent[DISCONNECTED],
        )
    else:
        log.info("queue %r was declared by a newer RabbitMQ line; used as it is", queue)
