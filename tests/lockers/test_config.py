"""TOML configuration selects and configures a locker, refusing what it does not know."""

from __future__ import annotations

from pathlib import Path

import pytest

from amqp_locks import ConfigurationError, LockableService
from amqp_locks.lockers import AmqpLocker, DatabaseLocker, LeaseDatabaseLocker, SharedFileLocker
from amqp_locks.lockers.config import load


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "locker.toml"
    path.write_text(text)
    return path


def test_each_locker_type(tmp_path: Path, amqp_url: str) -> None:
    db = f"sqlite:///{tmp_path / 'c.db'}"
    cases = {
        f'type = "file"\ndirectory = "{tmp_path}"\nlock_acquire_sleep_interval = 5.0': (
            SharedFileLocker
        ),
        f'type = "database"\nurl = "{db}"\nname = "orders"': DatabaseLocker,
        f'type = "lease-database"\nurl = "{db}"\nlease_holder_id = "node-a"\n'
        "max_allowable_diff_from_db_time = 1.0": LeaseDatabaseLocker,
        f'type = "amqp"\namqp_url = "{amqp_url}"\nname = "sched"': AmqpLocker,
    }
    for body, cls in cases.items():
        config = load(
            _write(tmp_path, f"[service]\nlock_keep_alive_period = 2.0\n[locker]\n{body}\n")
        )
        assert isinstance(config.locker, cls)
        assert config.lock_keep_alive_period == 2.0 and config.use_lock
        config.locker.close()
    lease = load(
        _write(
            tmp_path, f'[locker]\ntype = "lease-database"\nurl = "{db}"\nlease_holder_id = "n"\n'
        )
    ).locker
    assert isinstance(lease, LeaseDatabaseLocker) and lease.holder_id == "n"
    assert lease.lock_acquire_sleep_interval == 10.0  # ActiveMQ's default
    lease.close()


def test_bad_configs_name_the_problem(tmp_path: Path) -> None:
    bad = {
        '[locker]\ntype = "zookeeper"': "type must be one of",
        '[locker]\ntype = "file"': "needs 'directory'",
        '[locker]\ntype = "file"\ndirectory = "/tmp"\ncolour = "red"': "unknown keys",
        '[service]\nlock_keep_alive = 3\n[locker]\ntype = "file"\ndirectory = "/t"': "unknown",
        "[service]\nuse_lock = true": r"no \[locker\]",
        "[locker\n": "cannot read",
    }
    for body, message in bad.items():
        with pytest.raises(ConfigurationError, match=message):
            load(_write(tmp_path, body))


def test_service_from_config_refuses_a_keep_alive_longer_than_the_lease(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'c.db'}"
    path = _write(
        tmp_path,
        "[service]\nlock_keep_alive_period = 12.0\n"
        f'[locker]\ntype = "lease-database"\nurl = "{db}"\n',
    )
    with pytest.raises(ConfigurationError, match="shorter than the lease"):
        LockableService.from_config(str(path), lambda stop: None)
