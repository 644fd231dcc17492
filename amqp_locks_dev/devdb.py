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
committed data survives server restarts and kills, not a host crash.

CLI: ``python -m amqp_locks_dev.devdb start|stop|status|restart|url|kill postgresql|mariadb
[--name NAME]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .localserver import cmdline_mentions, write_state
from .localserver import locked as _locked
from .localserver import pid_alive as _pid_alive
from .localserver import port_free as _port_free
from .localserver import tail as _tail

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
HOST = "127.0.0.1"
DB_USER = DB_PASSWORD = DB_NAME = "amqplocks"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
#: sun_path is 108 bytes; both servers put their socket directly in base_dir.
_MAX_SOCKET_PATH = 100
_SEARCH_DIRS = ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin", "/usr/libexec")
_MARIADB_SYSTEM_PID = Path("/run/mysqld/mysqld.pid")
_log = logging.getLogger(__name__)

# Servers started by this interpreter, reaped after a stop (no zombies/ResourceWarnings).
_children: dict[Path, subprocess.Popen[bytes]] = {}


class DevDbError(RuntimeError):
    """The private database could not be installed, started, stopped or queried."""


@dataclass(frozen=True)
class DbInfo:
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
        return self.log_file if self.kind == "postgresql" else self.base_dir / "startup.log"


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
    return pid if _pid_alive(pid) and (b"mariadbd" in cmd or b"mysqld" in cmd) else None


def ensure_installed(kind: str) -> None:
    """Install the server from Debian's packages if missing, without a system service.

    Only the binaries are wanted: our servers are private, so the package's service is
    kept from starting (policy-rc.d) and, for MariaDB, stopped if it started anyway.
    """
    _check_kind(kind)
    if _tools(kind) is not None:
        return
    package = "postgresql" if kind == "postgresql" else "mariadb-server"
    if os.geteuid() != 0:
        raise DevDbError(
            f"{kind} is not installed and we are not root; run: sudo apt-get install -y {package}"
        )
    if shutil.which("apt-get") is None:
        raise DevDbError(f"{kind} is not installed and apt-get is unavailable")
    before = _system_mariadb_pid()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\n# amqp_locks_dev.devdb: no services\nexit 101\n")
        policy.chmod(0o755)
        made_policy = True
    try:
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", package]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise DevDbError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)
    if kind == "mariadb":
        # Belt and braces: stop a system server the package started (only that one).
        pid = _system_mariadb_pid()
        if pid is not None and pid != before:
            _signal_and_wait(pid, signal.SIGTERM, 60.0)
    if _tools(kind) is None:
        raise DevDbError(f"apt-get installed {package} but its binaries were not found")


# ----------------------------------------------------------------------------- state


def _default_base_dir(kind: str, name: str) -> Path:
    """``$AMQP_LOCKS_HOME/db/<kind>-<name>``, defaulting to the user's cache directory."""
    home = os.environ.get("AMQP_LOCKS_HOME")
    if home:
        root = Path(home)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(cache) / "amqp-locks"
    return root / "db" / f"{kind}-{name}"


def _resolve(kind: str, name: str, base_dir: Path | None) -> Path:
    _check_kind(kind)
    if not _NAME_RE.match(name):
        raise DevDbError(f"invalid name {name!r}: use letters, digits, _ and -")
    base = (base_dir or _default_base_dir(kind, name)).expanduser().resolve()
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
    try:
        raw = json.loads((base_dir / "node.json").read_text())
        if raw["kind"] != kind:
            return None
        info = DbInfo(kind, int(raw["port"]), base_dir)
        pid = raw.get("pid")
        # pid is None while a start is in flight or after a stop; the pid file knows.
        return info, (int(pid) if pid is not None else _pid_from_file(info))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_state(info: DbInfo, pid: int | None) -> None:
    data = {"kind": info.kind, "port": info.port, "pid": pid, "url": info.url}
    write_state(info.base_dir, data)


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


def _is_our_server(info: DbInfo, pid: int | None) -> bool:
    """The pid is alive and is this base_dir's server (guards against pid reuse)."""
    return pid is not None and _pid_alive(pid) and cmdline_mentions(pid, str(info.base_dir))


def _pid_from_file(info: DbInfo) -> int | None:
    try:
        return int(info.pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


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


def _running(info: DbInfo, pid: int | None) -> bool:
    return _is_our_server(info, pid) and _ping(info.kind, info.port)


# ------------------------------------------------------------------------------ ports


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _pick_port(prev: DbInfo | None, port: int | None, strict: bool) -> int:
    """Prefer an explicit port, then the previous run's (stable URL), then a fresh one."""
    wanted = port or (prev.port if prev else None)
    if wanted is not None and _port_free(wanted):
        return wanted
    if wanted is not None and (strict or port):
        raise DevDbError(f"port {wanted} on {HOST} is already in use")
    return _free_port()


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


def _failure(info: DbInfo, why: str) -> DevDbError:
    logs = dict.fromkeys([info.startup_log, info.log_file])
    tails = "".join(f"\n--- {log} ---\n{_tail(log)}" for log in logs)
    return DevDbError(f"{info.kind} server in {info.base_dir} {why}.{tails}")


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
        "synchronous_commit = off\n"
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
    if not (data / "mysql").is_dir():
        shutil.rmtree(data, ignore_errors=True)
        cmd = [
            str(tools.initdb), "--no-defaults", f"--datadir={data}", *as_root,
            "--auth-root-authentication-method=socket", "--skip-test-db",
            "--skip-name-resolve",
        ]  # fmt: skip
        _checked(_run(info, cmd, timeout=180), "mariadb-install-db")
    init_sql = info.base_dir / "init.sql"
    init_sql.write_text(_maria_init_sql())
    cnf = info.base_dir / "my.cnf"
    cnf.write_text(
        "# Generated by amqp_locks_dev.devdb; rewritten on every start.\n"
        "[mysqld]\n"
        f"datadir = {data}\n"
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


def _launch(info: DbInfo, wait: float) -> int:
    """Start the server in its own session and block until we can log in; return its pid."""
    tools = _require_tools(info.kind)
    acct = _server_account(info.kind)
    if info.kind == "postgresql":
        cmd = _pg_prepare(info, tools, acct)
    else:
        cmd = _maria_prepare(info, tools)
    with info.startup_log.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=_env(info),
            cwd=info.base_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives our exit and Ctrl-C in the terminal
            **_as_account(acct),
        )
    _children[info.base_dir] = proc
    deadline = time.monotonic() + wait
    while True:
        if proc.poll() is not None:
            raise _failure(info, f"exited during startup (code {proc.returncode})")
        if time.monotonic() > deadline:
            _signal_and_wait(proc.pid, signal.SIGKILL, 10.0, tree=True)
            _reap(info.base_dir)
            raise _failure(info, f"did not start within {wait:.0f}s")
        if _pg_ready(info, tools) if info.kind == "postgresql" else _maria_ready(info):
            return proc.pid
        time.sleep(0.1)


def _children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (PostgreSQL backends setsid(), so killpg misses them)."""
    kids: list[int] = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(entry.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.parent.name))
    return kids


def _signal_and_wait(pid: int, sig: int, grace: float, *, tree: bool = False) -> bool:
    """Send ``sig`` (also to direct children if ``tree``) and wait; True once all are gone."""
    pids = [pid, *(_children_of(pid) if tree else [])]
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if not any(_pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return not any(_pid_alive(p) for p in pids)


def _reap(base_dir: Path) -> None:
    proc = _children.pop(base_dir, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


# ------------------------------------------------------------------------------- API


def _start(kind: str, base_dir: Path, port: int | None, wait: float, strict: bool) -> DbInfo:
    state = _read_state(kind, base_dir)
    if state is not None and _running(*state):
        prev = state[0]
        if port is not None and port != prev.port:
            raise DevDbError(f"{kind} in {base_dir} already runs on port {prev.port}; stop it")
        return prev
    if state is not None and _is_our_server(*state):
        # A server we started earlier that no longer answers (hung or half-booted).
        _hard_stop(*state)
    ports_from = state[0] if state else None
    info = DbInfo(kind, _pick_port(ports_from, port, strict), base_dir)
    _write_state(info, None)
    pid = _launch(info, wait)
    _write_state(info, pid)
    return info


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
    with _locked(base):
        return _start(kind, base, port, wait, strict=False)


def _hard_stop(info: DbInfo, pid: int | None) -> None:
    if pid is not None:
        _signal_and_wait(pid, signal.SIGKILL, 10.0, tree=True)
    _reap(info.base_dir)


def _stop(kind: str, base_dir: Path) -> bool:
    state = _read_state(kind, base_dir)
    if state is None:
        return False
    info, pid = state
    if pid is None or not _is_our_server(info, pid):
        _reap(base_dir)
        return False
    # SIGINT is PostgreSQL's "fast" shutdown (what pg_ctl stop -m fast sends): roll
    # back sessions, checkpoint.  SIGTERM is MariaDB's normal shutdown.
    sig = signal.SIGINT if kind == "postgresql" else signal.SIGTERM
    if not _signal_and_wait(pid, sig, 60.0):
        _hard_stop(info, pid)
    _reap(base_dir)
    if _pid_alive(pid):
        raise DevDbError(f"could not stop {kind} in {base_dir} (pid {pid})")
    _write_state(info, None)
    return True


def stop(kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None) -> bool:
    """Stop the server cleanly if it runs; return whether one was stopped (idempotent)."""
    base = _resolve(kind, name, base_dir)
    with _locked(base):
        return _stop(kind, base)


def kill(kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None) -> bool:
    """SIGKILL the server and its backends (a crash, for fault tests); True if it ran.

    The port stays recorded, so a later :func:`start` comes back on the same URL and
    runs crash recovery.
    """
    base = _resolve(kind, name, base_dir)
    with _locked(base):
        state = _read_state(kind, base)
        if state is None or not _is_our_server(*state):
            return False
        _hard_stop(*state)
        _write_state(state[0], None)
        return True


def status(kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None) -> DbInfo | None:
    """The running server (answering its protocol), or None; cheap enough to poll."""
    base = _resolve(kind, name, base_dir)
    state = _read_state(kind, base)
    return state[0] if state is not None and _running(*state) else None


def restart(
    kind: str, name: str = DEFAULT_NAME, base_dir: Path | None = None, wait: float = 60.0
) -> DbInfo:
    """Stop and start on the same port and data, as a "database restart" test needs."""
    ensure_installed(kind)
    base = _resolve(kind, name, base_dir)
    with _locked(base):
        state = _read_state(kind, base)
        _stop(kind, base)
        if state is None:
            return _start(kind, base, None, wait, strict=False)
        return _start(kind, base, state[0].port, wait, strict=True)


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
    parser.add_argument("command", choices=["start", "stop", "status", "restart", "url", "kill"])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--name", default=DEFAULT_NAME, help="server name (default: %(default)s)")
    parser.add_argument("--base-dir", type=Path, default=None, help="server directory")
    parser.add_argument("--port", type=int, default=None, help="TCP port for start")
    parser.add_argument("--wait", type=float, default=60.0, help="startup timeout (s)")
    args = parser.parse_args(argv)
    kind, name, base = args.kind, args.name, args.base_dir
    try:
        if args.command in ("start", "url"):
            print(start(kind, name, base, args.port, args.wait).url)
        elif args.command == "restart":
            print(restart(kind, name, base, args.wait).url)
        elif args.command in ("stop", "kill"):
            done = (stop if args.command == "stop" else kill)(kind, name, base)
            print("stopped" if done else "not running", file=sys.stderr)
        else:
            info = status(kind, name, base)
            if info is None:
                print("not running")
                return 3
            print(info.url)
    except DevDbError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
