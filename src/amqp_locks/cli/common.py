"""What every sub-command shares: global options, the broker, error reporting."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import click

from ..errors import (
    AccessRefused,
    AdminLockTimeout,
    AuthenticationFailed,
    BrokerError,
    BrokerUnreachable,
    ConfigurationError,
    ConnectionLost,
    LockError,
    PreconditionFailed,
    SemaphoreNotFound,
)
from ..names import validate_name
from ..tokens import TokenSemaphoreNotFound
from ..transport.broker import Broker, default_connection_name
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

    def broker(self, purpose: str) -> Broker:
        """A Broker whose connection name says what this process does, host and pid."""
        return Broker(
            self.url,
            heartbeat=self.heartbeat,
            connection_name=default_connection_name(purpose),
        )

    def info(self, message: str) -> None:
        """A progress line on stderr (suppressed by -q)."""
        if not self.quiet:
            click.echo(f"amqp-locks: {message}", err=True)


def get_globals() -> Globals:
    obj = click.get_current_context().find_root().obj
    assert isinstance(obj, Globals)
    return obj


def error_line(message: str) -> None:
    """The one line a failure prints."""
    message = " ".join(str(message).split())  # one line, whatever the message holds
    print(f"amqp-locks: error: {message}", file=sys.stderr, flush=True)


def lock_name(name: str) -> str:
    """Validate a lock name (exit 64 when invalid)."""
    try:
        return validate_name(name)
    except ConfigurationError as exc:
        raise CliError(Exit.USAGE, str(exc)) from None


def exit_code_for(exc: BaseException) -> tuple[int, str]:
    """Map a library error to (exit code, one-line message)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, (SemaphoreNotFound, TokenSemaphoreNotFound)):
        return Exit.DATAERR, text
    if isinstance(exc, AdminLockTimeout):
        return Exit.TEMPFAIL, text
    if isinstance(exc, (AuthenticationFailed, AccessRefused)):
        return Exit.NOPERM, text
    if isinstance(exc, (BrokerUnreachable, ConnectionLost)):
        return Exit.UNAVAILABLE, text
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
