"""`transport.shield.within`, the cut that keeps a timeout: no broker, a round trip that
is never answered is an event nobody sets."""

from __future__ import annotations

import asyncio
import time

import pytest

from amqp_locks.errors import BrokerTimeout
from amqp_locks.transport import shield
from amqp_locks.transport.shield import CUT_GRACE, CUT_SETTLE, shielded, within

T = 0.2
#: Scheduling on a loaded machine (the timers' wake-ups, the GIL) past the promised bound;
#: a hung wait overruns it by far more.
JITTER = 1.0


class Grant:
    """A lock grant whose answer comes when `answer` is set (or never)."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.asked = asyncio.Event()
        self.undone: list[str] = []
        self.was_undone = asyncio.Event()

    async def step(self) -> str:
        self.asked.set()
        await self.answer.wait()
        return "lease"

    async def wait(self) -> str | None:
        # As the acquire loop runs a grant: shielded, its result undone if we are cancelled.
        return await shielded(self.step(), self.undo)

    async def undo(self, lease: str) -> None:
        self.undone.append(lease)
        self.was_undone.set()


def test_a_wait_that_ends_in_time_is_untouched() -> None:
    async def main() -> None:
        grant = Grant()
        grant.answer.set()
        assert await within(grant.wait(), T, grant.undo) == "lease"
        assert await within(asyncio.sleep(0, None), T) is None  # a plain None stays None
        assert grant.undone == []

    asyncio.run(main())


def test_an_unanswered_wait_is_cut_and_a_late_grant_undone() -> None:
    async def main() -> None:
        grant = Grant()
        start = time.monotonic()
        assert await within(grant.wait(), T, grant.undo) is None
        took = time.monotonic() - start
        assert T + CUT_GRACE <= took < T + CUT_GRACE + CUT_SETTLE + JITTER
        assert grant.undone == []  # nothing granted yet
        grant.answer.set()  # the answer arrives after the caller was told None
        await asyncio.wait_for(grant.was_undone.wait(), 5)
        assert grant.undone == ["lease"]

    asyncio.run(main())


def test_a_wait_whose_cancellation_hangs_is_left_behind_within_the_bound() -> None:
    async def main() -> None:
        release = asyncio.Event()
        undone: list[str] = []
        was_undone = asyncio.Event()

        async def stubborn() -> str:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await release.wait()  # its clean-up waits for the broker too
                return "lease"
            return "never"

        async def undo(lease: str) -> None:
            undone.append(lease)
            was_undone.set()

        start = time.monotonic()
        assert await within(stubborn(), T, undo) is None
        assert time.monotonic() - start < T + CUT_GRACE + CUT_SETTLE + JITTER
        assert shield._background  # still running, kept referenced
        release.set()
        await asyncio.wait_for(was_undone.wait(), 5)
        assert undone == ["lease"]

    asyncio.run(main())


def test_a_cut_can_raise_instead() -> None:
    async def main() -> None:
        with pytest.raises(BrokerTimeout):
            await within(Grant().wait(), T, cut=lambda: BrokerTimeout("no answer"))

    asyncio.run(main())


def test_errors_of_a_wait_that_was_not_cut_are_raised() -> None:
    async def fails() -> None:
        raise ValueError("broken")

    with pytest.raises(ValueError):
        asyncio.run(within(fails(), T))


def test_a_cancelled_caller_gets_no_lease_and_the_grant_is_undone() -> None:
    async def main() -> None:
        grant = Grant()
        waiter = asyncio.ensure_future(within(grant.wait(), 10.0, grant.undo))
        await grant.asked.wait()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        grant.answer.set()
        await asyncio.wait_for(grant.was_undone.wait(), 5)
        assert grant.undone == ["lease"]

    asyncio.run(main())
