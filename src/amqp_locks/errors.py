"""Typed errors: every failure names the problem (queue, code, what to do)."""

from __future__ import annotations

from dataclasses import dataclass


class AmqpLocksError(Exception):
    """Base class of every error raised by amqp-locks."""


class ConfigurationError(AmqpLocksError, ValueError):
    """A bad argument or setting (negative count, bad name, bad URL)."""


class InvalidName(ConfigurationError):
    """A lock name outside the rule of names.py (empty, too long, a control character, an
    ``amq.`` prefix, or a ``.mutex``/``.slots``/``.rwlock`` ending that is another lock's)."""


class InvalidQueueName(InvalidName):
    """The AMQP client refused a queue or exchange name the library built (``queue``
    names it): names.py maps every valid lock name to names it accepts, so this is a bug
    in amqp-locks (please report it with the lock name)."""

    def __init__(self, message: str, queue: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue


class ModeMismatch(ConfigurationError):
    """A lock used in single-node mode that clients in cluster mode hold another way (or
    the reverse): both kinds of client could hold it at once. Give every client of a lock
    the same mode (several URLs or ``cluster=True``, or neither)."""


class NotReplicated(ConfigurationError):
    """A lock on classic (single-node) queues asked for in cluster mode: it would stop, or
    fail its waiters, when its queues' node dies. Use quorum queues (the default there)."""


# --- broker / transport -------------------------------------------------------------------


class BrokerError(AmqpLocksError):
    """The broker refused an operation or could not be reached."""


class BrokerUnreachable(BrokerError):
    """No TCP/AMQP connection could be made to the broker."""


class BrokerTimeout(BrokerError, TimeoutError):
    """An administration call given a timeout got no answer from the broker in time (a
    hung node, or a link that passes heartbeats only); also a :class:`TimeoutError`."""


class ClusterUnreachable(BrokerUnreachable):
    """None of several broker nodes could be reached; ``failures`` pairs each URL
    (password censored) with why it failed."""

    def __init__(self, message: str, failures: list[tuple[str, AmqpLocksError]]) -> None:
        super().__init__(message)
        self.failures = failures


class AuthenticationFailed(BrokerError):
    """The broker refused the credentials (wrong user or password)."""


class AccessRefused(BrokerError):
    """403 ACCESS_REFUSED / 530 NOT_ALLOWED: no permission on the vhost or the queue."""


class QueueNotFound(BrokerError):
    """404 NOT_FOUND: the queue does not exist."""

    def __init__(self, message: str, queue: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue


class ResourceLocked(BrokerError):
    """405 RESOURCE_LOCKED: an exclusive queue is owned by another connection."""

    def __init__(self, message: str, queue: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue


@dataclass(frozen=True)
class Inequivalent:
    """A 406 "inequivalent arg": the queue exists, declared with another value of `arg`
    (read from the broker's text once, by transport/refusals.py)."""

    arg: str
    #: The queue's own value as the text gives it (None: it has none, or not `read`).
    current: str | None = None
    #: The value the refused declaration sent (None: it sent none, or not `read`).
    received: str | None = None
    #: Whether the values were in the text (False: cut short after the argument's name).
    read: bool = False

    @property
    def current_int(self) -> int | None:
        """The queue's own value as an integer (None: none, not read, or not an integer)."""
        try:
            return None if self.current is None else int(self.current)
        except ValueError:
            return None


class PreconditionFailed(BrokerError):
    """406 PRECONDITION_FAILED: the queue exists with other arguments or flags.

    A refusal from the broker carries what its text says, read once when it arrived:
    ``refusal`` (an "inequivalent arg": which argument, the queue's value, ours) or
    ``invalid_arg`` (an "invalid arg": a value the broker never takes); both None for one
    the library raises itself."""

    def __init__(
        self,
        message: str,
        queue: str | None = None,
        *,
        refusal: Inequivalent | None = None,
        invalid_arg: str | None = None,
    ) -> None:
        super().__init__(message)
        self.queue = queue
        self.refusal = refusal
        self.invalid_arg = invalid_arg


class ConnectionLost(BrokerError):
    """The connection to the broker closed or missed heartbeats during an operation."""


class BrokerClosed(AmqpLocksError, RuntimeError):
    """The Broker was closed: a state error (open a new Broker), not a bad argument."""


# --- locks ---------------------------------------------------------------------------------


class LockError(AmqpLocksError):
    """A lock operation could not be completed."""


class LockShapeMismatch(PreconditionFailed, LockError):
    """A lock's queue or token says another shape than this client expects: another kind
    of lock, another permit count, or a lock delay shorter than this client needs. Its
    text names the queue, the value it holds, this client's value and the fix; ``held``
    and ``wanted`` carry the two values. A :class:`PreconditionFailed` (the queue exists
    with another shape) and a :class:`LockError` (what a count mismatch raised before)."""

    def __init__(
        self,
        message: str,
        queue: str | None = None,
        *,
        held: object = None,
        wanted: object = None,
    ) -> None:
        super().__init__(message, queue)
        self.held = held
        self.wanted = wanted


class LockTimeout(LockError, TimeoutError):
    """``with lock:`` gave up: the lock was not obtained within the lock's `timeout` (or at
    once, with ``blocking=False``). Also a :class:`TimeoutError`, as users of filelock and
    redis-py expect."""


class SemaphoreNotFound(LockError):
    """The semaphore has no slots: `A[1]` does not exist (never created, or destroyed)."""


class TokenSemaphoreNotFound(SemaphoreNotFound):
    """`N.semaphore` does not exist: run `TokenSemaphore.setup(permits)` first."""


class AcquireRacesExceeded(LockError):
    """Too many second-stage races (RESOURCE_LOCKED on declare); see `max_races`."""


class AdminLockTimeout(LockError):
    """The administration mutex could not be obtained within the timeout."""


class LeaseReleased(LockError):
    """The lease was already released; it can no longer be used."""


class ReleaseUnconfirmed(LockError):
    """``release(wait=True)`` could not get the broker's word that the release was done: the
    connection (or the channel holding the lock) failed first. The broker still frees the
    lock when it sees that connection end, which may take up to its heartbeat timeout."""


class WrongProcess(LockError):
    """A lease used in a process forked from the one it was granted to: a child never holds
    its parent's locks (they stay the parent's, tied to the parent's connection)."""


class FenceMissing(LockError):
    """No fencing token could be taken: a fence shard's counter was deleted by hand (its
    marker is left: rebuild it above your resources' highest token with
    ``SemaphoreAdmin.repair_fence(floor)``, never restarted low), or neither its message
    nor a new generation answered in time (fencing.py)."""


# --- lockers (master/standby) --------------------------------------------------------------


class LockedElsewhere(LockError):
    """`fail_if_locked` is set and another holder has the lock."""


class LockerStopped(LockError):
    """`stop()` was called while `start()` was waiting."""


class KeepAliveTimeout(LockError):
    """The keep-alive did not answer within `keep_alive_timeout` (handed to the policy)."""


class FeatureUnavailable(AmqpLocksError, ImportError):
    """A feature this platform or installation lacks: an optional dependency that is not
    installed (the message names the extra to install), or an OS facility (``fcntl``)."""
