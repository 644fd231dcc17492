"""A release whose wake-up notice meets the wake-up queue in the instant of its delete.

On RabbitMQ 4.2+ such a publish closes the publisher's connection (506 "failed to deliver
message: {not_found, ...}", docs/protocol.md). A mutex or persistent-semaphore release
sends its notice after the held queue's delete on the same channel, so that close proves
the delete was handled: the release is confirmed, not reported unconfirmed. The race
itself cannot be made to happen on demand (one in about 80 CI runs); these tests give the
release the session a real one left behind (its reason is the text stop 54's CI logged,
pretty-printed as the broker writes it) and check what the release concludes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from amqp_locks.errors import ConnectionLost, ReleaseUnconfirmed
from amqp_locks.queue_lease import LeaseState
from amqp_locks.transport.errors import undelivered_to


def _race(queue: str) -> str:
    """A session's lost reason after the 506, as RabbitMQ 4.3.6 wrote it."""
    return (
        "connection closed: RESOURCE_ERROR - failed to deliver message: {not_found,\n"
        '                               {resource,<<"/">>,queue,\n'
        f'                                   <<"{queue}">>}}}}'
    )


class _DeadSession:
    """What a release reads of a session whose connection the broker closed while
    `delete_and_notify` waited for the notice's confirm."""

    def __init__(self, reason: str, told: bool = True) -> None:
        self.alive = False
        #: `told`: the session heard the close before the call raised (else only the
        #: call's error carries the broker's text).
        self.lost_reason = reason if told else None
        self.reason = reason
        self.held = {"job-mutex"}
        self.leases: set[Any] = set()
        self.slot_hints: dict[str, int] = {}
        self.released_at: dict[str, Any] = {}
        self.deleted: list[str] = []

    def remove_listener(self, _key: int) -> None:
        pass

    async def delete_and_notify(self, queue: str, notice: str, slot: int) -> bool:
        self.deleted.append(queue)
        self.alive = False  # the broker's close came while we awaited the confirm
        raise ConnectionLost(f"connection to the broker lost: {self.reason}")


def _lease(session: _DeadSession) -> LeaseState:
    lease = LeaseState(
        core=None,  # type: ignore[arg-type]  # a release does not touch the core
        session=session,  # type: ignore[arg-type]
        kind="mutex",
        name="job",
        number=0,
        held_queue="job-mutex",
        watch_queues=(),
        must_exist=(),
        notice_key="job-mutex-wakeups",
    )
    session.alive = True  # alive when the release begins
    return lease


def test_the_broker_text_names_the_queue() -> None:
    assert undelivered_to(_race("job-mutex-wakeups")) == "job-mutex-wakeups"
    assert undelivered_to(_race("caf\u00e9-sem-wakeups").replace('">>', '"/utf8>>')) == (
        "caf\u00e9-sem-wakeups"
    )
    cut = _race("job-mutex-wakeups")[:-12]  # RabbitMQ cuts a long reply text
    assert undelivered_to(cut) is None
    assert undelivered_to("connection closed: CONNECTION_FORCED - broker forced") is None


@pytest.mark.parametrize("told", [True, False])
def test_a_notice_meeting_its_wakeup_queue_being_deleted_still_confirms_the_release(
    told: bool,
) -> None:
    session = _DeadSession(_race("job-mutex-wakeups"), told)
    lease = _lease(session)
    asyncio.run(lease.release_confirmed())
    assert session.deleted == ["job-mutex"]
    assert lease.release_failure is None
    assert lease.released and "job-mutex" not in session.held


@pytest.mark.parametrize(
    "reason",
    [
        _race("other-mutex-wakeups"),  # another lock's notice: our delete may not be done
        "connection closed: CONNECTION_FORCED - broker forced connection closure",
    ],
)
def test_any_other_end_under_the_release_leaves_it_unconfirmed(reason: str) -> None:
    session = _DeadSession(reason)
    lease = _lease(session)
    with pytest.raises(ReleaseUnconfirmed, match="connection ended during it"):
        asyncio.run(lease.release_confirmed())
