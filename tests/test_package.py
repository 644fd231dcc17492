"""What importing and configuring the library must (not) do: start servers, import heavy or
platform-specific modules, or put a password in a message. No broker needed."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

import amqp_locks
from amqp_locks import Broker, BrokerClosed, ConfigurationError, errors
from amqp_locks.transport.urls import resolve_urls


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_without_a_url_the_default_is_localhost_never_a_private_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AMQP_URL", raising=False)
    # What other AMQP clients default to (the contract), whatever the constant says.
    assert [str(u) for u in resolve_urls(None)] == ["amqp://guest:guest@localhost:5672/"]
    monkeypatch.setenv("AMQP_URL", "amqp://u:p@mq.example:5673/v")
    assert [str(u) for u in resolve_urls(None)] == ["amqp://u:p@mq.example:5673/v"]


def test_import_is_light_and_ships_no_dev_servers() -> None:
    r = _python(
        """
        import importlib.util, sys
        import amqp_locks
        print(sorted(m for m in sys.modules
                     if m.split(".")[0] in ("sqlalchemy", "amqp_locks_dev", "prometheus_client")))
        print(importlib.util.find_spec("amqp_locks.devbroker"))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "None"]


def test_no_sqlalchemy_installed_gives_a_clear_error_naming_the_extra() -> None:
    r = _python(
        """
        import sys
        sys.modules["sqlalchemy"] = None  # as if the extra were not installed
        import amqp_locks
        try:
            amqp_locks.LeaseDatabaseLocker
        except amqp_locks.FeatureUnavailable as exc:
            print("unavailable:", exc)
        print(amqp_locks.Mutex.__name__)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "unavailable: the database lockers need SQLAlchemy" in r.stdout
    assert "amqp-locks[postgresql]" in r.stdout and "Mutex" in r.stdout


def test_no_fcntl_imports_the_package_and_names_the_missing_feature(tmp_path: object) -> None:
    """What a Windows user gets: the package imports; the file locker says why it cannot."""
    r = _python(
        f"""
        import asyncio, subprocess, sys  # the stdlib's own POSIX users of fcntl come first
        for name in [m for m in sys.modules if m.startswith("amqp_locks")]:
            del sys.modules[name]
        sys.modules["fcntl"] = None
        import amqp_locks
        try:
            amqp_locks.SharedFileLocker({str(tmp_path)!r})
        except amqp_locks.FeatureUnavailable as exc:
            print("unavailable:", exc)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "unavailable: SharedFileLocker needs POSIX flock (fcntl)" in r.stdout


@pytest.mark.parametrize(
    "url",
    [
        "amqp://app:S3cretPw@mq:99999/",
        "amqp://app:S3cretPw@[::1/",
        "http://app:S3cretPw@mq/",
        "amqp://app:S3cretPw@mq:5672/,amqp://app:S3cretPw@mq:99999/",
    ],
)
def test_a_bad_url_never_shows_the_password(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigurationError) as info:
        Broker(url)
    text = str(info.value)
    assert "invalid AMQP URL" in text and "app:******@" in text
    assert "S3cretPw" not in text and info.value.__cause__ is None
    assert "S3cretPw" not in caplog.text


def test_a_bad_database_url_never_shows_the_password() -> None:
    with pytest.raises(ConfigurationError) as info:
        amqp_locks.LeaseDatabaseLocker("nosuchdialect://app:S3cretPw@db/x", "n")
    assert "app:******@db" in str(info.value) and "S3cretPw" not in str(info.value)


def test_every_error_is_in_errors_and_exported() -> None:
    classes = [
        v
        for v in vars(errors).values()
        if isinstance(v, type) and issubclass(v, Exception) and v.__module__ == errors.__name__
    ]
    assert len(classes) > 20
    for cls in classes:
        assert getattr(amqp_locks, cls.__name__) is cls, cls
        assert cls.__name__ in amqp_locks.__all__, cls
    assert issubclass(amqp_locks.LockTimeout, TimeoutError)
    assert issubclass(amqp_locks.LockTimeout, amqp_locks.LockError)
    assert issubclass(amqp_locks.TokenSemaphoreNotFound, amqp_locks.SemaphoreNotFound)


def test_a_closed_broker_is_a_state_error() -> None:
    b = Broker("amqp://guest:guest@127.0.0.1:1/")
    b.close()
    with pytest.raises(BrokerClosed) as info:
        amqp_locks.Mutex(b, "x").acquire(timeout=1)
    assert not isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


def test_wait_settings_are_checked() -> None:
    b = Broker("amqp://guest:guest@127.0.0.1:1/")
    with pytest.raises(ConfigurationError, match="blocking=False"):
        amqp_locks.Mutex(b, "x", blocking=False, timeout=3)
    with pytest.raises(ConfigurationError, match="timeout must be >= 0"):
        amqp_locks.PersistentSemaphore(b, "x", timeout=-2)
    # -1 is threading.Lock's "no timeout".
    assert amqp_locks.PersistentSemaphore(b, "x", timeout=-1).timeout is None
    b.close()


def test_version_has_one_source() -> None:
    from importlib.metadata import version

    assert version("amqp-locks") == amqp_locks.__version__
