"""How aiormq's log records about our own connections reach the application.

aiormq logs an ordinary connection loss as a WARNING with two chained tracebacks and a
broker's close as an ERROR, for losses every lease already reports; these filters route
what aiormq says on our I/O loops to ``amqp_locks.transport`` at the level it deserves.
Installed once, on import of the transport.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import aiormq.exceptions as ex

from .aiormq_compat import LOGGER_NAMES

log = logging.getLogger("amqp_locks.transport")


class _OwnCancelsFilter(logging.Filter):
    """aiormq warns on every broker-side consumer cancel; for us those are expected
    (our own release deletes the watched queue) and leases log the ones that matter."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Consumer %r cancelled by the broker")


logging.getLogger("aiormq.channel").addFilter(_OwnCancelsFilter())

#: Event loops our sessions run on (the Broker's I/O threads): what aiormq logs there is
#: about our connections.
OUR_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

#: The broker saying we broke the protocol, or a frame we could not parse: worth a
#: traceback, unlike the other ways a connection ends.
_PROTOCOL_ERRORS = (
    ex.ConnectionSyntaxError,
    ex.ConnectionFrameError,
    ex.ConnectionCommandInvalid,
    ex.ConnectionUnexpectedFrame,
    ex.ConnectionNotImplemented,
    ex.ProtocolSyntaxError,
)
_CONNECTION_FORCED = 320


def _expected(record: logging.LogRecord) -> bool:
    """A connection ending as connections do (reset, EOF, timeout, a broker's forced
    close), which the session reports itself, once, with the reason; a connection attempt
    failing, which the caller gets as an exception; or a channel closed because we
    cancelled its call (a timed-out acquire, a closing Broker)."""
    msg = str(record.msg)
    if msg.startswith("Closing channel") and "cancelled" in msg:
        return True
    if msg.startswith("error when creating transport"):
        return True  # the caller gets it as BrokerUnreachable (connect_error)
    if msg.startswith("Unexpected connection close from remote"):
        return len(record.args or ()) >= 2 and record.args[1] == _CONNECTION_FORCED  # type: ignore[index]
    exc = record.exc_info[1] if record.exc_info else None
    return isinstance(exc, (ConnectionError, OSError, asyncio.IncompleteReadError)) and (
        not isinstance(exc, _PROTOCOL_ERRORS)
    )


class _OwnConnectionsFilter(logging.Filter):
    """aiormq logs an ordinary connection loss as a WARNING with two chained tracebacks
    ("Cancelling cause reader exited abnormally" ... "AMQPConnectionError: Server
    connection reset") and a broker's close as an ERROR: on a user's stderr through
    logging's last resort when the application configured no logging, for a loss the lease
    already reports; and a WARNING for every channel whose call we cancelled. Records
    emitted on our I/O loops go to `amqp_locks.transport` instead: DEBUG for those, their
    own level (with the traceback) for the rest (a malformed frame, a protocol error).
    Other aiormq users' records pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return True
        if loop not in OUR_LOOPS:
            return True
        level = logging.DEBUG if _expected(record) else record.levelno
        log.log(level, "aiormq: %s", record.getMessage(), exc_info=record.exc_info)
        return False


for _name in LOGGER_NAMES:
    logging.getLogger(_name).addFilter(_OwnConnectionsFilter())
