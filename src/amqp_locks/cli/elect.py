"""`amqp-locks elect`: master/standby. COMMAND runs only while this process is master; on
demotion it is stopped (SIGTERM, SIGKILL after --grace) and the process waits as standby.
"""

from __future__ import annotations

import os
import signal
import threading
import tomllib
from pathlib import Path
from types import FrameType
from typing import Any

import click

from .. import signals
from ..errors import ConfigurationError
from ..extras import require_database
from ..lockers.amqp import AmqpLocker
from ..lockers.base import Locker
from ..lockers.config import build_locker
from ..service import LockableService, State
from ..transport.broker import Broker
from .acquire import holders_probe
from .common import (
    SHELL_COMMAND,
    CliError,
    CommandLine,
    Globals,
    command_argv,
    error_line,
    get_globals,
    lock_name,
    seconds_option,
)
from .exitcodes import Exit
from .supervisor import Supervisor, exit_status, own_group, spawn
from .waitline import WaitLine, wanted

STOPPING = (signal.SIGTERM, signal.SIGINT)
#: The --locker word of each locker class, by class name: the file and database lockers are
#: imported only when asked for (they need fcntl, or a database extra), never to name one.
LOCKER_NAMES: dict[str, str] = {
    "AmqpLocker": "amqp",
    "SharedFileLocker": "file",
    "DatabaseLocker": "database",
    "LeaseDatabaseLocker": "lease-database",
}
FORWARDED = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _from_config(path: Path, name: str, g: Globals) -> tuple[Locker, bool, float | None]:
    """The locker and [service] settings of a TOML file (see lockers.config); the
    locker's name defaults to NAME and an amqp locker's URL to --url."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CliError(Exit.CONFIG, f"cannot read {str(path)!r}: {exc}") from None
    section = data.get("locker")
    if not isinstance(section, dict):
        raise CliError(Exit.CONFIG, f"{str(path)!r} has no [locker] table")
    section = dict(section)
    section.setdefault("name", name)
    if section.get("type") == "amqp" and g.url:
        section.setdefault("amqp_url", g.url)
    service = data.get("service", {})
    unknown = set(service) - {"use_lock", "lock_keep_alive_period"}
    try:
        if unknown:
            raise ConfigurationError(f"[service] unknown keys: {sorted(unknown)}")
        locker = build_locker(section)
    except ConfigurationError as exc:
        raise CliError(Exit.CONFIG, f"{path}: {exc}") from None
    period = service.get("lock_keep_alive_period")
    return locker, bool(service.get("use_lock", True)), None if period is None else float(period)


class Election:
    """Runs COMMAND as the work of a LockableService and reports state changes."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        locker: Locker,
        grace: float,
        g: Globals,
        broker: Broker | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.locker = locker
        self.grace = grace
        self.g = g
        self.status: int | None = None  # COMMAND's status when it ended by itself
        self.sup: Supervisor | None = None
        self.requested_stop = False
        probe = None
        if isinstance(locker, AmqpLocker) and broker is not None:
            probe = holders_probe(broker, "mutex", name)
        kind = LOCKER_NAMES.get(type(locker).__name__, type(locker).__name__)
        #: "standby for ..., 12s" on a terminal while this process waits as standby.
        self.line = WaitLine(
            f"{kind} lock {name!r}", None, probe, enabled=wanted(g.quiet), verb="standby for"
        )

    def work(self, stop: threading.Event) -> None:
        env = dict(os.environ)
        env.update(
            AMQP_LOCKS_NAME=self.name,
            AMQP_LOCKS_ROLE="master",
            AMQP_LOCKS_FENCING_TOKEN=str(self.locker.fencing_token),
        )
        group = own_group()
        try:
            proc = spawn(self.argv, env, group)
        except CliError as exc:
            error_line(exc.message)
            self.status = exc.code
            return
        sup = Supervisor(proc, self.grace, self.g, group)
        self.sup = sup
        lease = self.locker.lease if isinstance(self.locker, AmqpLocker) else None
        try:
            while proc.poll() is None:
                lost = lease is not None and lease.lost.is_set()
                if stop.wait(0.05) or lost:
                    why = "stopping" if self.requested_stop else "lost mastership"
                    if lost and lease is not None:
                        why = f"lost mastership ({lease.lost_reason})"
                    self.g.info(f"elect {self.name}: {why}; stopping COMMAND")
                    self._terminate(sup)
                    if lost:
                        stop.wait()  # the keep-alive demotes us shortly
                    return
            if not stop.is_set():
                self.status = exit_status(proc.returncode)
        finally:
            self.sup = None

    def _terminate(self, sup: Supervisor) -> None:
        sup.signal(signal.SIGTERM)
        try:
            sup.proc.wait(self.grace)
        except Exception:
            sup.signal(signal.SIGKILL)
            sup.proc.wait()
        if sup.group:
            sup.signal(signal.SIGKILL)  # whatever is left of its process group

    def on_state(self, service: LockableService, state: State) -> None:
        if state is State.STANDBY:
            self.line.start()
        else:
            self.line.stop()
        if state is State.MASTER:
            self.g.info(f"elect {self.name}: master (fencing token {self.locker.fencing_token})")
        elif state is State.STANDBY:
            self.g.info(f"elect {self.name}: standby")

    def forward(self, signum: int, frame: FrameType | None) -> None:
        sup = self.sup
        if sup is not None:
            sup.signal(signum)


@click.command(
    cls=CommandLine,
    epilog="""\b
Examples:
  amqp-locks elect scheduler --locker amqp -- ./scheduler --serve
  amqp-locks elect scheduler --locker file --directory /shared/locks -- ./scheduler
  amqp-locks elect scheduler --locker lease-database \\
      --db-url postgresql+psycopg://app@db/app --interval 10 --keep-alive 5 -- ./scheduler
  amqp-locks elect scheduler --config /etc/scheduler-lock.toml -- ./scheduler
\b
COMMAND sees AMQP_LOCKS_NAME, AMQP_LOCKS_ROLE=master and AMQP_LOCKS_FENCING_TOKEN.
Exit status: COMMAND's when it ends by itself; 0 after SIGTERM/SIGINT (COMMAND stopped,
lock released); 69 when the locker's backend is unavailable; 78 for a bad --config.""",
)
@click.argument("name")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--locker",
    type=click.Choice(["amqp", "file", "database", "lease-database"]),
    default=None,
    help="Where the lock lives (default amqp; or from --config).",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML file with [locker] and [service] tables (docs/lockers.md).",
)
@click.option(
    "--directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="file locker: the shared directory (the lock file is DIR/NAME).",
)
@click.option("--db-url", default=None, help="database lockers: SQLAlchemy URL.")
@click.option("--lease-holder-id", default=None, help="lease-database: this holder's id.")
@click.option(
    "--max-diff",
    type=click.FloatRange(min=0),
    default=0.0,
    help="lease-database: max allowable difference from the database clock (s).",
)
@seconds_option(
    "--interval",
    default=10.0,
    minimum=0.01,
    help=(
        "Standby retry interval (lockAcquireSleepInterval);"
        " with lease-database also the lease length."
    ),
)
@seconds_option(
    "--keep-alive", minimum=0.01, help="Master keep-alive period (default: half the interval)."
)
@seconds_option("--grace", default=10.0, help="On demotion: SIGTERM, then SIGKILL after SECONDS.")
@SHELL_COMMAND
def elect(
    name: str,
    command: tuple[str, ...],
    locker: str | None,
    config: Path | None,
    directory: Path | None,
    db_url: str | None,
    lease_holder_id: str | None,
    max_diff: float,
    interval: float,
    keep_alive: float | None,
    grace: float,
    shell_command: str | None,
) -> int:
    """Run COMMAND only while this process is master of NAME (master/standby).

    \b
    amqp-locks elect NAME --locker amqp|file|database|lease-database [options] -- COMMAND
    """
    g = get_globals()
    name = lock_name(name)
    argv = command_argv(command, shell_command, "elect NAME --locker ... -- COMMAND")
    kind = locker
    if config is not None and kind is not None:
        raise click.UsageError("give either --locker or --config, not both")

    broker: Broker | None = None
    use_lock = True
    period = keep_alive
    opts: dict[str, Any] = {"lock_acquire_sleep_interval": interval}
    if config is not None:
        the_locker, use_lock, file_period = _from_config(config, name, g)
        if period is None:
            period = file_period
        if period is None:
            period = the_locker.lock_acquire_sleep_interval / 2
    else:
        kind = kind or "amqp"
        if period is None:
            period = interval / 2
        if kind == "amqp":
            broker = g.broker(f"elect {name}")
            the_locker = AmqpLocker(broker, name, **opts)
        elif kind == "file":
            if directory is None:
                raise click.UsageError("--locker file needs --directory")
            from ..lockers.file import SharedFileLocker

            the_locker = SharedFileLocker(directory, name, **opts)
        else:
            if db_url is None:
                raise click.UsageError(f"--locker {kind} needs --db-url")
            require_database(db_url)  # names the URL's extra before SQLAlchemy is imported
            if kind == "database":
                from ..lockers.database import DatabaseLocker

                the_locker = DatabaseLocker(db_url, name, **opts)
            else:
                from ..lockers.lease_database import LeaseDatabaseLocker

                the_locker = LeaseDatabaseLocker(
                    db_url,
                    name,
                    lease_holder_id=lease_holder_id,
                    max_allowable_diff_from_db_time=max_diff,
                    **opts,
                )

    election = Election(name, argv, the_locker, grace, g, broker)
    service = LockableService(
        the_locker,
        election.work,
        use_lock=use_lock,
        lock_keep_alive_period=period,
        on_state=election.on_state,
        work_stop_timeout=grace + 5.0,
    )
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            service.run()
        except BaseException as exc:
            failure.append(exc)

    def request_stop(signum: int, frame: FrameType | None) -> None:
        election.requested_stop = True
        threading.Thread(target=service.stop, daemon=True).start()

    thread = threading.Thread(target=serve, name="amqp-locks-elect", daemon=True)
    old = {s: signal.signal(s, request_stop) for s in STOPPING}
    old.update({s: signal.signal(s, election.forward) for s in FORWARDED})
    try:
        thread.start()
        # In slices: SIGTERM taken by one of the service's threads runs request_stop only
        # once this thread returns to Python (amqp_locks.signals).
        signals.join(thread)
    finally:
        election.line.stop()
        for s, h in old.items():
            signal.signal(s, h)
        try:
            the_locker.close()
        finally:
            if broker is not None:
                broker.close()
    if failure:
        raise failure[0]
    if election.requested_stop or election.status is None:
        return Exit.OK
    return election.status
