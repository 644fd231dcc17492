"""Queues another RabbitMQ line declared (transport/line_args.py): after an upgrade, or on a
cluster in the middle of a rolling one, a queue keeps the line-dependent arguments it was
first declared with; our declaration adapts to those and says what the queue lacks, and
anything else is still refused."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiormq
import pytest

from amqp_locks import Broker, PreconditionFailed, TokenSemaphore
from amqp_locks.names import sentinel_queue, token_queue, wakeup_queue
from amqp_locks.transport.features import (
    NOTICE_TTL_MS,
    broker_version,
    consumer_timeout_arguments,
    quorum_arguments,
)
from amqp_locks.transport.line_args import (
    CONSUMER_DISCONNECTED_TIMEOUT_MS,
    other_line,
    other_line_warning,
    short_delay,
)
from amqp_locks.transport.wakeups import subscribe

from .waiting import wait_until

# The 406 texts as RabbitMQ 4.3.6 sent them (the same wording on 3.10.8 and 4.0.5).
_406 = "PRECONDITION_FAILED - inequivalent arg '{arg}' for queue 'q' in vhost '/': {diff}"
OURS_43 = quorum_arguments((4, 3), lock_delay_ms=CONSUMER_DISCONNECTED_TIMEOUT_MS)


def _error(arg: str, diff: str) -> str:
    # As the library words it around the broker's text (transport/errors.py).
    return (
        "406 PRECONDITION_FAILED (queue 'q'): the queue exists with other arguments or flags "
        f"than amqp-locks declares ({_406.format(arg=arg, diff=diff)}); delete it or use "
        "another lock name"
    )


def test_an_argument_the_queue_lacks_is_left_out() -> None:
    text = _error("x-delivery-limit", "received the value '-1' of type 'byte' but current is none")
    again = other_line(text, OURS_43, (4, 3))
    assert again == {k: v for k, v in OURS_43.items() if k != "x-delivery-limit"}


def test_a_queue_name_with_colons_and_quotes_is_read_too() -> None:
    text = _error("x-delivery-limit", "received the value '-1' of type 'byte' but current is none")
    text = text.replace("queue 'q'", "queue 'host:5672 it''s: received'")
    assert other_line(text, OURS_43, (4, 3)) == {
        k: v for k, v in OURS_43.items() if k != "x-delivery-limit"
    }


def test_our_value_that_the_queue_has_is_added() -> None:
    text = _error(
        "x-consumer-disconnected-timeout",
        "received none but current is the value '10000' of type 'short'",
    )
    older = quorum_arguments((4, 0), lock_delay_ms=None)
    assert other_line(text, older, (4, 0), 6000) == {
        **older,
        "x-consumer-disconnected-timeout": 10000,
    }


def test_another_clients_longer_lock_delay_is_taken_as_it_is() -> None:
    text = _error(
        "x-consumer-disconnected-timeout",
        "received the value '10000' of type 'short' but current is the value '30000' of "
        "type 'short'",
    )
    assert other_line(text, OURS_43, (4, 3), 6000) == {
        **OURS_43,
        "x-consumer-disconnected-timeout": 30000,
    }
    assert short_delay(text, 6000) is None


def test_a_lock_delay_below_the_holders_bound_is_refused() -> None:
    """1 s (what earlier versions gave) lets the majority grant a cut-off holder's lock
    before its guard tells it (quorum_timeout 5 s): never adopted for a lock queue."""
    text = _error(
        "x-consumer-disconnected-timeout",
        "received the value '10000' of type 'short' but current is the value '1000' of "
        "type 'short'",
    )
    assert other_line(text, OURS_43, (4, 3), 6000) is None
    assert short_delay(text, 6000) == 1000
    # A fence or ledger queue carries no lock: any delay is taken.
    assert other_line(text, OURS_43, (4, 3), 0) == {
        **OURS_43,
        "x-consumer-disconnected-timeout": 1000,
    }


def test_delivery_limit_minus_one_is_not_taken_on_3x() -> None:
    """3.x reads ``x-delivery-limit: -1`` as "drop at the first return": never adopt it."""
    text = _error("x-delivery-limit", "received none but current is the value '-1' of type 'byte'")
    assert other_line(text, {"x-queue-type": "quorum"}, (4, 0)) is not None
    assert other_line(text, {"x-queue-type": "quorum"}, (3, 10)) is None


@pytest.mark.parametrize(
    ("arg", "diff"),
    [
        ("x-delivery-limit", "received '-1' but current is '5'"),  # someone else's value
        ("x-consumer-timeout", "received none but current is the value '5' of type 'byte'"),
        ("x-queue-type", "received 'quorum' but current is 'classic'"),  # not line-dependent
        ("x-max-length", "received none but current is the value '1' of type 'byte'"),
    ],
)
def test_any_other_difference_is_not_ours(arg: str, diff: str) -> None:
    assert other_line(_error(arg, diff), OURS_43, (4, 3)) is None


def test_the_warning_names_what_is_missing_and_the_policy() -> None:
    text = other_line_warning("t.semaphore", OURS_43, {"x-queue-type": "quorum"})
    assert "'t.semaphore'" in text and "without x-delivery-limit" in text
    assert '"delivery-limit": -1' in text and '"consumer-disconnected-timeout": 10000' in text
    assert "Upgrading RabbitMQ" in text
    older = quorum_arguments((4, 0), lock_delay_ms=None)
    assert other_line_warning("t.semaphore", older, OURS_43) == ""


# --- on the broker under test -----------------------------------------------------------

#: The lines whose token-queue declarations differ: what each would have declared.
LINES = [(3, 10), (3, 12), (4, 0), (4, 2), (4, 3)]
#: From which line the broker compares each argument when a queue is declared again
#: (measured: 3.10.8 and 4.0.5 accept any ``x-consumer-timeout``; 4.0.5 any
#: ``x-consumer-disconnected-timeout``). A difference it does not compare draws no 406,
#: so there is nothing to adapt and no note.
COMPARED_FROM = {
    "x-delivery-limit": (3, 0),
    "x-consumer-timeout": (4, 3),
    "x-consumer-disconnected-timeout": (4, 3),
}


def _token_args(version: tuple[int, int]) -> dict[str, Any]:
    return {
        **quorum_arguments(version, lock_delay_ms=CONSUMER_DISCONNECTED_TIMEOUT_MS),
        **consumer_timeout_arguments(version, quorum=True),
    }


def _declare(url: str, queue: str, arguments: dict[str, Any]) -> None:
    async def go() -> None:
        conn = await aiormq.connect(url)
        try:
            await (await conn.channel()).queue_declare(queue, durable=True, arguments=arguments)
        finally:
            await conn.close()

    asyncio.run(go())


def _released(ts: TokenSemaphore) -> Callable[[], Any]:
    """A poll of `ts`'s status: the status once no permit is held, else None."""

    def read() -> Any:
        status = ts.status()
        return status if status.held == 0 else None

    return read


def test_a_token_queue_from_another_line_is_set_up_and_used(
    broker: Broker, amqp_url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every other line's declaration of a quorum token queue (as an upgrade leaves it):
    setup, acquire and release work on it, with a WARNING naming what it lacks. On 3.x a
    queue with ``x-delivery-limit: -1`` (a 4.x client's) is refused: 3.x would drop every
    token at its first return."""
    here = broker.core.run(_version(broker))
    ours = _token_args(here)
    tried = 0
    for line in LINES:
        theirs = _token_args(line)
        if theirs == ours:
            continue
        tried += 1
        lock = f"{name}-{line[0]}{line[1]}"
        _declare(amqp_url, token_queue(lock), theirs)
        ts = TokenSemaphore(broker, lock, quorum=True)
        if here < (4, 0) and "x-delivery-limit" in theirs:
            with pytest.raises(PreconditionFailed, match="x-delivery-limit"):
                ts.setup(2)
            _delete(amqp_url, token_queue(lock))
            continue
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="amqp_locks.transport"):
            assert ts.setup(2) == 2
        records = [r for r in caplog.records if token_queue(lock) in r.getMessage()]
        notes = [r.getMessage() for r in records]
        compared = [a for a, since in COMPARED_FROM.items() if here >= since]
        lacks = [a for a in compared if a in ours and a not in theirs]
        extra = [a for a in compared if a in theirs and a not in ours]
        if lacks:  # one WARNING naming each, and the policy
            assert len(notes) == 1 and records[0].levelno == logging.WARNING, notes
            assert all(a in notes[0] for a in lacks) and "policy" in notes[0], (line, notes)
        else:
            assert [r.levelno for r in records] == ([logging.INFO] if extra else []), (line, notes)
        permits = [ts.acquire(timeout=5) for _ in range(2)]
        assert all(permits) and ts.acquire(blocking=False) is None
        for permit in permits:
            assert permit is not None
            # Confirmed: a plain release returns before the broker has the token back.
            # A quorum queue applies the return a Raft commit after the answer, so the
            # status read converges (docs/operations.md, "Releasing and closing").
            permit.release(wait=True)
        status = wait_until(_released(ts), 10, f"both tokens back ({line})")
        assert (status.permits, status.held) == (2, 0), (line, status)
        ts.destroy()
    assert tried >= 3


def test_a_queue_with_another_delivery_limit_is_still_refused(
    broker: Broker, amqp_url: str, name: str
) -> None:
    """Not a queue amqp-locks made: the error names the argument, nothing is adopted."""
    _declare(amqp_url, token_queue(name), {"x-queue-type": "quorum", "x-delivery-limit": 5})
    try:
        with pytest.raises(PreconditionFailed, match="x-delivery-limit") as caught:
            TokenSemaphore(broker, name, quorum=True).setup(1)
        assert token_queue(name) in str(caught.value)
    finally:
        _delete(amqp_url, token_queue(name))


async def _version(broker: Broker) -> tuple[int, int]:
    return broker_version(await broker.core.session())


def _delete(url: str, queue: str) -> None:
    async def go() -> None:
        conn = await aiormq.connect(url)
        try:
            await (await conn.channel()).queue_delete(queue)
        finally:
            await conn.close()

    asyncio.run(go())


def test_a_cluster_waiter_subscribes_to_helper_queues_of_another_line(
    amqp_url: str, name: str
) -> None:
    """Cluster mode's wake-up and sentinel queues are quorum queues every waiter declares:
    made under another line (a rolling upgrade), a waiter still consumes them rather than
    falling back to polling. On 3.x, one a 4.x client made (``x-delivery-limit: -1``) is
    refused, and the waiter polls."""
    wakeups, sentinels = wakeup_queue(name, "mutex"), sentinel_queue(name, "mutex")
    with Broker(amqp_url, cluster=True) as broker:

        async def subscribed() -> tuple[tuple[int, int], bool]:
            session = await broker.core.session()
            async with subscribe(session, wakeups, sentinels) as waiter:
                return session.version, waiter.ready

        here = broker.core.run(_version(broker))
        other = (4, 0) if here < (4, 0) else (3, 13)
        theirs = {**quorum_arguments(other, lock_delay_ms=None), "x-expires": 600_000}
        _declare(amqp_url, wakeups, {**theirs, "x-message-ttl": NOTICE_TTL_MS})
        _declare(amqp_url, sentinels, theirs)
        try:
            version, ready = broker.core.run(subscribed())
            assert version == here
            assert ready is (here >= (4, 0)), (here, theirs)
        finally:
            for queue in (wakeups, sentinels):
                _delete(amqp_url, queue)
