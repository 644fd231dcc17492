"""Issue 22, point 1: the plain install works, and a feature that needs an extra says which.

An extra is made "not installed" by blocking its modules (``sys.modules[name] = None``) in
a fresh interpreter: what a wheel installed without extras sees. scripts/matrix does the
same with real venvs and the built wheel. No broker needed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from amqp_locks import FeatureUnavailable, extras

ROOT = Path(__file__).resolve().parents[1]

#: Every optional dependency's top-level module: blocked together, they are a plain install.
OPTIONAL = ("sqlalchemy", "psycopg", "pymysql", "prometheus_client", "tooz")


def _plain(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter where no optional dependency can be imported."""
    prelude = f"import sys\nfor m in {OPTIONAL!r}:\n    sys.modules[m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _plain(f"from amqp_locks.cli import main\nsys.exit(main({list(args)!r}))")


def test_the_extras_module_knows_every_extra_of_pyproject() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras.EXTRAS) == set(declared)


def test_plain_install_imports_the_package_and_the_command_line() -> None:
    r = _plain(
        """
        import amqp_locks, amqp_locks.aio, amqp_locks.cli, amqp_locks.metrics
        from amqp_locks import Broker, Mutex, PersistentSemaphore, TokenSemaphore, AmqpLocker
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in
                           ("sqlalchemy", "psycopg", "pymysql", "prometheus_client", "tooz")
                           and sys.modules[m] is not None))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok []"


@pytest.mark.parametrize("args", [["--help"], ["elect", "--help"], ["run", "--help"]])
def test_plain_install_help_works(args: list[str]) -> None:
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    assert "Usage: amqp-locks" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("url", "extra"),
    [
        ("postgresql+psycopg://u:p@db/app", "postgresql"),
        ("mysql+pymysql://u:p@db/app", "mysql"),
        ("sqlite:////tmp/x.db", "sqlite"),
    ],
)
@pytest.mark.parametrize("locker", ["database", "lease-database"])
def test_elect_with_a_database_locker_names_the_extra_in_one_line(
    locker: str, url: str, extra: str
) -> None:
    r = _cli("elect", "job", "--locker", locker, "--db-url", url, "--", "true")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert f"pip install 'amqp-locks[{extra}]'" in r.stderr
    assert "u:p@" not in r.stderr  # never the URL's password


def test_elect_config_file_with_a_database_locker_names_the_extra(tmp_path: Path) -> None:
    config = tmp_path / "locker.toml"
    config.write_text('[locker]\ntype = "lease-database"\nurl = "mysql+pymysql://db/app"\n')
    r = _cli("elect", "job", "--config", str(config), "--", "true")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "amqp-locks[mysql]" in r.stderr


def test_api_users_get_feature_unavailable_naming_the_extra() -> None:
    r = _plain(
        """
        import amqp_locks, amqp_locks.metrics
        for attempt in (lambda: amqp_locks.DatabaseLocker,
                        amqp_locks.metrics.enable,
                        lambda: __import__("amqp_locks.tooz_driver")):
            try:
                attempt()
            except amqp_locks.FeatureUnavailable as exc:
                print(exc)
        """
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3, r.stdout
    assert "amqp-locks[postgresql]" in lines[0]
    assert "pip install 'amqp-locks[metrics]'" in lines[1]
    assert "pip install 'amqp-locks[tooz]'" in lines[2]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql+psycopg://db/x", "pip install 'amqp-locks[postgresql]'"),
        ("postgresql://db/x", "use postgresql+psycopg://"),
        ("postgresql+psycopg2://db/x", "use postgresql+psycopg://"),
        ("mysql://db/x", "use mysql+pymysql://"),
        ("mariadb+pymysql://db/x", "pip install 'amqp-locks[mysql]'"),
    ],
)
def test_a_missing_database_driver_names_the_extra_and_the_url_form(url: str, says: str) -> None:
    err = extras.missing_driver(url, ModuleNotFoundError("No module named 'x'", name="x"))
    assert isinstance(err, FeatureUnavailable) and says in str(err)
    assert "\n" not in str(err)


def test_database_extra_by_dialect() -> None:
    assert extras.database_extra("postgresql+psycopg://h/d") == "postgresql"
    assert extras.database_extra("MariaDB://h/d") == "mysql"
    assert extras.database_extra("sqlite://") == "sqlite"
    assert extras.database_extra("oracle://h/d") is None


def test_classifiers_and_requires_python_are_the_pythons_the_matrix_tests() -> None:
    """scripts/matrix installs the wheel on exactly these Pythons; the metadata says so."""
    matrix = (ROOT / "scripts" / "matrix").read_text()
    m = re.search(r'^supported="([0-9. ]+)"$', matrix, re.MULTILINE)
    assert m is not None, "scripts/matrix no longer names its Pythons"
    tested = m.group(1).split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [
        c.rsplit(":: ", 1)[1]
        for c in project["classifiers"]
        if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert sorted(listed) == sorted(tested)
    oldest = min(tested, key=lambda v: tuple(int(p) for p in v.split(".")))
    assert project["requires-python"] == f">={oldest}"
