"""What every sub-command shares: global options, the broker, error reporting."""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import click
from click.core import ParameterSource

from ..errors import (
    AccessRefused,
    AdminLockTimeout,
    AuthenticationFailed,
    BrokerError,
    BrokerUnreachable,
    ConfigurationError,
    ConnectionLost,
    FeatureUnavailable,
    LockError,
    LockShapeMismatch,
    PreconditionFailed,
    SemaphoreNotFound,
)
from ..holders import bounded
from ..names import validate_name
from ..records import ALL_KINDS, HOLDER_TIMEOUT, Kind, LockStatus
from ..status import read_lock_status
from ..tokens import TokenSemaphoreNotFound
from ..transport.broker import Broker
from ..transport.urls import default_connection_name
from .exitcodes import Exit


class CliError(Exception):
    """Stop the command: print `message` (one line) and exit with `code`."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Globals:
    url: str | None
    heartbeat: float
    verbose: int
    quiet: bool

    def configure_logging(self) -> None:
        """Library records on stderr: WARNING and above by default, one line each (no
        traceback); -q only errors; -v INFO and -vv DEBUG, with tracebacks. Called again
        when a subcommand's own -v/-q change the levels."""
        configure_logging(self.verbose, self.quiet)

    def broker(self, purpose: str, holder_id: str | None = None) -> Broker:
        """A Broker whose connection name says what this process does, host and pid;
        `holder_id` is what its locks' holder records say (default HOST:PID)."""
        return Broker(
            self.url,
            heartbeat=self.heartbeat,
            connection_name=default_connection_name(purpose),
            holder_id=holder_id,
        )

    def info(self, message: str) -> None:
        """A progress line on stderr (suppressed by -q)."""
        if not self.quiet:
            click.echo(f"amqp-locks: {message}", err=True)


# --- logging ---------------------------------------------------------------------------------


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is now (the live wait line swaps in a proxy that
    prints records above itself)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class OneLineFormatter(logging.Formatter):
    """`amqp-locks: warning: message (ExcType: text)`: one line, no traceback."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text = str(exc).strip().splitlines()
            message += f" ({type(exc).__name__}{': ' + text[0] if text else ''})"
        message = " ".join(message.split())
        return f"amqp-locks: {record.levelname.lower()}: {message}"


class _ReportedByCommand(logging.Filter):
    """While `run` holds its lock it reports a loss itself ("slot 1 of 'x' lost (reason);
    stopping COMMAND"): the library's warnings about the same loss (the lease's "lost",
    the connection's "ended") would only repeat it. They still show with -v."""

    LOGGERS = ("amqp_locks.lease", "amqp_locks.transport")

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and record.name in self.LOGGERS and record.levelno < logging.ERROR)


#: `run` sets `.active` while COMMAND runs under the lock.
REPORTED_BY_COMMAND = _ReportedByCommand()

VERBOSE_FORMAT = "amqp-locks[%(process)d] %(levelname)s %(name)s: %(message)s"


def configure_logging(verbose: int, quiet: bool) -> None:
    if verbose >= 2:
        level = logging.DEBUG
    elif verbose == 1:
        level = logging.INFO
    elif quiet:
        level = logging.ERROR
    else:
        level = logging.WARNING
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _StderrHandler):
            root.removeHandler(h)
    handler = _StderrHandler()
    if verbose:
        handler.setFormatter(logging.Formatter(VERBOSE_FORMAT))
    else:
        handler.setFormatter(OneLineFormatter())
        handler.addFilter(REPORTED_BY_COMMAND)
    root.addHandler(handler)
    root.setLevel(level)


# --- global options, also accepted after the subcommand ---------------------------------------


def _merge_global(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """A global option given after the subcommand: it overrides (-v adds to) the group's."""
    if (
        param.name is None
        or ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE
    ):
        return
    g = ctx.find_root().obj
    if not isinstance(g, Globals):  # --help, resilient parsing
        return
    if param.name == "verbose":
        g.verbose += int(value)
    elif param.name == "quiet":
        g.quiet = g.quiet or bool(value)
    else:
        setattr(g, param.name, value)
    g.configure_logging()


URL_HELP = (
    "amqp://user:pass@host:port/vhost; several comma-separated for a cluster "
    "(default: $AMQP_LOCKS_URL, $AMQP_URL, else amqp://guest:guest@localhost:5672/)."
)
HEARTBEAT_HELP = "AMQP heartbeat; a dead connection (and the locks it held) is detected after it."


def global_options(*, for_group: bool) -> list[Callable[[Any], Any]]:
    """--url, --heartbeat, -v, -q: on the group (with their defaults and environment
    variables) and on every subcommand (command line only, merged into the group's)."""
    if for_group:
        extra: dict[str, Any] = {}
        url_env: Any = ["AMQP_LOCKS_URL", "AMQP_URL"]
    else:
        extra = {"expose_value": False, "callback": _merge_global, "allow_from_autoenv": False}
        url_env = None
    return [
        click.option("--url", envvar=url_env, default=None, metavar="URL", help=URL_HELP, **extra),
        click.option(
            "--heartbeat",
            type=click.FloatRange(min=0.1),
            default=10.0 if for_group else None,
            show_default=for_group,
            metavar="SECONDS",
            help=HEARTBEAT_HELP,
            **extra,
        ),
        click.option(
            "-v", "--verbose", count=True, help="More logging (-v info, -vv debug).", **extra
        ),
        click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.", **extra),
    ]


def seconds_option(
    *decls: str,
    default: float | None = None,
    minimum: float = 0,
    show_default: bool | None = None,
    help: str,
) -> Callable[[Any], Any]:
    """A SECONDS option (a float >= `minimum`): one definition, so that every duration
    option reads and checks alike. Its default is shown unless it is None."""
    return click.option(
        *decls,
        type=click.FloatRange(min=minimum),
        default=default,
        show_default=default is not None if show_default is None else show_default,
        metavar="SECONDS",
        help=help,
    )


def add_global_options(command: click.Command) -> None:
    """Let `amqp-locks CMD ... --url U -v` work like `amqp-locks --url U -v CMD ...`."""
    for decorate in global_options(for_group=False):
        decorate(command)


def get_globals() -> Globals:
    obj = click.get_current_context().find_root().obj
    assert isinstance(obj, Globals)
    return obj


def error_line(message: str) -> None:
    """The one line a failure prints."""
    message = " ".join(str(message).split())  # one line, whatever the message holds
    print(f"amqp-locks: error: {message}", file=sys.stderr, flush=True)


def lock_name(name: str, *, admin: bool = False) -> str:
    """Validate a lock name (exit 64 when invalid); ``admin``: a token semaphore's, which
    may be cluster mode's ``X.mutex`` or ``X.slots`` (names.validate_name)."""
    try:
        return validate_name(name, admin=admin)
    except ConfigurationError as exc:
        raise CliError(Exit.USAGE, str(exc)) from None


def exit_code_for(exc: BaseException) -> tuple[int, str]:
    """Map a library error to (exit code, one-line message)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, FeatureUnavailable):
        return Exit.FEATURE, text
    if isinstance(exc, (SemaphoreNotFound, TokenSemaphoreNotFound)):
        return Exit.DATAERR, text
    if isinstance(exc, AdminLockTimeout):
        return Exit.TEMPFAIL, text
    if isinstance(exc, (AuthenticationFailed, AccessRefused)):
        return Exit.NOPERM, text
    if isinstance(exc, (BrokerUnreachable, ConnectionLost)):
        return Exit.UNAVAILABLE, text
    if isinstance(exc, LockShapeMismatch):
        return Exit.SHAPE, f"lock shape mismatch: {text}"
    if isinstance(exc, PreconditionFailed):
        return Exit.DATAERR, text
    if isinstance(exc, ConfigurationError):
        return Exit.USAGE, text
    if isinstance(exc, LockError):
        return Exit.DATAERR, text
    if isinstance(exc, BrokerError):
        return Exit.UNAVAILABLE, text
    if any(c.__name__ in ("OperationalError", "InterfaceError") for c in type(exc).__mro__):
        return Exit.UNAVAILABLE, f"database unavailable: {text.splitlines()[0] if text else ''}"
    if isinstance(exc, OSError):
        return Exit.UNAVAILABLE, text
    return Exit.SOFTWARE, f"unexpected {type(exc).__name__}: {text}"


# --- `run NAME ls -l`: COMMAND's options need `--` ---------------------------------------------


def _looks_like_option(arg: str) -> bool:
    return arg.startswith("-") and len(arg) > 1


class CommandLine(click.Command):
    """A command taking `NAME [options] -- COMMAND [ARGS...]`. Without `--`, an option
    after COMMAND's first word is refused with a hint instead of click's "no such option"
    (or, worse, silently taken as ours: `run x sleep -w 5`)."""

    def _command_start(self, args: list[str]) -> int | None:
        """Index of COMMAND's first word when an option follows it and no `--` precedes
        it; None otherwise."""
        takes_value = {
            opt
            for p in self.params
            if isinstance(p, click.Option) and not (p.is_flag or p.count)
            for opt in p.opts + p.secondary_opts
        }
        positionals = 0
        start: int | None = None
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                return None
            if _looks_like_option(arg):
                if start is not None:
                    return start
                i += 2 if arg in takes_value else 1
                continue
            positionals += 1
            if positionals == 2:
                start = i
            i += 1
        return None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        start = self._command_start(args)
        if start is not None:
            first = next(a for a in args[start:] if _looks_like_option(a))
            suggestion = shlex.join([*args[:start], "--", *args[start:]])
            known = any(
                first.split("=", 1)[0] in p.opts + p.secondary_opts
                for p in self.params
                if isinstance(p, click.Option)
            )
            why = (
                f"option {first} after COMMAND {args[start]!r} needs '--' before COMMAND"
                if known
                else f"No such option: {first}"
            )
            raise click.UsageError(f"{why}; did you mean: {ctx.command_path} {suggestion}", ctx=ctx)
        return super().parse_args(ctx, args)


# --- COMMAND: after `--`, or a shell command with -c ---------------------------------------------

#: `-c CMD`: COMMAND as one shell command line (run, elect).
SHELL_COMMAND = click.option(
    "-c",
    "--command",
    "shell_command",
    metavar="CMD",
    allow_from_autoenv=False,
    help="Run CMD with /bin/sh -c.",
)


def command_argv(command: tuple[str, ...], shell_command: str | None, usage: str) -> list[str]:
    """COMMAND's argv from the words after NAME or from -c (exactly one of them; `usage`
    is the hint when neither is given)."""
    if shell_command is not None and command:
        raise click.UsageError("give either -c CMD or COMMAND, not both")
    if shell_command is None and not command:
        raise click.UsageError(f"missing COMMAND (use: {usage})")
    return ["/bin/sh", "-c", shell_command] if shell_command is not None else list(command)


def read_status(
    broker: Broker,
    name: str,
    kinds: Sequence[Kind] = ALL_KINDS,
    *,
    records: bool = False,
    holder_timeout: float = HOLDER_TIMEOUT,
) -> list[LockStatus]:
    """``lock_status`` as the CLI reads it: holders get `holder_timeout` to answer, the
    broker's own reads the connect timeout, as "silent" is for the rest of the CLI (exit
    69). The library's bound (the holders' time + 1 s) cut reads that a loaded 2-core
    machine made slower, and the CLI reported a slow broker as a silent one (rehearsals
    13 and 16: `run -n C`'s slot count; 17: `status --holder-timeout 0`)."""
    read = read_lock_status(broker.core, name, kinds, records=records, timeout=holder_timeout)
    limit = holder_timeout + broker.core.connect_timeout
    return broker.core.run(bounded(read, limit, f"status of {name!r}"))
