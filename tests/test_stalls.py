"""A process that did not run for a while (its I/O loop held up past `loss_timeout`: a GIL
held by user code, a starved machine) keeps a lock the broker still gives it: the session's
watchdog puts its judgement off by one step after a late wake and pings at once. A broker
that went silent meanwhile is still told at the next judgement."""

from __future__ import annotations

import time

import pytest

from amqp_locks import Broker, Mutex
from amqp_locks.transport.session import Session

from .conftest import on_session
from .faultproxy import FaultProxy
from .waiting import wait_until

#: Heartbeat (and so `loss_timeout`) of these tests: the broker closes a silent client
#: after 2-3 periods, so a stall of 1.5 periods is past our bound and short of the broker's.
HEARTBEAT = 2.0
STALL = 1.5 * HEARTBEAT


def _hold_the_loop(broker: Broker, seconds: float) -> float:
    """Block the broker's I/O loop for `seconds` (no callback runs); when it ended."""

    async def block(session: Session) -> float:
        time.sleep(seconds)  # noqa: ASYNC251 - the point: the loop itself does not run
        return time.monotonic()

    return on_session(broker, block)


def _session(broker: Broker) -> Session:
    async def get(session: Session) -> Session:
        return session

    return on_session(broker, get)


@pytest.mark.timeout(60)
def test_a_stall_past_loss_timeout_keeps_a_lock_the_broker_still_gives(
    amqp_url: str, name: str
) -> None:
    with Broker(amqp_url, heartbeat=HEARTBEAT) as broker:
        lease = Mutex(broker, name).acquire(timeout=10)
        session = _session(broker)
        ended = _hold_the_loop(broker, STALL)
        # The watchdog's next healthy judgement after the stall: it saw a fresh answer.
        assert wait_until(
            lambda: session.judged_at > ended or lease.lost.is_set(), 10, "a judgement"
        )
        assert lease.lost_reason is None
        assert session.stalls >= 1
        assert session.alive
        # The lock is really still ours: another client cannot take it.
        with Broker(amqp_url) as other:
            assert Mutex(other, name).acquire(blocking=False) is None
        lease.release()


@pytest.mark.timeout(60)
def test_a_stall_while_the_broker_went_silent_is_told_at_the_next_judgement(
    proxy: FaultProxy, name: str
) -> None:
    with Broker(proxy.url(), heartbeat=HEARTBEAT) as broker:
        lease = Mutex(broker, name).acquire(timeout=10)
        session = _session(broker)
        proxy.blackhole()
        _hold_the_loop(broker, STALL)
        assert lease.lost.wait(10), "the lease was not marked lost"
        assert lease.lost_reason is not None
        assert "answered nothing" in lease.lost_reason or "no frame" in lease.lost_reason
        # Put off once, then told: no healthy judgement came after the stall.
        assert session.stalls == 1
        assert session.judged_at < session.stalled_at
