"""The AMQP transport: one connection per Broker, owned by a private I/O thread."""

from .broker import Broker, BrokerCore

__all__ = ["Broker", "BrokerCore"]
