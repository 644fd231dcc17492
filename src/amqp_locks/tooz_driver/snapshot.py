"""Snapshots (one message in a queue, read and rewritten under a mutex), the member
records they hold, and amqp-locks errors as tooz errors."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import tooz
from tooz import coordination, utils

from ..errors import AmqpLocksError, BrokerUnreachable, ConnectionLost
from ..tokens.message import delivery_tag
from ..transport.channel_ops import ack_through, give_back_through, publish_durable, take
from ..transport.wire import AbstractChannel

#: Queues whose existence is a member or a leader: probes are dropped, never stored.
FLAG_ARGS: dict[str, Any] = {"x-max-length": 0}


async def read_snapshot(ch: AbstractChannel, queue: str) -> tuple[dict[str, Any] | None, int]:
    """Take every message of `queue` (unacked); the newest valid snapshot, the last tag."""
    best: dict[str, Any] | None = None
    last = 0
    while True:
        msg = await take(ch, queue)
        if msg is None:
            return best, last
        tag = delivery_tag(msg)
        last = max(last, tag)
        try:
            data = utils.loads(msg.body)
        except Exception:  # a stray probe or foreign message: dropped on the next write
            continue
        fresh = isinstance(data, dict) and isinstance(data.get("v"), int)
        if fresh and (best is None or data["v"] > best["v"]):
            best = data


async def finish_snapshot(
    ch: AbstractChannel, queue: str, last: int, new: dict[str, Any] | None
) -> None:
    """Publish `new` (confirmed) then ack the old messages; or give them back unchanged."""
    if new is not None:
        await publish_durable(ch, queue, utils.dumps(new))
        if last:
            await ack_through(ch, last)
    elif last:
        await give_back_through(ch, last)


def now_ms() -> float:
    return time.time() * 1000.0


class Members:
    """The member records of a group snapshot, keyed by member id."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.records: dict[bytes, dict[str, Any]] = {}
        for rec in state.get("members", []):
            self.records[bytes(rec["id"])] = rec

    def store(self) -> None:
        self.state["members"] = list(self.records.values())


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """amqp-locks errors as tooz errors (connection problems as ToozConnectionError)."""
    try:
        yield
    except tooz.ToozError:
        raise
    except (BrokerUnreachable, ConnectionLost) as exc:
        utils.raise_with_cause(coordination.ToozConnectionError, str(exc), cause=exc)
    except AmqpLocksError as exc:
        utils.raise_with_cause(tooz.ToozError, str(exc), cause=exc)
