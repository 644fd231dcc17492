"""A throwaway user and vhost on a test node, with the permissions a test gives it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from amqp_locks import Broker
from amqp_locks_dev import devbroker


@contextlib.contextmanager
def restricted_url(
    node: devbroker.NodeInfo, configure: str, write: str, read: str
) -> Iterator[str]:
    """Yields an AMQP URL for a new user in a new vhost with just these ``set_permissions``
    patterns; the user and the vhost are deleted afterwards."""
    user, vhost = f"u{uuid.uuid4().hex[:8]}", f"v{uuid.uuid4().hex[:8]}"
    devbroker.rabbitmqctl(node, "add_vhost", vhost)
    devbroker.rabbitmqctl(node, "add_user", user, "pw")
    devbroker.rabbitmqctl(node, "set_permissions", "-p", vhost, user, configure, write, read)
    try:
        yield f"amqp://{user}:pw@127.0.0.1:{node.amqp_port}/{vhost}"
    finally:
        devbroker.rabbitmqctl(node, "delete_user", user)
        devbroker.rabbitmqctl(node, "delete_vhost", vhost)


@contextlib.contextmanager
def restricted_brokers(
    node: devbroker.NodeInfo,
    names: str,
    write: str = r"^amq\.default$",
    holder_id: str | None = None,
) -> Iterator[tuple[Broker, Broker]]:
    """Two Brokers of a :func:`restricted_url` user who may configure and read `names` and
    write to `write`: a holder (with `holder_id`) and another client."""
    with (
        restricted_url(node, names, write, names) as url,
        Broker(url, holder_id=holder_id) as holder,
        Broker(url) as other,
    ):
        yield holder, other
