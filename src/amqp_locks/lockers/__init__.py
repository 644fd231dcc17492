"""Pluggable lockers for master/standby election (ActiveMQ's design), one per module:

- `base`: the `Locker` protocol (start blocks as standby, stop interrupts, keep_alive);
- `file`: `SharedFileLocker`, the OS lock on `<dir>/lock`;
- `database`: `DatabaseLocker`, a long `SELECT ... FOR UPDATE` transaction;
- `lease`: `LeaseDatabaseLocker`, an expiring lease renewed by its holder;
- `amqp`: `AmqpLocker`, the exclusive-queue mutex;
- `config`: build one from a TOML file.

`amqp_locks.service.LockableService` runs a master's work under any of them.
"""

from .amqp import AmqpLocker
from .base import DEFAULT_LOCK_ACQUIRE_SLEEP_INTERVAL, LockedElsewhere, Locker, LockerStopped
from .database import DatabaseLocker
from .file import SharedFileLocker
from .lease import LeaseDatabaseLocker

__all__ = [
    "DEFAULT_LOCK_ACQUIRE_SLEEP_INTERVAL",
    "AmqpLocker",
    "DatabaseLocker",
    "LeaseDatabaseLocker",
    "LockedElsewhere",
    "Locker",
    "LockerStopped",
    "SharedFileLocker",
]
