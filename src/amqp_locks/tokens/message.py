"""A token message: its permit id in the body, and headers saying where its fencing token
comes from. Pure data: nothing here talks to the broker."""

from __future__ import annotations

from typing import Any

from ..names import token_message_id
from ..transport.wire import Basic, DeliveredMessage

#: Token header saying where its fencing token comes from: on quorum queues the counting
#: rule it was minted under (`features.counting_rule`; amqp-locks 0.1 wrote
#: "delivery-count"), per-token return counts; "fence": the lock's fence queue.
FENCING_HEADER = "amqp-locks-fencing"
DELIVERY_COUNT = "delivery-count"
FENCE = "fence"
#: Classic tokens that carry their counter in EPOCH_HEADER / COUNT_HEADER.
CARRIED = "carried"
EPOCH_HEADER = "amqp-locks-epoch"
COUNT_HEADER = "amqp-locks-count"
#: Quorum tokens: added to the delivery count (see `fencing.mint_headers`).
BASE_HEADER = "amqp-locks-fence-base"
#: A token of a queue made on first use, which leaves nothing behind (no `N-fence`): each
#: grant takes its fencing token from the lock's fence shard (`fencing.take_token`).
SHARD = "shard"


def token_id(message: DeliveredMessage) -> int:
    """The permit id in the body (0 for a message that is not one of ours)."""
    body = message.body.strip()
    return int(body) if body.isdigit() else 0


def delivery_tag(message: DeliveredMessage) -> int:
    tag = getattr(message.delivery, "delivery_tag", 0)
    return tag if isinstance(tag, int) else 0


def headers_of(message: DeliveredMessage) -> dict[str, Any]:
    return (message.header.properties.headers or {}) if message.header else {}


def text(value: Any) -> str | None:
    """A header's text (the broker hands long strings back as bytes)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def int_header(headers: dict[str, Any], key: str) -> int | None:
    value = headers.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def token_properties(name: str, permit: int, headers: dict[str, Any]) -> Basic.Properties:
    """A new token's properties: persistent, named `N#id`, with its fencing headers."""
    return Basic.Properties(
        delivery_mode=2,
        message_id=token_message_id(name, permit),
        app_id="amqp-locks",
        headers=headers,
    )


def carrying(message: DeliveredMessage, epoch: int, count: int) -> Basic.Properties:
    """The token's properties, carrying (epoch, count)."""
    props = message.header.properties if message.header else Basic.Properties()
    headers = dict(props.headers or {})
    headers.update({FENCING_HEADER: CARRIED, EPOCH_HEADER: epoch, COUNT_HEADER: count})
    return Basic.Properties(
        delivery_mode=2,
        message_id=props.message_id,
        app_id=props.app_id,
        headers=headers,
    )
