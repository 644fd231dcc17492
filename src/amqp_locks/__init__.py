"""amqp-locks: distributed locks, counting semaphores and master/standby election on RabbitMQ.

The sync API lives here; the asyncio twin is :mod:`amqp_locks.aio`. Both drive the same core
on a private I/O thread.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import events, metrics
from .errors import (
    AccessRefused,
    AcquireRacesExceeded,
    AdminLockTimeout,
    AmqpLocksError,
    AuthenticationFailed,
    BrokerClosed,
    BrokerError,
    BrokerTimeout,
    BrokerUnreachable,
    ClusterUnreachable,
    ConfigurationError,
    ConnectionLost,
    FeatureUnavailable,
    FenceMissing,
    InvalidName,
    InvalidQueueName,
    KeepAliveTimeout,
    LeaseReleased,
    LockedElsewhere,
    LockError,
    LockerStopped,
    LockShapeMismatch,
    LockTimeout,
    ModeMismatch,
    NotReplicated,
    PreconditionFailed,
    QueueNotFound,
    ReleaseUnconfirmed,
    ResourceLocked,
    SemaphoreNotFound,
    TokenSemaphoreNotFound,
    WrongProcess,
)
from .fencing import prepare_fences
from .holders import HolderRecord
from .lease import Lease
from .lockers import AmqpLocker, Locker
from .mutex import Mutex
from .rwlock import ReadWriteLock, RWLockStatus
from .semaphore import PersistentSemaphore, Removal, SemaphoreAdmin
from .service import LeaseAwarePolicy, LockableService, State
from .status import LockStatus, lock_status
from .tokens import Audit, TokenAdmin, TokenSemaphore, TokenStatus
from .transport import Broker
from .waiting import Backoff

if TYPE_CHECKING:
    from .lockers import DatabaseLocker, LeaseDatabaseLocker, SharedFileLocker

#: Imported on first use (SQLAlchemy, fcntl): see :mod:`amqp_locks.lockers`.
_LAZY_LOCKERS = ("DatabaseLocker", "LeaseDatabaseLocker", "SharedFileLocker")


def __getattr__(name: str) -> Any:
    if name in _LAZY_LOCKERS:
        value = getattr(importlib.import_module(".lockers", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "AccessRefused",
    "AcquireRacesExceeded",
    "AdminLockTimeout",
    "AmqpLocker",
    "AmqpLocksError",
    "Audit",
    "AuthenticationFailed",
    "Backoff",
    "Broker",
    "BrokerClosed",
    "BrokerError",
    "BrokerTimeout",
    "BrokerUnreachable",
    "ClusterUnreachable",
    "ConfigurationError",
    "ConnectionLost",
    "DatabaseLocker",
    "FeatureUnavailable",
    "FenceMissing",
    "HolderRecord",
    "InvalidName",
    "InvalidQueueName",
    "KeepAliveTimeout",
    "Lease",
    "LeaseAwarePolicy",
    "LeaseDatabaseLocker",
    "LeaseReleased",
    "LockError",
    "LockShapeMismatch",
    "LockStatus",
    "LockTimeout",
    "LockableService",
    "LockedElsewhere",
    "Locker",
    "LockerStopped",
    "ModeMismatch",
    "Mutex",
    "NotReplicated",
    "PersistentSemaphore",
    "PreconditionFailed",
    "QueueNotFound",
    "RWLockStatus",
    "ReadWriteLock",
    "ReleaseUnconfirmed",
    "Removal",
    "ResourceLocked",
    "SemaphoreAdmin",
    "SemaphoreNotFound",
    "SharedFileLocker",
    "State",
    "TokenAdmin",
    "TokenSemaphore",
    "TokenSemaphoreNotFound",
    "TokenStatus",
    "WrongProcess",
    "__version__",
    "events",
    "lock_status",
    "metrics",
    "prepare_fences",
]
