"""Test-and-set stamps: how a queue made on first use gets exactly one creator.

``x-max-length`` only counts ready messages, so "publish if the queue is empty" would let
a second token in while the first is held. Instead each would-be creator declares the
queue with its own random ``x-max-length`` (a *stamp*, far above any queue length, so it
limits nothing) and publishes the queue's tokens in the same write. RabbitMQ compares
``x-max-length`` when a queue is declared again and refuses another value with 406
PRECONDITION_FAILED, whose text names the queue's own value; a refused channel drops the
publishes behind the declaration. So of all racers exactly one creates and fills the queue.

A stamp's low :data:`PERMIT_BITS` bits carry a count (a token semaphore's permits, a
read-write lock's R): the queue says how many tokens it was made with, without a ledger.
:func:`read_count` tells a stamp from a plain ``x-max-length`` (a read-write lock made by
an earlier release carries R itself). Used by tokens/fresh.py and rwlock/admin.py.
"""

from __future__ import annotations

import random

#: A stamp's low bits hold the count; the rest is random.
PERMIT_BITS = 20
#: The largest count a stamp can carry.
MAX_PERMITS: int = 2**PERMIT_BITS - 1
#: The stamps' range: far above any queue length, within AMQP's signed 64-bit integers.
STAMP_RANGE = (2**40, 2**62)

_random = random.SystemRandom()


def new_stamp(permits: int = 1) -> int:
    """A random stamp in :data:`STAMP_RANGE` whose low :data:`PERMIT_BITS` are `permits`."""
    if not 1 <= permits <= MAX_PERMITS:
        raise ValueError(f"a stamp carries a count of 1 to {MAX_PERMITS}, not {permits}")
    high = _random.randrange(STAMP_RANGE[0] >> PERMIT_BITS, STAMP_RANGE[1] >> PERMIT_BITS)
    return int(high << PERMIT_BITS | permits)


def permits_of(stamp: int) -> int:
    """The count a stamp was made with (:func:`new_stamp`)."""
    return stamp & MAX_PERMITS


def is_stamp(value: int) -> bool:
    return STAMP_RANGE[0] <= value < STAMP_RANGE[1]


def read_count(max_length: int) -> int:
    """The count an ``x-max-length`` says: a stamp's, or the plain value itself."""
    return permits_of(max_length) if is_stamp(max_length) else max_length
