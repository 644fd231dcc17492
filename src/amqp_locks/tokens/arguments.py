"""A token queue's arguments: shared by the administrator's setup (admin.py) and the
first-use queues (fresh.py)."""

from __future__ import annotations

from typing import Any

from ..transport.features import (
    broker_version,
    consumer_timeout_arguments,
    lock_queue_arguments,
)
from ..transport.session import Session


def token_arguments(session: Session, quorum: bool) -> dict[str, Any]:
    """The token queue's arguments for this broker (see the package docstring)."""
    version = broker_version(session)
    args: dict[str, Any] = lock_queue_arguments(session) if quorum else {}
    # 3.12 added the per-queue timeout; 4.3 stopped timing out classic-queue consumers
    # and refuses the argument there (rabbitmq-server#17144), so it goes to quorum only.
    return {**args, **consumer_timeout_arguments(version, quorum)}
