"""`amqp-locks run`: hold a lock while a command runs, the way flock(1) does for files."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click

from ..errors import LockError, SemaphoreNotFound
from ..holders import HolderRecord, pick_holder
from ..lease import Lease
from ..mutex import Mutex
from ..rwlock import ReadWriteLock
from ..semaphore import PersistentSemaphore, SemaphoreAdmin
from ..status import lock_status, of_kind
from ..tokens import TokenSemaphore, TokenSemaphoreNotFound
from ..transport.broker import Broker
from .common import (
    REPORTED_BY_COMMAND,
    CliError,
    CommandLine,
    Globals,
    error_line,
    get_globals,
    lock_name,
)
from .exitcodes import Exit
from .status import since_text
from .waitline import Probe, WaitLine, wanted

#: Signals forwarded to COMMAND while it runs (SIGINT too: `kill -INT` from a script must
#: reach it; a terminal's Ctrl-C reaches both processes anyway, they share a group).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
    signal.SIGCONT,
)
#: Signals that stop `amqp-locks` while it still waits for the lock.
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _Interrupted(BaseException):
    """A stopping signal arrived while we waited (BaseException: it cancels the acquire)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _handlers(
    handler: Callable[[int, FrameType | None], Any], sigs: tuple[int, ...]
) -> Iterator[None]:
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


def _slots_conflict(name: str, kind: str, have: int, asked: int) -> CliError:
    """-n that disagrees with the existing lock's count (`consul lock` refuses it too)."""
    if kind == "semaphore":
        what, unit, admin = (
            f"semaphore {name!r}",
            "slots",
            f"amqp-locks semaphore add|remove {name}",
        )
    else:
        what, unit, admin = (
            f"token semaphore {name!r}",
            "permits",
            f"amqp-locks token add|remove {name}",
        )
    return CliError(
        Exit.DATAERR,
        f"{what} has {have} {unit}, not {asked} (-n {asked}): "
        f"change its count with '{admin} COUNT', or leave out -n",
    )


def _semaphore_size(broker: Broker, name: str) -> int:
    """The persistent semaphore's slot count, 0 if absent (read-only; no admin mutex)."""
    st = of_kind(lock_status(broker, name, ("semaphore",)), "semaphore")
    return 0 if st is None else st.capacity


def ensure(broker: Broker, kind: str, name: str, slots: int | None, priority: int = 0) -> None:
    """With -n: create the semaphore of `slots` if it is missing; refuse (65) one that
    exists with another count.

    The count is read first without the admin mutex (the common case: it matches). Any
    other answer — absent, another count, or a semaphore half made by a concurrent
    creator — is settled by the idempotent create/setup, which runs under the mutex and
    refuses another count."""
    if slots is None or kind in ("mutex", "shared", "exclusive"):
        return
    if kind == "semaphore":
        if _semaphore_size(broker, name) == slots:
            return
        try:
            SemaphoreAdmin(broker, name).create(slots)
            return
        except LockError:
            have = _semaphore_size(broker, name)
            if have in (0, slots):
                raise  # not a count conflict (other queue flags, ...): as it is
            raise _slots_conflict(name, kind, have, slots) from None
    tokens = TokenSemaphore(broker, name, priority=priority)
    try:
        if tokens.status().permits == slots:
            return
    except TokenSemaphoreNotFound:
        pass
    try:
        tokens.setup(slots)
    except TokenSemaphoreNotFound:
        raise
    except LockError:
        have = tokens.status().permits
        if have == slots:
            raise
        raise _slots_conflict(name, kind, have, slots) from None


def acquire(
    broker: Broker,
    kind: str,
    name: str,
    slots: int | None,
    *,
    blocking: bool,
    timeout: float | None,
    priority: int = 0,
) -> Lease | None:
    """Take the lock `name` of `kind`; with `slots`, a semaphore of that count (created if
    missing, refused if it has another)."""
    ensure(broker, kind, name, slots, priority)
    if kind in ("shared", "exclusive"):
        rw = ReadWriteLock(broker, name)
        side = rw.read_lock if kind == "shared" else rw.write_lock
        return side.acquire(blocking, timeout)
    if kind == "mutex":
        return Mutex(broker, name).acquire(blocking, timeout)
    if kind == "semaphore":
        try:
            return PersistentSemaphore(broker, name).acquire(blocking, timeout)
        except SemaphoreNotFound:
            raise SemaphoreNotFound(
                f"semaphore {name!r} does not exist: create it with "
                f"'amqp-locks semaphore create {name} SLOTS' or pass -n SLOTS"
            ) from None
    try:
        return TokenSemaphore(broker, name, priority=priority).acquire(blocking, timeout)
    except TokenSemaphoreNotFound:
        raise TokenSemaphoreNotFound(
            f"token semaphore {name!r} does not exist: set it up with "
            f"'amqp-locks token setup {name} PERMITS' or pass -n PERMITS"
        ) from None


def holders_probe(broker: Broker, kind: str, name: str) -> Probe:
    """What the wait line says about the holders: who (holder id, host, pid, since, as
    they answer themselves; "an unknown holder" when one does not) and how many. Read-only,
    no admin mutex, on the wait line's own thread."""

    def who(records: Sequence[HolderRecord]) -> str:
        parts = []
        for r in records:
            label = {"semaphore": "slot ", "token": "permit "}.get(r.kind)
            part = "" if label is None or r.number is None else f"{label}{r.number} "
            part += f"held by {r.describe()}"
            parts.append(part + (f" since {since_text(r.since)}" if r.known else ""))
        return ", ".join(parts)

    def probe() -> str | None:
        if kind in ("shared", "exclusive"):
            rw = ReadWriteLock(broker, name).status()
            if rw is None:
                return None
            writer = "a writer has the turn" if rw.writer else "no writer"
            return (
                f"{rw.held} of {rw.readers} reader token(s) out, {writer}, "
                f"{rw.writers_waiting} writer(s) waiting"
            )
        if kind == "mutex":
            mutex = of_kind(lock_status(broker, name, ("mutex",), records=True), "mutex")
            if mutex is None or not mutex.held:
                return None
            holder = pick_holder(mutex.records)
            return "held elsewhere" if holder is None else who([holder])
        if kind == "semaphore":
            sem = of_kind(lock_status(broker, name, ("semaphore",), records=True), "semaphore")
            if sem is None:
                return None
            if not sem.holders:
                return f"{sem.capacity} slot(s), none held"
            return f"{who(sem.records)} ({sem.held} of {sem.capacity} slot(s))"
        tok = of_kind(lock_status(broker, name, ("token",), records=True), "token")
        if tok is None:
            return None
        held = f"{tok.held} of {tok.capacity} permit(s) held"
        if tok.records:
            held = f"{who(tok.records)} ({held})"
        return f"{held}, {tok.waiting} waiting"

    return probe


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it (128 + N when killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def own_group() -> bool:
    """Whether COMMAND gets a process group of its own: yes unless stdin is a terminal (an
    interactive COMMAND must stay in the terminal's foreground group to read from it)."""
    try:
        return not os.isatty(0)
    except OSError:
        return True


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a function for the child that asks for SIGKILL when its parent dies, so a
    COMMAND never outlives a killed `amqp-locks` (which no longer holds the lock)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:  # runs in the child between fork and exec: no locks, no allocation
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: we are on our own
            os._exit(Exit.UNAVAILABLE)

    return arm


PR_SET_PDEATHSIG = 1


def spawn(argv: list[str], env: dict[str, str], group: bool) -> subprocess.Popen[bytes]:
    """Start COMMAND; 127 when not found, 126 when not executable (one line each)."""
    try:
        return subprocess.Popen(
            argv,
            env=env,
            process_group=0 if group else None,
            preexec_fn=_parent_death_signal(),
        )
    except FileNotFoundError:
        raise CliError(Exit.NOT_FOUND, f"{argv[0]}: command not found") from None
    except (PermissionError, IsADirectoryError):
        raise CliError(Exit.NOT_EXECUTABLE, f"{argv[0]}: permission denied") from None
    except OSError as exc:
        raise CliError(Exit.NOT_EXECUTABLE, f"{argv[0]}: cannot execute: {exc.strerror}") from None


class Supervisor:
    """Runs COMMAND, forwards our signals to it, and stops it if the lock is lost:
    SIGTERM, then SIGKILL after `grace` seconds. With `group`, COMMAND leads a process
    group of its own and signals go to the whole group (its children too)."""

    def __init__(
        self, proc: subprocess.Popen[bytes] | None, grace: float, g: Globals, group: bool
    ) -> None:
        self._proc = proc
        self.grace = grace
        self.g = g
        self.group = group
        self.lost_reason: str | None = None
        self.lost_at = 0.0
        self._lock = threading.Lock()
        #: Signals forwarded before COMMAND was started (see `start`).
        self._pending: list[int] = []

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, "COMMAND not started"
        return self._proc

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        """Spawn COMMAND, then forward the signals that came while it was being started.
        Install `forward` before calling this: a signal in between would otherwise get its
        default action and kill us, leaving COMMAND unsupervised."""
        self._proc = spawn(argv, env, self.group)
        for signum in self._pending:
            self.signal(signum)
        self._pending.clear()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is not None and not self.group:
            return
        try:
            if self.group:
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)
        except (ProcessLookupError, PermissionError):
            pass

    def forward(self, signum: int, frame: FrameType | None) -> None:
        if self._proc is None:
            self._pending.append(signum)
        else:
            self.signal(signum)

    def on_lost(self, what: str, reason: str | None) -> None:
        with self._lock:
            if self.lost_reason is not None or self.proc.poll() is not None:
                return  # COMMAND already ended: it ran under the lock throughout
            self.lost_reason = reason or "lost"
        error_line(
            f"{what} lost ({self.lost_reason}); stopping COMMAND "
            f"(SIGTERM, SIGKILL after {self.grace:g}s)"
        )
        self.lost_at = time.monotonic()
        self.signal(signal.SIGTERM)
        timer = threading.Timer(self.grace, self._kill)
        timer.daemon = True
        timer.start()

    def _kill(self) -> None:
        self.signal(signal.SIGKILL)

    def wait(self) -> int:
        with _handlers(self.forward, FORWARDED):
            # In slices: a signal handled by another thread of ours would not interrupt a
            # plain waitpid, and its handler (run by this thread) would wait with it.
            while True:
                try:
                    status = self.proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if self.lost_reason is not None and self.group:
                self._reap_group()
            return status

    def _reap_group(self) -> None:
        """The lock is lost and COMMAND ended: what is left of its group gets the rest of
        the grace period, then SIGKILL (nothing keeps working without the lock)."""
        deadline = self.lost_at + self.grace
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
        self.signal(signal.SIGKILL)


@click.command(
    cls=CommandLine,
    epilog="""\b
Examples:
  amqp-locks run backup --nonblock -- /usr/local/bin/backup.sh
  amqp-locks run deploys -n 3 -w 600 -- ./deploy.sh web-1
  amqp-locks run db-migrate -c 'alembic upgrade head'
  amqp-locks run gpu --kind token -n 2 -- python train.py
  amqp-locks run config --shared -- ./read-config.sh
  amqp-locks run config --exclusive -- ./rewrite-config.sh
\b
COMMAND sees AMQP_LOCKS_NAME, AMQP_LOCKS_KIND, AMQP_LOCKS_SLOT (slot or permit number;
reader token, 0 for --exclusive), AMQP_LOCKS_MODE (shared or exclusive, read-write locks)
and AMQP_LOCKS_FENCING_TOKEN (rises with every grant: pass it to what you protect).
Exit status: COMMAND's (128+N if killed by signal N); -E CODE (default 1) when the lock
was not obtained; 75 when the lock was lost and COMMAND was stopped; 126/127 when COMMAND
cannot be executed / is not found.""",
)
@click.argument("name")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "-n",
    "--slots",
    type=click.IntRange(min=1),
    default=None,
    metavar="SLOTS",
    help="Use a semaphore of SLOTS slots, created if missing; one that exists with another "
    "count is refused (exit 65).",
)
@click.option(
    "--kind",
    type=click.Choice(["mutex", "semaphore", "token", "persistent"]),
    default=None,
    help="mutex (default without -n), semaphore: the persistent semaphore (default with -n), "
    "token: the token semaphore. (persistent: the old name of semaphore.)",
)
@click.option(
    "--shared",
    is_flag=True,
    help="Take a read hold of the read-write lock NAME (many readers at once, no writer). "
    "Not the mutex NAME: see docs/cli.md.",
)
@click.option(
    "--exclusive",
    is_flag=True,
    help="Take the write hold of the read-write lock NAME (no reader, no other writer).",
)
@click.option(
    "-w",
    "--wait",
    "--timeout",
    "wait",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Give up after SECONDS without the lock (exit CODE).",
)
@click.option("--nonblock", is_flag=True, help="Give up at once if the lock is busy (exit CODE).")
@click.option(
    "-E",
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    default=1,
    show_default=True,
    metavar="CODE",
    help="Exit status when the lock was not obtained.",
)
@click.option(
    "-c",
    "--command",
    "shell_command",
    metavar="CMD",
    allow_from_autoenv=False,
    help="Run CMD with /bin/sh -c.",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="After losing the lock: SIGTERM, then SIGKILL after SECONDS.",
)
@click.option(
    "--lost-exit-code",
    type=click.IntRange(0, 255),
    default=int(Exit.TEMPFAIL),
    show_default=True,
    metavar="CODE",
    help="Exit status when the lock was lost while COMMAND ran.",
)
@click.option(
    "--priority",
    type=int,
    default=0,
    help="Token semaphores: consumer priority (higher is served first).",
)
@click.option(
    "--holder-id",
    metavar="ID",
    help="Who `status` and waiting `run`s say holds the lock (default: HOST:PID); "
    "readable by every client of the vhost.",
)
def run(
    name: str,
    command: tuple[str, ...],
    slots: int | None,
    kind: str | None,
    shared: bool,
    exclusive: bool,
    wait: float | None,
    nonblock: bool,
    conflict_exit_code: int,
    shell_command: str | None,
    grace: float,
    lost_exit_code: int,
    priority: int,
    holder_id: str | None,
) -> int:
    """Hold the lock NAME while COMMAND runs (flock-style).

    \b
    amqp-locks run NAME [-n SLOTS] [-w SECONDS | --nonblock] [-E CODE] -- COMMAND [ARGS...]
    amqp-locks run NAME [options] -c 'shell command'
    """
    g = get_globals()
    name = lock_name(name)
    if shell_command is not None and command:
        raise click.UsageError("give either -c CMD or COMMAND, not both")
    if shell_command is None and not command:
        raise click.UsageError("missing COMMAND (use: run NAME -- COMMAND [ARGS...])")
    if nonblock and wait is not None:
        raise click.UsageError("--nonblock and -w are mutually exclusive")
    if kind == "persistent":
        kind = "semaphore"
    if shared and exclusive:
        raise click.UsageError("--shared and --exclusive are mutually exclusive")
    mode = "shared" if shared else "exclusive" if exclusive else None
    if mode is not None:
        if kind is not None or slots is not None or priority != 0:
            raise click.UsageError(
                f"--{mode} takes the read-write lock NAME: no --kind, -n or --priority"
            )
        kind = mode
    if kind is None:
        kind = "mutex" if slots is None else "semaphore"
    if kind == "mutex" and slots is not None:
        raise click.UsageError("-n SLOTS needs --kind semaphore or token, not mutex")
    if priority != 0 and kind != "token":
        raise click.UsageError(f"--priority orders token semaphore waiters: not for --kind {kind}")
    argv = ["/bin/sh", "-c", shell_command] if shell_command is not None else list(command)

    broker = g.broker(f"run {name}", holder_id=holder_id)
    try:
        try:
            label = {
                "mutex": "mutex",
                "semaphore": "semaphore",
                "token": "token semaphore",
                "shared": "read-write lock (shared)",
                "exclusive": "read-write lock (exclusive)",
            }[kind]
            line = WaitLine(
                f"{label} {name!r}",
                wait,
                holders_probe(broker, kind, name),
                enabled=not nonblock and wait != 0 and wanted(g.quiet),
            )
            with _handlers(_raise_interrupted, STOPPING), line:
                lease = acquire(
                    broker,
                    kind,
                    name,
                    slots,
                    blocking=not nonblock,
                    timeout=wait,
                    priority=priority,
                )
        except _Interrupted as exc:
            raise CliError(128 + exc.signum, "interrupted while waiting for the lock") from None
        if lease is None:
            why = "busy" if nonblock else f"timed out after {wait:g}s"
            g.info(f"{name}: lock not obtained ({why})")
            return conflict_exit_code
        if g.verbose:
            g.info(
                f"holding {kind} {name!r} slot {lease.number} (fencing token {lease.fencing_token})"
            )
        env = dict(os.environ)
        env.update(
            AMQP_LOCKS_NAME=name,
            AMQP_LOCKS_KIND="rwlock" if mode else kind,
            AMQP_LOCKS_SLOT=str(lease.number),
            AMQP_LOCKS_FENCING_TOKEN=str(lease.fencing_token),
        )
        if mode:
            env["AMQP_LOCKS_MODE"] = mode
        else:
            env.pop("AMQP_LOCKS_MODE", None)
        sup = Supervisor(None, grace, g, own_group())
        try:
            with _handlers(sup.forward, FORWARDED):  # from before COMMAND starts
                sup.start(argv, env)
                if mode:
                    what = f"{mode} hold of {name!r}"
                elif kind == "mutex":
                    what = f"lock {name!r}"
                else:
                    what = f"slot {lease.number} of {name!r}"
                lease.on_lost(lambda lost: sup.on_lost(what, lost.lost_reason))
                REPORTED_BY_COMMAND.active = True
                status = exit_status(sup.wait())
        finally:
            REPORTED_BY_COMMAND.active = False
            # Lost, or the connection is gone: the broker frees it anyway.
            with contextlib.suppress(Exception):
                lease.release()
        if sup.lost_reason is not None:
            return lost_exit_code
        return status
    finally:
        broker.close()
