"""The `amqp-locks` command: flock-style `run`, administration, election and status.
See docs/cli.md for recipes and the exit codes.

`main(argv) -> int` is the console-script entry point; every failure is reported as one
line on stderr and a documented exit code (:mod:`amqp_locks.cli.exitcodes`).
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Sequence

import click

from .. import __version__
from .common import CliError, Globals, error_line, exit_code_for
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
Without --url and $AMQP_URL, commands connect to amqp://guest:guest@localhost:5672/.
Exit codes: 64 usage, 65 unknown lock/data, 69 broker unavailable, 75 lock lost or
timeout, 77 permission, 126/127 COMMAND not executable/not found; see docs/cli.md.
"""


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    envvar="AMQP_URL",
    default=None,
    metavar="URL",
    help="amqp://user:pass@host:port/vhost (default: $AMQP_URL, else amqp://guest:guest@localhost:5672/).",
)
@click.option(
    "--heartbeat",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="AMQP heartbeat; a dead connection (and the locks it held) is detected after it.",
)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.version_option(__version__, "--version", prog_name="amqp-locks")
@click.pass_context
def cli(ctx: click.Context, url: str | None, heartbeat: float, verbose: int, quiet: bool) -> None:
    """Distributed locks, semaphores and master/standby election on RabbitMQ."""
    # Failures are reported by the command itself, as one line: library logging (and
    # aiormq's) is shown only with -v.
    level = logging.CRITICAL + 1
    if verbose == 1:
        level = logging.INFO
    elif verbose >= 2:
        level = logging.DEBUG
    logging.basicConfig(
        level=level, format="amqp-locks[%(process)d] %(levelname)s %(name)s: %(message)s"
    )
    ctx.obj = Globals(url=url, heartbeat=heartbeat, verbose=verbose, quiet=quiet)


def _register() -> None:
    from .admin import semaphore, token
    from .elect import elect
    from .run import run
    from .status import status

    for command in (run, semaphore, token, elect, status):
        cli.add_command(command)


_register()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (never raises, except SystemExit)."""
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("-v", "-vv", "--verbose") for a in args)
    try:
        rv = cli.main(args=args, prog_name="amqp-locks", standalone_mode=False)
    except click.exceptions.UsageError as exc:
        hint = ""
        if exc.ctx is not None:
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
