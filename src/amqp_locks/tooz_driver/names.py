"""Queue names of tooz ids, and the AMQP URLs of a tooz backend URL."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from tooz import coordination

REGISTRY_QUEUE = "tooz.groups"
REGISTRY_LOCK = "tooz.groups.lock"

_SAFE = re.compile(rb"[A-Za-z0-9_:\-]{1,100}")

#: Query options handed to the AMQP client (TLS); the others are the driver's own.
_PASSED_QUERY = frozenset({"cafile", "capath", "cadata", "keyfile", "certfile", "no_verify_ssl"})


def as_bytes(ident: bytes | str) -> bytes:
    """A tooz id as bytes (tooz passes bytes, callers sometimes str)."""
    return ident.encode("utf-8") if isinstance(ident, str) else bytes(ident)


def encode_id(ident: bytes | str) -> str:
    """The queue-name form of a tooz id (group, member or lock name): the id when it is
    plain, else ``+`` and its hex (up to 50 bytes), else ``#`` and its SHA-256. Only
    characters every AMQP client accepts in a queue name (``~`` is not one: releases
    before 0.3 used it, and the AMQP client refused every such id)."""
    raw = as_bytes(ident)
    if _SAFE.fullmatch(raw):
        return raw.decode("ascii")
    if len(raw) <= 50:
        return "+" + raw.hex()
    return "#" + hashlib.sha256(raw).hexdigest()


def tooz_name(ident: bytes, kind: str, member: bytes | None = None) -> str:
    """``tooz.<ident>.<kind>``, or ``tooz.<ident>.<kind>.<member>`` for the queues whose
    existence is one member's (``member``, ``leader``). Kinds: ``group``, ``group-lock``,
    ``member``, ``leader`` (for a group id), ``lock`` (for a lock name)."""
    name = f"tooz.{encode_id(ident)}.{kind}"
    return name if member is None else f"{name}.{encode_id(member)}"


def broker_urls(parsed_url: Any) -> list[str]:
    """AMQP URLs from a tooz backend URL: ``rabbit://`` (oslo.messaging's ``transport_url``,
    hosts separated by commas) and ``amqp://`` become ``amqp://``; ``amqps://`` stays."""
    scheme = "amqps" if parsed_url.scheme == "amqps" else "amqp"
    path = parsed_url.path or "/"
    hosts = [h for h in (parsed_url.netloc or "").split(",") if h.strip()]
    if not hosts:
        raise coordination.ToozError(f"no broker host in the backend URL ({scheme}://...)")
    query = "&".join(
        part
        for part in (parsed_url.query or "").split("&")
        if part and part.split("=", 1)[0] in _PASSED_QUERY
    )
    tail = f"?{query}" if query else ""
    return [f"{scheme}://{h.strip()}{path}{tail}" for h in hosts]
