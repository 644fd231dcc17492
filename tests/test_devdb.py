"""Real (no mocks) tests of the private PostgreSQL/MariaDB server manager."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import amqp_locks_dev.devdb as devdb

from .spawn import run_script


def _installable(kind: str) -> bool:
    return devdb._tools(kind) is not None or (os.geteuid() == 0 and bool(shutil.which("apt-get")))


KINDS = [
    pytest.param(
        kind,
        marks=pytest.mark.skipif(
            not _installable(kind), reason=f"{kind} not installed and cannot install it"
        ),
    )
    for kind in devdb.KINDS
]


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Path]]:
    """kind, a unique name and a base dir postgres can traverse; always stopped and removed."""
    kind: str = request.param
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    root = devdb.db_fixture_base()
    base = root / kind
    try:
        yield kind, name, base
    finally:
        devdb.stop(kind, name, base)
        shutil.rmtree(root, ignore_errors=True)


def _count(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM devdb_t")).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.parametrize("server", KINDS, indirect=True)
def test_lifecycle(server: tuple[str, str, Path]) -> None:
    kind, name, base = server
    assert devdb.status(kind, name, base) is None
    info = devdb.start(kind, name, base)
    assert info.kind == kind and info.base_dir == base.resolve()
    assert info.url.startswith(
        "postgresql+psycopg://" if kind == "postgresql" else "mysql+pymysql://"
    )

    engine = sa.create_engine(info.url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE devdb_t (id INTEGER PRIMARY KEY, v VARCHAR(20))"))
        conn.execute(sa.text("INSERT INTO devdb_t VALUES (1, 'one'), (2, 'two')"))
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, v FROM devdb_t ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(1, "one"), (2, "two")]
    if kind == "mariadb":  # its temporary files in its own directory, not the shared /tmp
        with engine.connect() as conn:
            tmpdir = conn.execute(sa.text("SELECT @@tmpdir")).scalar_one()
        assert Path(tmpdir) == info.base_dir / "tmp"
    engine.dispose()

    # Idempotent: the same running server, same port, same pid.
    pid = devdb._read_state(kind, info.base_dir)
    assert devdb.start(kind, name, base) == info
    assert devdb._read_state(kind, info.base_dir) == pid
    assert devdb.status(kind, name, base) == info

    # Restart keeps port (the URL) and data.
    assert devdb.restart(kind, name, base) == info
    assert _count(info.url) == 2

    # A hard kill looks like a crash; start comes back on the same URL with the data.
    assert devdb.kill(kind, name, base) is True
    assert devdb.status(kind, name, base) is None
    assert devdb.start(kind, name, base) == info
    assert _count(info.url) == 2

    assert devdb.stop(kind, name, base) is True
    assert devdb.status(kind, name, base) is None
    assert devdb.stop(kind, name, base) is False


@pytest.mark.parametrize("server", KINDS, indirect=True)
def test_only_our_user_over_tcp(server: tuple[str, str, Path]) -> None:
    """The superuser (postgres / root) cannot log in over TCP; our user needs its password."""
    kind, name, base = server
    info = devdb.start(kind, name, base)
    admin = "postgres" if kind == "postgresql" else "root"
    for user, password in ((admin, ""), (info.user, "wrong")):
        bad = info.url.replace(f"{info.user}:{info.password}@", f"{user}:{password}@")
        engine = sa.create_engine(bad)
        with pytest.raises(sa.exc.OperationalError):
            engine.connect().close()
        engine.dispose()


def test_cli_script() -> None:
    """scripts/db prints only the URL, so `DB_URL=$(scripts/db url postgresql)` works."""
    kind = next((k for k in devdb.KINDS if devdb._tools(k) is not None), None)
    if kind is None:
        pytest.skip("no database server installed")
    root = devdb.db_fixture_base()
    args = ["--name", "cli", "--base-dir", str(root / "cli")]

    def db(*cmd: str) -> subprocess.CompletedProcess[str]:
        return run_script("db", *cmd, kind, *args)

    try:
        started = db("url")
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip()
        assert url.count("\n") == 0 and "127.0.0.1" in url
        assert db("status").stdout.strip() == url
        assert db("stop").returncode == 0
        gone = db("status")
        assert gone.returncode == 3 and gone.stdout.strip() == "not running"
    finally:
        db("stop")
        shutil.rmtree(root, ignore_errors=True)


def test_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(devdb.DevDbError):
        devdb.status("sqlite", "x", tmp_path)
    with pytest.raises(devdb.DevDbError):
        devdb.status("postgresql", "bad name", tmp_path)
    with pytest.raises(devdb.DevDbError):
        devdb.status("postgresql", "x", tmp_path / ("long" * 30))
    assert devdb.stop("mariadb", "x", tmp_path / "never-started") is False
