"""amqp-locks: distributed locks, counting semaphores and master/standby election on RabbitMQ.

The sync API lives here; the asyncio twin is :mod:`amqp_locks.aio`. Both drive the same core
on a private I/O thread.
"""

from .errors import (
    AccessRefused,
    AcquireRacesExceeded,
    AdminLockTimeout,
    AmqpLocksError,
    AuthenticationFailed,
    BrokerError,
    BrokerUnreachable,
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
from .mutex import Mutex
from .semaphore import PersistentSemaphore, Removal, SemaphoreAdmin
from .tokens import Audit, TokenSemaphore, TokenSemaphoreNotFound, TokenStatus
from .transport import Broker
from .waiting import Backoff

__version__ = "0.1.0"

__all__ = [
    "AccessRefused",
    "AcquireRacesExceeded",
    "AdminLockTimeout",
    "AmqpLocksError",
    "Audit",
    "AuthenticationFailed",
    "Backoff",
    "Broker",
    "BrokerError",
    "BrokerUnreachable",
    "ConfigurationError",
    "ConnectionLost",
    "InvalidName",
    "Lease",
    "LeaseReleased",
    "LockError",
    "Mutex",
    "PersistentSemaphore",
    "PreconditionFailed",
    "QueueNotFound",
    "Removal",
    "ResourceLocked",
    "SemaphoreAdmin",
    "SemaphoreNotFound",
    "TokenSemaphore",
    "TokenSemaphoreNotFound",
    "TokenStatus",
    "__version__",
]
