"""The `amqp-locks` command: flock-style `run`, administration, election and status.
See docs/cli.md for recipes and the exit codes.

`main(argv) -> int` is the console-script entry point; every failure is reported as one
line on stderr and a documented exit code (:mod:`amqp_locks.cli.exitcodes`).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import click

from .. import __version__
from .common import CliError, Globals, add_global_options, error_line, exit_code_for, global_options
from .exitcodes import Exit

EPILOG = """\b
Examples:
  amqp-locks run nightly-report --nonblock -- ./report.sh      # cron singleton
  amqp-locks run deploys -n 3 -w 600 -- ./deploy.sh "$HOST"    # at most 3 at once
  amqp-locks run reindex -c 'make reindex && make warm'        # shell command
  amqp-locks semaphore create images 5
  amqp-locks status images deploys --json
  amqp-locks elect scheduler --locker amqp -- ./scheduler      # master/standby

\b
Without --url, $AMQP_LOCKS_URL and $AMQP_URL, commands connect to
amqp://guest:guest@localhost:5672/.
Exit codes: 1 `run`: lock busy (--nonblock, or -w ran out; -E CODE changes it),
2 an extra or OS facility missing (the message names it), 64 usage, 65 unknown
lock/data, 69 broker unreachable or silent (whatever -w and -E say), 70 a bug (-v
shows the traceback), 75 `run`: lock lost while COMMAND ran; admin: its
--admin-timeout, --wait or --timeout ran out, 76 lock shape mismatch, 77 permission,
78 `elect --config` file invalid, 126/127 COMMAND not executable/not found, 130
interrupted before COMMAND started; `run`/`elect`: COMMAND's own status (128+N when
signal N killed it); see docs/cli.md.
"""
#: Options also come from AMQP_LOCKS_<OPTION> (group) and AMQP_LOCKS_<COMMAND>_<OPTION>.
ENV_PREFIX = "AMQP_LOCKS"


def _group(f: Callable[..., Any]) -> click.Group:
    for decorate in reversed(global_options(for_group=True)):
        f = decorate(f)
    f = click.version_option(__version__, "--version", prog_name="amqp-locks")(f)
    return click.group(
        epilog=EPILOG,
        context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": ENV_PREFIX},
    )(click.pass_context(f))


@_group
def cli(ctx: click.Context, url: str | None, heartbeat: float, verbose: int, quiet: bool) -> None:
    """Distributed locks, semaphores and master/standby election on RabbitMQ.

    Every option can also be set by an environment variable (shown in each command's
    --help): AMQP_LOCKS_URL (or AMQP_URL), AMQP_LOCKS_HEARTBEAT, AMQP_LOCKS_VERBOSE,
    AMQP_LOCKS_QUIET, and AMQP_LOCKS_<COMMAND>_<OPTION> for a command's options, e.g.
    AMQP_LOCKS_RUN_WAIT=600. The command line wins. --url, --heartbeat, -v and -q are also
    accepted after the command name.
    """
    ctx.obj = Globals(url=url, heartbeat=heartbeat, verbose=verbose, quiet=quiet)
    ctx.obj.configure_logging()


def _register() -> None:
    from .admin import semaphore, token
    from .elect import elect
    from .run import run
    from .status import status

    for command in (run, semaphore, token, elect, status):
        cli.add_command(command)
    _decorate(cli, top=True)


def _decorate(command: click.Command, top: bool = False) -> None:
    """Global options on every subcommand; every option's variable shown in --help."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _decorate(sub)
    elif not top:
        add_global_options(command)
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help", "version"):
            param.show_envvar = param.allow_from_autoenv or bool(param.envvar)


_register()


def _verbose_requested(args: list[str]) -> bool:
    """-v among our own arguments (not COMMAND's, after `--`), or $AMQP_LOCKS_VERBOSE."""
    ours = args[: args.index("--")] if "--" in args else args
    if any(a == "--verbose" or (a.startswith("-v") and set(a[1:]) == {"v"}) for a in ours):
        return True
    return os.environ.get(f"{ENV_PREFIX}_VERBOSE", "0") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (never raises, except SystemExit)."""
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = _verbose_requested(args)
    try:
        rv = cli.main(args=args, prog_name="amqp-locks", standalone_mode=False)
    except click.exceptions.UsageError as exc:
        hint = ""  # a "did you mean: amqp-locks ..." already says what to type
        if exc.ctx is not None and "did you mean" not in exc.format_message():
            hint = f" (try '{exc.ctx.command_path} --help')"
        error_line(f"{exc.format_message()}{hint}")
        return Exit.USAGE
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.exceptions.Abort:
        error_line("interrupted")
        return Exit.INTERRUPTED
    except click.ClickException as exc:
        error_line(exc.format_message())
        return Exit.USAGE
    except CliError as exc:
        if exc.message:
            error_line(exc.message)
        return int(exc.code)
    except KeyboardInterrupt:
        error_line("interrupted")
        return Exit.INTERRUPTED
    except Exception as exc:
        code, message = exit_code_for(exc)
        error_line(message)
        if verbose or code == Exit.SOFTWARE:
            if code == Exit.SOFTWARE:
                error_line("this is a bug; please report it with the traceback below (-v)")
            if verbose:
                traceback.print_exc()
        return int(code)
    if isinstance(rv, int):
        return rv
    return Exit.OK
