"""Translate aiormq/pamqp failures into the library's typed errors."""

from __future__ import annotations

import asyncio
import re
import ssl

import aiormq.exceptions as ex
from yarl import URL

from ..errors import (
    AccessRefused,
    AmqpLocksError,
    AuthenticationFailed,
    BrokerError,
    BrokerUnreachable,
    ConnectionLost,
    InvalidQueueName,
    PreconditionFailed,
    QueueNotFound,
    ResourceLocked,
)
from .refusals import inequivalent, invalid_arg


def censor(url: URL) -> str:
    """The URL without its password, for messages and logs."""
    return str(url.with_password("******")) if url.password else str(url)


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@/\s]*@")


def censor_text(text: str, raw_url: str | None = None) -> str:
    """`text` with every ``scheme://user:password@`` password starred, and the password of
    `raw_url` (a URL that may not even parse) wherever else it appears."""
    out = _USERINFO.sub(r"\g<scheme>\g<user>:******@", text)
    if raw_url:
        m = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:(?P<pw>[^@/\s]+)@", raw_url)
        if m:
            out = out.replace(m.group("pw"), "******")
    return out


def _text(exc: BaseException) -> str:
    return " ".join(str(a) for a in exc.args if a is not None) or type(exc).__name__


def channel_error(exc: BaseException, queue: str | None = None) -> AmqpLocksError:
    """Map a channel-level error (the channel is gone, the connection is not)."""
    what = f" (queue {queue!r})" if queue else ""
    if isinstance(exc, AmqpLocksError):
        return exc
    if isinstance(exc, ValueError):
        # pamqp validates a frame as it builds it: a name outside its domain, or too long.
        return InvalidQueueName(
            f"the AMQP client refused a name{what}: {_text(exc)}; names.py should have "
            "mapped it to one it accepts (a bug in amqp-locks: please report the lock name)",
            queue,
        )
    if isinstance(exc, ex.ChannelNotFoundEntity):
        return QueueNotFound(f"404 NOT_FOUND{what}: {_text(exc)}", queue)
    if isinstance(exc, ex.ChannelLockedResource):
        return ResourceLocked(
            f"405 RESOURCE_LOCKED{what}: held exclusively by another connection", queue
        )
    if isinstance(exc, ex.ChannelPreconditionFailed):
        text = _text(exc)
        return PreconditionFailed(
            f"406 PRECONDITION_FAILED{what}: the queue exists with other arguments or flags "
            f"than amqp-locks declares ({text}); delete it or use another lock name",
            queue,
            refusal=inequivalent(text),
            invalid_arg=invalid_arg(text),
        )
    if isinstance(exc, ex.ChannelAccessRefused):
        return AccessRefused(
            f"403 ACCESS_REFUSED{what}: the user lacks configure/write/read permission "
            f"({_text(exc)})"
        )
    if isinstance(exc, ex.AMQPConnectionError | ConnectionError):
        return ConnectionLost(f"connection to the broker lost: {_text(exc)}")
    if isinstance(exc, ex.ChannelInvalidStateError):
        return ConnectionLost(f"channel unusable: {_text(exc)}")
    if isinstance(exc, ex.ChannelClosed):
        return BrokerError(f"channel closed by the broker{what}: {_text(exc)}")
    return BrokerError(f"{type(exc).__name__}{what}: {_text(exc)}")


def _tls_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind `exc` (aiormq re-raises it as AMQPConnectionError)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None or isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def connect_error(exc: BaseException, url: URL) -> AmqpLocksError:
    """Map a failure to open the connection."""
    where = censor(url)
    if isinstance(exc, ex.ProbableAuthenticationError | ex.AuthenticationError):
        return AuthenticationFailed(
            f"broker {where} refused the credentials of user {url.user!r}: {_text(exc)}"
        )
    refused_open = isinstance(exc, ex.InvalidFrameError) and "Connection.Close" in _text(exc)
    if (
        refused_open
        or isinstance(exc, ex.ConnectionNotAllowed)
        or (isinstance(exc, ex.ConnectionClosed) and exc.args and exc.args[0] in (530, 403))
    ):
        # Connection.Open answered by Connection.Close: 530 NOT_ALLOWED (no such vhost,
        # or no permission on it).
        return AccessRefused(
            f"broker {where} refused access to vhost {url.path[1:] or '/'!r} for user "
            f"{url.user!r} (the vhost does not exist or the user has no permissions on it)"
        )
    tls = _tls_error(exc)
    if isinstance(tls, ssl.SSLCertVerificationError):
        return BrokerUnreachable(
            f"TLS to broker {where}: its certificate could not be verified "
            f"({tls.verify_message}); trust its CA with ?cafile=PATH in the URL or "
            "Broker(ssl_context=...)"
        )
    if tls is not None:
        return BrokerUnreachable(f"TLS handshake with broker {where} failed: {_text(tls)}")
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return BrokerUnreachable(f"broker {where} did not answer within the connect timeout")
    if isinstance(exc, OSError | ex.AMQPConnectionError):
        return BrokerUnreachable(f"cannot connect to broker {where}: {_text(exc)}")
    return BrokerError(f"cannot connect to broker {where}: {type(exc).__name__}: {_text(exc)}")


#: RabbitMQ 4.2+'s 506 for a publish that met a queue in the instant of its delete, written
#: by ``rabbit_channel:deliver_to_queues`` with ``~tp`` (pretty-printed: line breaks where
#: the term is long; a non-ASCII name as ``<<"..."/utf8>>``).
_UNDELIVERED = re.compile(
    r'failed to deliver message: \{not_found,\s*\{resource,\s*<<"[^"]*"(?:/utf8)?>>,\s*'
    r'queue,\s*<<"(?P<queue>[^"\\]*)"'
)


def undelivered_to(reason: str) -> str | None:
    """The queue a publish could not be delivered to, when a connection ended with RabbitMQ
    4.2+'s 506 "failed to deliver message: {not_found, ...}" (docs/protocol.md: the
    publish met that queue in the instant of its delete; the broker closes the
    publisher's connection); None for any other end, or a text cut short (252 bytes)."""
    found = _UNDELIVERED.search(reason)
    return None if found is None else found["queue"]
