"""The AMQP client's types that the layers above transport/ handle, named in one place.

The protocol modules hold channels and deliveries and read a delivery's method (a
``basic.get-ok`` or ``get-empty``, a broker's ``basic.cancel``); they take these names
from here, so aiormq and pamqp are imported under transport/ only (tests/test_layers.py
keeps it so, but for the few modules it lists) and a change of client is a change here.
"""

from __future__ import annotations

from aiormq.abc import AbstractChannel, DeliveredMessage
from aiormq.exceptions import (
    AMQPError,
    ChannelInvalidStateError,
    ChannelNotFoundEntity,
    DeliveryError,
    PublishError,
)
from pamqp.body import ContentBody
from pamqp.commands import Basic, Queue
from pamqp.header import ContentHeader

from .aiormq_compat import (
    forget_consumer,
    forget_returns,
    publish_frames,
    send_together,
    write_confirmed,
)

__all__ = [
    "AMQPError",
    "AbstractChannel",
    "Basic",
    "ChannelInvalidStateError",
    "ChannelNotFoundEntity",
    "ContentBody",
    "ContentHeader",
    "DeliveredMessage",
    "DeliveryError",
    "PublishError",
    "Queue",
    "forget_consumer",
    "forget_returns",
    "publish_frames",
    "send_together",
    "write_confirmed",
]
