"""What a token semaphore's client expects of its tokens, and what it reads from the
queue when a token does not say (shape.py has the rules)."""

from __future__ import annotations

from ..errors import QueueNotFound
from ..names import token_queue
from ..shape import held_delay
from ..stamps import is_stamp, permits_of
from ..transport.session import Session
from .arguments import token_arguments
from .fresh import fresh_arguments
from .ledger import read_ledger


async def read_token_shape(
    session: Session, name: str, need_delay: bool
) -> tuple[int | None, int | None]:
    """(permits, lock delay ms) of the token queue of `name`, from its arguments: a
    first-use queue's stamp says its count, a set-up one's ledger; the delay (when
    needed, 4.3+) from a declaration the broker refuses either way. None where the queue
    cannot say (it is gone: our consumer is cancelled then)."""
    queue = token_queue(name)
    permits: int | None = None
    candidates = []
    for quorum in session.queue_types:  # a queue of either type
        try:
            stamp = await session.held_max_length(queue, fresh_arguments(session, 0, quorum))
        except QueueNotFound:
            return None, None
        if stamp is not None and is_stamp(stamp):
            permits = permits_of(stamp)
            candidates = [fresh_arguments(session, stamp, quorum)]
            break
        candidates.append(token_arguments(session, quorum))
    if permits is None:  # set up by an administrator: its ledger has the count
        ledger = await read_ledger(session, name)
        permits = None if ledger is None else ledger.permits
    delay = None
    if need_delay:
        for args in candidates:
            delay = await held_delay(session, queue, args)
            if delay is not None:
                break
    return permits, delay
