"""`amqp-locks run`: hold a lock while a command runs, the way flock(1) does for files."""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType

import click

from ..signals import handlers
from .acquire import acquire, holders_probe
from .common import (
    REPORTED_BY_COMMAND,
    SHELL_COMMAND,
    CliError,
    CommandLine,
    command_argv,
    get_globals,
    lock_name,
    seconds_option,
)
from .exitcodes import Exit
from .supervisor import FORWARDED, Supervisor, exit_status, own_group
from .waitline import WaitLine, wanted

#: Signals that stop `amqp-locks` while it still waits for the lock.
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _Interrupted(BaseException):
    """A stopping signal arrived while we waited (BaseException: it cancels the acquire)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


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
is busy (--nonblock, or -w ran out while the broker answered); 69 when the broker is
unreachable or silent, whatever -w and -E say; 75 when the lock was lost and COMMAND was
stopped; 126/127 when COMMAND cannot be executed / is not found.

Lasting objects: a mutex (no -n) and --shared/--exclusive leave nothing lasting (their
wake-up queues expire a minute or so after the last use).
-n SLOTS makes the semaphore's queues NAME-1-A..NAME-SLOTS-A (remove them with
'amqp-locks semaphore destroy NAME'); --kind token -n makes NAME.semaphore,
NAME.semaphore-ledger and NAME-fence ('amqp-locks token destroy NAME --purge-fence').""",
)
@click.argument("name")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "-n",
    "--slots",
    type=click.IntRange(min=1),
    default=None,
    metavar="SLOTS",
    help="Use a semaphore of SLOTS slots, created if missing (it stays: see below); one "
    "that exists with another count is refused (exit 65).",
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
@seconds_option(
    "-w",
    "--wait",
    "--timeout",
    "wait",
    help="Give up after SECONDS without the lock (exit CODE; 69 if no connection was made).",
)
@click.option("--nonblock", is_flag=True, help="Give up at once if the lock is busy (exit CODE).")
@click.option(
    "-E",
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    default=1,
    show_default=True,
    metavar="CODE",
    help="Exit status when the lock is busy (not for an unreachable broker: 69).",
)
@SHELL_COMMAND
@seconds_option(
    "--grace", default=10.0, help="After losing the lock: SIGTERM, then SIGKILL after SECONDS."
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
    argv = command_argv(command, shell_command, "run NAME -- COMMAND [ARGS...]")
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
            with handlers(_raise_interrupted, STOPPING), line:
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
            with handlers(sup.forward, FORWARDED):  # from before COMMAND starts
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
