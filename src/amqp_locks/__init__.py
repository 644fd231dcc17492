"""amqp-locks: distributed locks, counting semaphores and master/standby election on RabbitMQ.

The sync API lives here; the asyncio twin is :mod:`amqp_locks.aio`. Both drive the same core
on a private I/O thread.
"""

from . import events, metrics
from .errors import (
    AccessRefused,
    AcquireRacesExceeded,
    AdminLockTimeout,
    AmqpLocksError,
    AuthenticationFailed,
    BrokerError,
    BrokerUnreachable,
    ClusterUnreachable,
    ConfigurationError,
    ConnectionLost,
    InvalidName,
    LeaseReleased,
    LockError,
    PreconditionFailed,
    QueueNotFound,
    ResourceLocked,
    SemaphoreNotFound,
)
from .lease import Lease
from .lockers import (
    AmqpLocker,
    DatabaseLocker,
    LeaseDatabaseLocker,
    LockedElsewhere,
    Locker,
    LockerStopped,
    SharedFileLocker,
)
from .mutex import Mutex
from .semaphore import PersistentSemaphore, Removal, SemaphoreAdmin
from .service import LeaseAwarePolicy, LockableService, State
from .tokens import Audit, TokenSemaphore, TokenSemaphoreNotFound, TokenStatus
from .transport import Broker
from .waiting import Backoff

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
    "BrokerError",
    "BrokerUnreachable",
    "ClusterUnreachable",
    "ConfigurationError",
    "ConnectionLost",
    "DatabaseLocker",
    "InvalidName",
    "Lease",
    "LeaseAwarePolicy",
    "LeaseDatabaseLocker",
    "LeaseReleased",
    "LockError",
    "LockableService",
    "LockedElsewhere",
    "Locker",
    "LockerStopped",
    "Mutex",
    "PersistentSemaphore",
    "PreconditionFailed",
    "QueueNotFound",
    "Removal",
    "ResourceLocked",
    "SemaphoreAdmin",
    "SemaphoreNotFound",
    "SharedFileLocker",
    "State",
    "TokenSemaphore",
    "TokenSemaphoreNotFound",
    "TokenStatus",
    "__version__",
    "events",
    "metrics",
]
