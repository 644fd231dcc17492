"""Typed errors: every failure names the problem (queue, code, what to do)."""

from __future__ import annotations


class AmqpLocksError(Exception):
    """Base class of every error raised by amqp-locks."""


class ConfigurationError(AmqpLocksError, ValueError):
    """A bad argument or setting (negative count, bad name, bad URL)."""


class InvalidName(ConfigurationError):
    """A lock name that is empty, too long, or could collide with another lock's queues."""


# --- broker / transport -------------------------------------------------------------------


class BrokerError(AmqpLocksError):
    """The broker refused an operation or could not be reached."""


class BrokerUnreachable(BrokerError):
    """No TCP/AMQP connection could be made to the broker."""


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


class PreconditionFailed(BrokerError):
    """406 PRECONDITION_FAILED: the queue exists with other arguments or flags."""

    def __init__(self, message: str, queue: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue


class ConnectionLost(BrokerError):
    """The connection to the broker closed or missed heartbeats during an operation."""


# --- locks ---------------------------------------------------------------------------------


class LockError(AmqpLocksError):
    """A lock operation could not be completed."""


class SemaphoreNotFound(LockError):
    """The semaphore has no slots: `A[1]` does not exist (never created, or destroyed)."""


class AcquireRacesExceeded(LockError):
    """Too many second-stage races (RESOURCE_LOCKED on declare); see `max_races`."""


class AdminLockTimeout(LockError):
    """The administration mutex could not be obtained within the timeout."""


class LeaseReleased(LockError):
    """The lease was already released; it can no longer be used."""
