"""A private PostgreSQL or MariaDB server on 127.0.0.1 for development, tests and demos.

The database lockers need a real SQL server, and tests need to restart or kill it
mid-mastership; a system-wide service (shared, systemd-managed, on port 5432/3306)
allows neither.  So, like :mod:`amqp_locks_dev.devbroker`, each server lives entirely in
its own ``base_dir`` (data, config, log, unix socket, ``node.json`` state), listens
on loopback only, on a free port, and is started/stopped by us directly (no
``pg_ctl``/``mysqld_safe`` wrappers) so we know its pid and can signal it.

Users: PostgreSQL refuses to run as root, so under root it runs as the ``postgres``
user, which must own ``base_dir`` and be able to traverse every parent directory
(we add the ``o+x`` search bit where it is missing; nothing becomes listable).
MariaDB runs as the invoking user (``--user=root`` under root).  Each server gets a
database ``amqplocks`` owned by / granted to user ``amqplocks`` (password
``amqplocks``) that may only log in over 127.0.0.1; administrative access is only
through the unix socket inside ``base_dir``.

Durability is relaxed for speed (``fsync=off`` / ``innodb_flush_log_at_trx_commit=2``):
each commit is written to the OS before it is acknowledged, so committed data survives
server restarts and kills, not a host crash.

CLI: ``python -m amqp_locks_dev.devdb start|stop|status|restart|url|kill postgresql|mariadb
[--name NAME]``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .localserver import (
    HOST,
    Commands,
    Launch,
    OnePortInfo,
    OnePortServer,
    apt_install,
    cli,
    home,
    pid_alive,
    resolve_dir,
    signal_and_wait,
)

__all__ = [
    "DEFAULT_NAME",
    "KINDS",
    "DbInfo",
    "DevDbError",
    "db_fixture_base",
    "ensure_installed",
    "kill",
    "main",
    "restart",
    "start",
    "status",
    "stop",
    "url",
]

KINDS = ("postgresql", "mariadb")
DEFAULT_NAME = "amqplocks"
DB_USER = DB_PASSWORD = DB_NAME = "amqplocks"
#: sun_path is 108 bytes; both servers put their socket directly in base_dir.
_MAX_SOCKET_PATH = 100
_SEARCH_DIRS = ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin", "/usr/libexec")
_MARIADB_SYSTEM_PID = Path("/run/mysqld/mysqld.pid")
_log = logging.getLogger(__name__)


class DevDbError(RuntimeError):
    """The private database could not be installed, started, stopped or queried."""


@dataclass(frozen=True)
class DbInfo(OnePortInfo):
    """Where a private server lives and listens; enough to connect to it or restart it."""

    kind: str
    port: int
    base_dir: Path
    user: str = DB_USER
    password: str = DB_PASSWORD
    database: str = DB_NAME

    @property
    def url(self) -> str:
        """SQLAlchemy URL for the ``amqplocks`` database over TCP on loopback."""
        driver = "postgresql+psycopg" if self.kind == "postgresql" else "mysql+pymysql"
        return f"{driver}://{self.user}:{self.password}@{HOST}:{self.port}/{self.database}"

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def socket_path(self) -> Path:
        if self.kind == "postgresql":
            return self.base_dir / f".s.PGSQL.{self.port}"
        return self.base_dir / "mysqld.sock"

    @property
    def pid_file(self) -> Path:
        if self.kind == "postgresql":
            return self.data_dir / "postmaster.pid"
        return self.base_dir / "mariadbd.pid"

    @property
    def log_file(self) -> Path:
        """Server log (PostgreSQL's stderr; MariaDB's ``log-error``)."""
        return self.base_dir / "server.log"

    @property
    def startup_log(self) -> Path:
        """Server stdout/stderr; for PostgreSQL that is its log."""
        return self.log_file if self.kind == "postgresql" else super().startup_log


# --------------------------------------------------------------------------- install


@dataclass(frozen=True)
class _Tools:
    server: Path
    initdb: Path
    client: Path | None  # psql (PostgreSQL only)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise DevDbError(f"unknown database kind {kind!r}: use one of {', '.join(KINDS)}")


def _version_key(path: Path) -> tuple[int, ...]:
    """Sort key for ``/usr/lib/postgresql/<version>/bin`` (numeric, so 9.6 < 15)."""
    return tuple(int(p) for p in re.findall(r"\d+", path.parent.name))


def _which(names: Sequence[str]) -> Path | None:
    """Like ``shutil.which`` but also looks in sbin dirs missing from a user's PATH."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SEARCH_DIRS])
    for name in names:
        found = shutil.which(name, path=path)
        if found:
            return Path(found)
    return None


def _tools(kind: str) -> _Tools | None:
    if kind == "postgresql":
        bins = [b for b in Path("/usr/lib/postgresql").glob("*/bin") if (b / "postgres").exists()]
        if bins:
            b = max(bins, key=_version_key)
            return _Tools(b / "postgres", b / "initdb", b / "psql")
        server = _which(["postgres"])  # a non-Debian install with everything on PATH
        if server and (server.parent / "initdb").exists():
            d = server.parent
            return _Tools(server, d / "initdb", d / "psql" if (d / "psql").exists() else None)
        return None
    server = _which(["mariadbd", "mysqld"])
    initdb = _which(["mariadb-install-db", "mysql_install_db"])
    return _Tools(server, initdb, None) if server and initdb else None


def _require_tools(kind: str) -> _Tools:
    tools = _tools(kind)
    if tools is None:
        raise DevDbError(f"{kind} server is not installed; call ensure_installed({kind!r})")
    return tools


def _system_mariadb_pid() -> int | None:
    """pid of the Debian package's own server, if one is running."""
    try:
        pid = int(_MARIADB_SYSTEM_PID.read_text().strip())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) and (b"mariadbd" in cmd or b"mysqld" in cmd) else None


def ensure_installed(kind: str) -> None:
    """Install the server from Debian's packages if missing, without a system service.

    Only the binaries are wanted: our servers are private, so the package's service is
    kept from starting (policy-rc.d) and, for MariaDB, stopped if it started anyway.
    """
    _check_kind(kind)
    if _tools(kind) is not None:
        return
    package = "postgresql" if kind == "postgresql" else "mariadb-server"
    before = _system_mariadb_pid()
    apt_install(package, DevDbError, "amqp_locks_dev.devdb")
    if kind == "mariadb":
        # Belt and braces: stop a system server the package started (only that one).
        pid = _system_mariadb_pid()
        if pid is not None and pid != before:
            signal_and_wait(pid, signal.SIGTERM, 60.0)
    if _tools(kind) is None:
        raise DevDbError(f"apt-get installed {package} but its binaries were not found")


# ----------------------------------------------------------------------------- state


def _resolve(kind: str, name: str, base_dir: Path | None) -> Path:
    """``base_dir``, else ``$AMQP_LOCKS_HOME/db/<kind>-<name>`` (default: the user's cache
    directory)."""
    _check_kind(kind)
    base = resolve_dir(name, base_dir, lambda: home() / "db" / f"{kind}-{name}", DevDbError)
    if len(str(base)) + len("/.s.PGSQL.65535") > _MAX_SOCKET_PATH:
        raise DevDbError(f"base dir {base} is too long for a unix socket path; use a shorter one")
    return base


def db_fixture_base(prefix: str = "amqp-locks-db-") -> Path:
    """A fresh temp directory the ``postgres`` user can traverse.

    pytest's ``tmp_path`` lives under a 0700 ``/tmp/pytest-of-root`` when run as root,
    which PostgreSQL (running as ``postgres``) cannot enter.  The caller removes it.
    """
    d = Path(tempfile.mkdtemp(prefix=prefix))
    d.chmod(0o711)
    return d


def _read_state(kind: str, base_dir: Path) -> tuple[DbInfo, int | None] | None:
    return _server(kind).read_state(base_dir)


# ------------------------------------------------------------------------ users/perms


@dataclass(frozen=True)
class _Account:
    uid: int
    gid: int
    groups: tuple[int, ...]


def _server_account(kind: str) -> _Account | None:
    """The account PostgreSQL runs as when we are root; None means "as ourselves"."""
    if kind != "postgresql" or os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise DevDbError(
            "PostgreSQL refuses to run as root and there is no 'postgres' user; "
            "install the postgresql package or run as a normal user"
        ) from None
    return _Account(pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist("postgres", pw.pw_gid)))


def _as_account(acct: _Account | None) -> dict[str, Any]:
    """Popen/run keyword arguments that drop to ``acct`` (all of uid, gid and groups)."""
    if acct is None:
        return {}
    return {"user": acct.uid, "group": acct.gid, "extra_groups": list(acct.groups)}


def _make_reachable(base_dir: Path, acct: _Account) -> None:
    """Let ``acct`` own ``base_dir`` and traverse its parents (adds only ``o+x``)."""
    for parent in reversed(base_dir.parents):
        st = parent.stat()
        if st.st_uid == acct.uid:
            ok = bool(st.st_mode & stat.S_IXUSR)
        elif st.st_gid in acct.groups:
            ok = bool(st.st_mode & stat.S_IXGRP)
        else:
            ok = bool(st.st_mode & stat.S_IXOTH)
        if not ok:
            # A visible, one-time change of a shared directory (e.g. /root -> 0701).
            _log.warning(
                "devdb: adding o+x to %s so the postgres user can reach %s", parent, base_dir
            )
            os.chmod(parent, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
    os.chown(base_dir, acct.uid, acct.gid)
    base_dir.chmod(0o700)


# -------------------------------------------------------------------------- liveness


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _ping(kind: str, port: int, timeout: float = 2.0) -> bool:
    """True if a server of ``kind`` answers on ``port`` (protocol handshake, no login)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            if kind == "postgresql":
                # SSLRequest: any server answers a single 'S' or 'N'.
                sock.sendall(struct.pack("!ii", 8, 80877103))
                return _recv_exact(sock, 1) in (b"S", b"N")
            # MySQL protocol: the server speaks first; greeting starts with version 10.
            header = _recv_exact(sock, 5)
            return len(header) == 5 and header[4] == 10
    except OSError:
        return False


# -------------------------------------------------------------------- process control


def _env(info: DbInfo) -> dict[str, str]:
    """A clean environment: inherited PG*/MYSQL_* variables must not leak in."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "TMPDIR")}
    env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    env.update({"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": str(info.base_dir)})
    if "TMPDIR" in env and info.kind == "postgresql" and os.geteuid() == 0:
        del env["TMPDIR"]  # may not be writable by postgres
    return env


def _run(
    info: DbInfo,
    cmd: Sequence[str],
    *,
    acct: _Account | None = None,
    input_text: str | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(cmd),
            env={**_env(info), **(extra_env or {})},
            cwd=info.base_dir,
            input=input_text,
            stdin=None if input_text is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **_as_account(acct),
        )
    except subprocess.TimeoutExpired as exc:
        raise DevDbError(f"{Path(cmd[0]).name} timed out after {timeout}s") from exc


def _checked(proc: subprocess.CompletedProcess[str], what: str) -> str:
    if proc.returncode != 0:
        output = (proc.stderr + proc.stdout)[-3000:]
        raise DevDbError(f"{what} failed ({proc.returncode}):\n{output}")
    return proc.stdout


# PostgreSQL --------------------------------------------------------------------------

_PG_SETUP_SQL = f"""
SELECT format('CREATE ROLE %I LOGIN', '{DB_USER}')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{DB_USER}') \\gexec
ALTER ROLE {DB_USER} LOGIN PASSWORD '{DB_PASSWORD}';
SELECT format('CREATE DATABASE %I OWNER %I', '{DB_NAME}', '{DB_USER}')
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '{DB_NAME}') \\gexec
GRANT ALL PRIVILEGES ON DATABASE {DB_NAME} TO {DB_USER};
"""


def _pg_prepare(info: DbInfo, tools: _Tools, acct: _Account | None) -> list[str]:
    """initdb once (superuser only via the socket; passwords over TCP), write config."""
    if acct is not None:
        _make_reachable(info.base_dir, acct)
    data = info.data_dir
    if not (data / "PG_VERSION").exists():
        shutil.rmtree(data, ignore_errors=True)  # a half-finished earlier initdb
        cmd = [
            str(tools.initdb), "-D", str(data), "-U", "postgres", "--no-sync",
            "--auth-local=trust", "--auth-host=scram-sha-256",
            "--encoding=UTF8", "--locale=C",
        ]  # fmt: skip
        _checked(_run(info, cmd, acct=acct, timeout=120), "initdb")
        with (data / "postgresql.conf").open("a") as fh:
            fh.write("\ninclude = 'amqp_locks.conf'\n")
    conf = data / "amqp_locks.conf"
    conf.write_text(
        "# Generated by amqp_locks_dev.devdb; rewritten on every start.\n"
        f"listen_addresses = '{HOST}'\n"
        f"port = {info.port}\n"
        f"unix_socket_directories = '{info.base_dir}'\n"
        "unix_socket_permissions = 0700\n"
        "max_connections = 200\n"
        "fsync = off\n"
        # on: a commit's WAL is written (not fsynced) before it is acknowledged, so a
        # killed server keeps it; off lost acknowledged lease renewals in the fault
        # tests (a fencing token granted twice after a kill).
        "synchronous_commit = on\n"
        "full_page_writes = off\n"
        "log_min_messages = warning\n"
    )
    if acct is not None:
        os.chown(conf, acct.uid, acct.gid)
    return [str(tools.server), "-D", str(data)]


#: What PostgreSQL answers while it cannot take connections yet (or any more): starting,
#: stopping, or replaying its log after a crash (``kill`` then ``start``).
_PG_NOT_READY = (
    "starting up",
    "shutting down",
    "not yet accepting connections",
    "in recovery mode",
)


def _pg_not_ready_yet(stderr: str) -> bool:
    return any(text in stderr for text in _PG_NOT_READY)


def _pg_ready(info: DbInfo, tools: _Tools) -> bool:
    """Create the role/database (idempotent), then log in as them over TCP."""
    if not _ping(info.kind, info.port) or tools.client is None:
        return False
    psql = [str(tools.client), "-X", "-q", "-v", "ON_ERROR_STOP=1"]
    admin = _run(
        info,
        [*psql, "-h", str(info.base_dir), "-p", str(info.port), "-U", "postgres", "-d", "postgres"],
        input_text=_PG_SETUP_SQL,
    )
    if admin.returncode != 0:
        if _pg_not_ready_yet(admin.stderr):
            return False
        _checked(admin, "creating the amqplocks role and database")
    dsn = f"host={HOST} port={info.port} user={DB_USER} dbname={DB_NAME}"
    login = _run(info, [*psql, "-d", dsn, "-c", "SELECT 1"], extra_env={"PGPASSWORD": DB_PASSWORD})
    return login.returncode == 0


# MariaDB -----------------------------------------------------------------------------


def _maria_init_sql() -> str:
    # --init-file runs at every start before connections are accepted; one
    # statement per line.  Anonymous users would shadow ours on the socket.
    lines = [f"CREATE DATABASE IF NOT EXISTS {DB_NAME} CHARACTER SET utf8mb4;"]
    for host in (HOST, "localhost"):
        lines += [
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'{host}' IDENTIFIED BY '{DB_PASSWORD}';",
            f"GRANT ALL PRIVILEGES ON {DB_NAME}.* TO '{DB_USER}'@'{host}';",
        ]
    for host in ("localhost", socket.gethostname()):
        lines.append(f"DROP USER IF EXISTS ''@'{host}';")
    return "\n".join(lines) + "\n"


def _maria_prepare(info: DbInfo, tools: _Tools) -> list[str]:
    """mariadb-install-db once (root only via the socket), write my.cnf and init file."""
    info.base_dir.chmod(0o700)
    as_root = ["--user=root"] if os.geteuid() == 0 else []
    data = info.data_dir
    # Its own temporary directory: the default, /tmp, is shared with every other server
    # and test on the machine. In a CI run (2026-11-29) two lanes' bootstraps ran at once
    # and one failed: "Error on delete of '/tmp/#sql-temptable-168c-1-1e.MAI' (Errcode: 2)".
    tmp = info.base_dir / "tmp"
    tmp.mkdir(mode=0o700, exist_ok=True)
    if not (data / "mysql").is_dir():
        shutil.rmtree(data, ignore_errors=True)
        cmd = [
            str(tools.initdb), "--no-defaults", f"--datadir={data}", *as_root,
            "--auth-root-authentication-method=socket", "--skip-test-db",
            "--skip-name-resolve", f"--tmpdir={tmp}",
        ]  # fmt: skip
        _checked(_run(info, cmd, timeout=180), "mariadb-install-db")
    init_sql = info.base_dir / "init.sql"
    init_sql.write_text(_maria_init_sql())
    cnf = info.base_dir / "my.cnf"
    cnf.write_text(
        "# Generated by amqp_locks_dev.devdb; rewritten on every start.\n"
        "[mysqld]\n"
        f"datadir = {data}\n"
        f"tmpdir = {tmp}\n"
        f"socket = {info.socket_path}\n"
        f"pid-file = {info.pid_file}\n"
        f"log-error = {info.log_file}\n"
        f"init-file = {init_sql}\n"
        f"port = {info.port}\n"
        f"bind-address = {HOST}\n"
        "skip-name-resolve\n"
        "max_connections = 300\n"
        "character-set-server = utf8mb4\n"
        "collation-server = utf8mb4_unicode_ci\n"
        "innodb_buffer_pool_size = 64M\n"
        "innodb_flush_log_at_trx_commit = 2\n"
        "log_warnings = 1\n"  # no "aborted connection" note for every status() probe
    )
    # --defaults-file must be the first option.
    return [str(tools.server), f"--defaults-file={cnf}", *as_root]


def _maria_ready(info: DbInfo) -> bool:
    """Log in as amqplocks over TCP (PyMySQL if available, else the server greeting)."""
    if not _ping(info.kind, info.port):
        return False
    try:
        import pymysql  # type: ignore[import-untyped]
    except ImportError:
        return True
    try:
        conn = pymysql.connect(
            host=HOST, port=info.port, user=DB_USER, password=DB_PASSWORD,
            database=DB_NAME, connect_timeout=2,
        )  # fmt: skip
    except pymysql.MySQLError:
        return False
    conn.close()
    return True


# Both --------------------------------------------------------------------------------


class _Servers(OnePortServer[DbInfo]):
    """How a private server of one kind is launched, probed and stopped (see LocalServer)."""

    error = DevDbError
    hard_signals = ((signal.SIGKILL, 10.0),)
    kill_tree = True  # PostgreSQL's backends setsid(): signal them too

    def __init__(self, kind: str) -> None:
        self.kind = kind
        # SIGINT is PostgreSQL's "fast" shutdown (what pg_ctl stop -m fast sends): roll
        # back sessions, checkpoint.  SIGTERM is MariaDB's normal shutdown.
        self.stop_signal = signal.SIGINT if kind == "postgresql" else signal.SIGTERM

    def ledger_id(self) -> str:
        return f"{type(self).__module__}:{self.kind}"

    def decode(self, base_dir: Path, raw: dict[str, Any]) -> DbInfo | None:
        return DbInfo(self.kind, int(raw["port"]), base_dir) if raw["kind"] == self.kind else None

    def encode(self, info: DbInfo) -> dict[str, Any]:
        return {"kind": info.kind, "port": info.port}

    def describe(self, info: DbInfo) -> str:
        return f"{info.kind} server in {info.base_dir}"

    def answers(self, info: DbInfo) -> bool:
        return _ping(info.kind, info.port)

    def prepare(self, info: DbInfo) -> Launch:
        """Data directory and config; ready once we can log in as ``amqplocks``."""
        tools = _require_tools(info.kind)
        acct = _server_account(info.kind)
        env = _env(info)
        if info.kind == "postgresql":
            argv = _pg_prepare(info, tools, acct)
            return Launch(argv, env, lambda _: _pg_ready(info, tools), _as_account(acct))
        return Launch(_maria_prepare(info, tools), env, lambda _: _maria_ready(info))


@functools.cache
def _server(kind: str) -> _Servers:
    _check_kind(kind)
    return _Servers(kind)


def ledger_server(kind: str | None) -> _Servers:
    """The lifecycle the server ledger's ``amqp_locks_dev.devdb:KIND`` entries name."""
    if kind is None:
        raise DevDbError("a devdb ledger entry names its kind (postgresql, mariadb)")
    return _server(kind)


# ------------------------------------------------------------------------------- API


def start(
    kind: str,
    name: str = DEFAULT_NAME,
    base_dir: Path | None = None,
    port: int | None = None,
    wait: float = 60.0,
) -> DbInfo:
    """Return the running server, starting it first if needed (idempotent).

    A restarted server reuses its previous port when still free, so URLs handed out
    earlier stay valid; data in ``base_dir`` always survives.
    """
    ensure_installed(kind)
    base = _resolve(kind, name, base_dir)
    return _server(kind).start(DbInfo(kind, 0, base), (port,), wait)


def stop(kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None) -> bool:
    """Stop the server cleanly if it runs; return whether one was stopped (idempotent)."""
    return _server(kind).stop(_resolve(kind, name, base_dir))


def kill(kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None) -> bool:
    """SIGKILL the server and its backends (a crash, for fault tests); True if it ran.

    The port stays recorded, so a later :func:`start` comes back on the same URL and
    runs crash recovery.
    """
    return _server(kind).kill(_resolve(kind, name, base_dir))


def status(kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None) -> DbInfo | None:
    """The running server (answering its protocol), or None; cheap enough to poll."""
    return _server(kind).status(_resolve(kind, name, base_dir))


def restart(
    kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None, wait: float = 60.0
) -> DbInfo:
    """Stop and start on the same port and data, as a "database restart" test needs."""
    ensure_installed(kind)
    base = _resolve(kind, name, base_dir)
    return _server(kind).restart(base, lambda prev: DbInfo(kind, 0, base), wait)


def url(kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None) -> str:
    """The server's SQLAlchemy URL, starting the server if it is not running."""
    return start(kind, name, base_dir).url


# ------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; ``start``/``url`` print only the URL so ``$(...)`` captures it."""
    parser = argparse.ArgumentParser(
        prog="python -m amqp_locks_dev.devdb",
        description="Private PostgreSQL or MariaDB server on 127.0.0.1.",
    )
    commands = Commands(
        start=lambda a: start(a.kind, a.name, a.base_dir, a.port, a.wait),
        restart=lambda a: restart(a.kind, a.name, a.base_dir, a.wait),
        stop=lambda a: stop(a.kind, a.name, a.base_dir),
        status=lambda a: status(a.kind, a.name, a.base_dir),
        kill=lambda a: kill(a.kind, a.name, a.base_dir),
    )
    return cli(
        argv,
        parser,
        commands,
        DevDbError,
        arguments=lambda p: p.add_argument("kind", choices=KINDS),
        default_name=DEFAULT_NAME,
    )


if __name__ == "__main__":
    sys.exit(main())
