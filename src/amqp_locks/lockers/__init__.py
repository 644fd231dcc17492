"""Pluggable lockers for master/standby election (ActiveMQ's design), one per module:

- `base`: the `Locker` protocol (start blocks as standby, stop interrupts, keep_alive);
- `file`: `SharedFileLocker`, the OS lock on `<dir>/lock`;
- `database`: `DatabaseLocker`, a long `SELECT ... FOR UPDATE` transaction;
- `lease_database`: `LeaseDatabaseLocker`, an expiring lease renewed by its holder;
- `amqp`: `AmqpLocker`, the exclusive-queue mutex;
- `config`: build one from a TOML file.

`amqp_locks.service.LockableService` runs a master's work under any of them.

The database lockers need SQLAlchemy (extras ``postgresql``, ``mysql``, ``sqlite``) and the
file locker POSIX ``fcntl``: both are imported on first use of those names, so ``import
amqp_locks`` stays light and works on every platform.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import LockedElsewhere, LockerStopped
from .amqp import AmqpLocker
from .base import DEFAULT_LOCK_ACQUIRE_SLEEP_INTERVAL, Locker

if TYPE_CHECKING:
    from .database import DatabaseLocker
    from .file import SharedFileLocker
    from .lease_database import LeaseDatabaseLocker

#: Names imported on first use: name -> module of this package.
_LAZY = {
    "DatabaseLocker": "database",
    "LeaseDatabaseLocker": "lease_database",
    "SharedFileLocker": "file",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module != "file":  # FeatureUnavailable naming the extra when SQLAlchemy is missing
        importlib.import_module(".sql", __name__)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


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
