"""`transport.absent.while_absent`: a declaration the broker answered 404 "absent" (its
record caught half written by a concurrent creation) is asked again, within a bound.

Pure logic, so the declaration is a stand-in; the race itself is met on a real broker by
tests/test_fresh_names.py's racers (4 clients on 20 fresh names, every one granted)."""

from __future__ import annotations

import asyncio
import time

import pytest

from amqp_locks.errors import PreconditionFailed, QueueNotFound
from amqp_locks.transport import absent
from amqp_locks.transport.absent import while_absent

ABSENT = (
    "404 NOT_FOUND (queue 'q'): home node 'n@h' of durable queue 'q' in vhost '/' "
    "is down or inaccessible"
)


class Declaration:
    """Answers 404 for its first `absent` calls, then "declared" (or raises `then`)."""

    def __init__(self, absent: int, then: BaseException | None = None) -> None:
        self.absent = absent
        self.then = then
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.absent:
            raise QueueNotFound(ABSENT, "q")
        if self.then is not None:
            raise self.then
        return "declared"


def test_a_declaration_caught_absent_is_asked_again_until_it_answers() -> None:
    declaration = Declaration(absent=3)
    assert asyncio.run(while_absent("q", declaration)) == "declared"
    assert declaration.calls == 4


def test_an_answer_at_once_is_one_call() -> None:
    declaration = Declaration(absent=0)
    assert asyncio.run(while_absent("q", declaration)) == "declared"
    assert declaration.calls == 1


def test_another_refusal_is_not_asked_again() -> None:
    """A 406 (the test-and-set's loser, another shape) is the caller's to read, at once."""
    refusal = PreconditionFailed("406 PRECONDITION_FAILED (queue 'q'): inequivalent arg", "q")
    declaration = Declaration(absent=1, then=refusal)
    with pytest.raises(PreconditionFailed) as caught:
        asyncio.run(while_absent("q", declaration))
    assert caught.value is refusal
    assert declaration.calls == 2


def test_a_queue_absent_for_good_raises_after_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A home node really down: QueueNotFound naming the queue, once ABSENT_WAIT passed."""
    monkeypatch.setattr(absent, "ABSENT_WAIT", 0.3)
    declaration = Declaration(absent=10**6)
    started = time.monotonic()
    with pytest.raises(QueueNotFound, match="down or inaccessible") as caught:
        asyncio.run(while_absent("q", declaration))
    took = time.monotonic() - started
    assert caught.value.queue == "q"
    assert took >= 0.3, took  # not before the bound (pytest's timeout catches never)
    assert declaration.calls >= 2
