"""Where a Broker connects: its URL(s), as given, from ``$AMQP_URL``, or the default;
and the connection names that tell status tools who holds what."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from yarl import URL

from ..errors import ConfigurationError
from .errors import censor, censor_text

#: Where ``Broker()`` connects with no `url` and no ``$AMQP_URL``: what other AMQP clients
#: (pika, aio-pika, kombu) default to. Never a server of our own: the library starts none.
DEFAULT_URL = "amqp://guest:guest@localhost:5672/"


#: What ``Broker(url=...)`` takes: one URL, several comma-separated, or a sequence.
UrlSpec = str | Sequence[str] | None


def _parse_url(raw: str) -> URL:
    try:
        parsed = URL(raw)
        parsed.port  # noqa: B018 - yarl checks the port's range lazily
    except (TypeError, ValueError) as exc:
        # Never the password in a message: the raw text is censored, and the parser's own
        # message too (it may quote the URL); the cause is dropped for the same reason.
        raise ConfigurationError(
            f"invalid AMQP URL {censor_text(raw)!r}: {censor_text(str(exc), raw)}"
        ) from None
    if parsed.scheme not in ("amqp", "amqps") or not parsed.host:
        raise ConfigurationError(
            f"invalid AMQP URL {censor(parsed)!r}: expected amqp://user:pass@host:port/vhost"
        )
    return parsed


def resolve_urls(url: UrlSpec) -> list[URL]:
    """The nodes to connect to, in order of preference: `url`, else `$AMQP_URL`, else
    :data:`DEFAULT_URL` (a broker on this host with RabbitMQ's default user).

    A string may list several nodes of one cluster separated by commas (a comma inside a
    password must be percent-encoded as ``%2C``)."""
    if url is not None and not isinstance(url, str):
        raws = [str(u).strip() for u in url]
        if not raws:
            raise ConfigurationError("empty list of AMQP URLs")
    else:
        text = url or os.environ.get("AMQP_URL") or DEFAULT_URL
        raws = [part.strip() for part in text.split(",")]
    if any(not r for r in raws):
        raise ConfigurationError(f"empty URL in the AMQP URL list {raws!r}")
    return [_parse_url(r) for r in raws]


def resolve_url(url: str | None) -> URL:
    """The first node of :func:`resolve_urls` (for callers that want exactly one)."""
    return resolve_urls(url)[0]


def default_connection_name(purpose: str = "") -> str:
    """Connection names say host and pid, so status tools show who holds what."""
    extra = f" {purpose}" if purpose else ""
    return f"amqp-locks{extra} host={socket.gethostname()} pid={os.getpid()}"
