"""Choose and configure a locker from a TOML file (the seed's XML examples, in TOML).

```toml
[service]                      # <persistenceAdapter ... lockKeepAlivePeriod="5000">
use_lock = true
lock_keep_alive_period = 5.0

[locker]                       # <lease-database-locker lockAcquireSleepInterval="10000"/>
type = "lease-database"        # file | database | lease-database | amqp
name = "scheduler"
lock_acquire_sleep_interval = 10.0
url = "postgresql+psycopg://app:secret@db/app"
lease_holder_id = "node-a"     # optional; unique per process by default
max_allowable_diff_from_db_time = 1.0
```
A `file` locker takes `directory`; an `amqp` locker takes `amqp_url` (default: $AMQP_URL, then
the private dev node) and `heartbeat`. Unknown keys are refused by name.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..extras import require_database
from .base import Locker

_COMMON = {"type", "name", "lock_acquire_sleep_interval", "fail_if_locked"}
_KEYS = {
    "file": _COMMON | {"directory"},
    "database": _COMMON | {"url"},
    "lease-database": _COMMON
    | {"url", "lease_holder_id", "max_allowable_diff_from_db_time", "lease_duration"},
    "amqp": _COMMON | {"amqp_url", "heartbeat"},
}
_SERVICE_KEYS = {"use_lock", "lock_keep_alive_period"}


@dataclass(frozen=True)
class ServiceConfig:
    locker: Locker
    use_lock: bool
    lock_keep_alive_period: float


def build_locker(section: dict[str, Any]) -> Locker:
    """A locker from a `[locker]` table. Each type's module is imported only when that
    type is asked for: an `amqp` locker needs no database extra."""
    kind = section.get("type")
    if kind not in _KEYS:
        raise ConfigurationError(
            f"[locker] type must be one of {', '.join(sorted(_KEYS))}; got {kind!r}"
        )
    unknown = set(section) - _KEYS[kind]
    if unknown:
        raise ConfigurationError(f"[locker] unknown keys for type {kind!r}: {sorted(unknown)}")
    opts = {k: v for k, v in section.items() if k in _COMMON - {"type", "name"}}
    name = section.get("name", "lock" if kind == "file" else "default")

    def need(key: str) -> Any:
        if key not in section:
            raise ConfigurationError(f"[locker] type {kind!r} needs {key!r}")
        return section[key]

    if kind == "file":
        from .file import SharedFileLocker

        return SharedFileLocker(need("directory"), name, **opts)
    if kind in ("database", "lease-database"):
        require_database(str(need("url")))
    if kind == "database":
        from .database import DatabaseLocker

        return DatabaseLocker(need("url"), name, **opts)
    if kind == "lease-database":
        from .lease_database import LeaseDatabaseLocker

        extra = {
            k: section[k]
            for k in ("lease_holder_id", "max_allowable_diff_from_db_time", "lease_duration")
            if k in section
        }
        return LeaseDatabaseLocker(need("url"), name, **extra, **opts)
    from ..transport.broker import Broker
    from .amqp import AmqpLocker

    broker = Broker(section.get("amqp_url"), heartbeat=float(section.get("heartbeat", 10.0)))
    return AmqpLocker(broker, name, **opts)


def load(path: str | Path) -> ServiceConfig:
    """Read a TOML file with `[locker]` and optional `[service]` tables."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read locker config {str(path)!r}: {exc}") from exc
    if "locker" not in data:
        raise ConfigurationError(f"{str(path)!r} has no [locker] table")
    service = data.get("service", {})
    unknown = set(service) - _SERVICE_KEYS
    if unknown:
        raise ConfigurationError(f"[service] unknown keys: {sorted(unknown)}")
    return ServiceConfig(
        locker=build_locker(data["locker"]),
        use_lock=bool(service.get("use_lock", True)),
        lock_keep_alive_period=float(service.get("lock_keep_alive_period", 0.0)),
    )
