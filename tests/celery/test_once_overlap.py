"""A call of a `once` key binding to its claim while the claim is being deleted (another
call's end removing the last binding). RabbitMQ 4.3 on Khepri checks a bind's source
before the write that adds it, so such a bind is accepted with no claim left, and the
binding left under the name makes every later declare of the claim close its connection
(541 INTERNAL_ERROR) until an operator deletes the name. The worker never lets two calls of
a key overlap so (it unbinds before it releases the run mutex: CI of stop 54 met the
overlap in `test_once.py::test_two_calls_of_a_key_on_one_connection`); these tests force
the overlap to show the check names it, and that the documented repair works."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from amqp_locks import Broker
from amqp_locks.celery import ClaimLost
from amqp_locks.celery import once as claims
from amqp_locks_dev import devbroker

ROUNDS = 12


def on_khepri(node: devbroker.NodeInfo) -> bool:
    """Whether the node keeps its metadata in Khepri (4.3's default; not 3.10 or 4.0)."""
    try:
        out = devbroker.rabbitmqctl(node, "eval", "rabbit_khepri:is_enabled().")
    except devbroker.DevBrokerError:  # 3.10: no such module
        return False
    return out.strip() == "true"


def repair(node: devbroker.NodeInfo, exchange: str) -> None:
    """The operator's repair docs/celery.md gives (vhost "/")."""
    out = devbroker.rabbitmqctl(
        node, "eval", f'rabbit_khepri:delete([rabbitmq,vhosts,<<"/">>,exchanges,<<"{exchange}">>]).'
    )
    assert out.strip() == "ok", out


def overlap(broker: Broker, first: claims.Mark, second: claims.Mark) -> BaseException | None:
    """`first` ends while `second` starts, both sent in one turn of the I/O loop; the
    error `second`'s start raised, if any."""

    async def both() -> list[object]:
        return await asyncio.gather(first._end(False), second._start(False), return_exceptions=True)

    ended, started = broker.core.run(both())
    assert ended is None, ended
    return started if isinstance(started, BaseException) else None


@pytest.mark.parametrize("comes_back", [False, True], ids=["alive-queue", "keeper"])
def test_a_bind_overlapping_the_claims_deletion_is_named(
    broker: Broker, node: devbroker.NodeInfo, comes_back: bool
) -> None:
    """Each round: call 1 claimed and bound; call 1 ends as call 2 starts. Either call 2
    holds the key (busy; free after its end), or its start raised ClaimLost, which only
    a Khepri broker may cause; the documented repair then makes the name claimable."""
    khepri = on_khepri(node)
    lost: list[str] = []
    for r in range(ROUNDS):
        name = f"overlap-{uuid.uuid4().hex[:12]}"

        def mark(n: int, name: str = name) -> claims.Mark:
            return claims.Mark(broker, name, f"{name}-{n}", comes_back=comes_back)

        assert claims.claim(broker, name)
        first, second = mark(1), mark(2)
        first.start(False)
        error = overlap(broker, first, second)
        if error is not None:
            assert isinstance(error, ClaimLost), repr(error)
            assert claims.claim_exchange(name) in str(error)
            assert khepri, f"round {r}: {error} on a broker without Khepri"
            assert not claims.busy(broker, name)
            lost.append(name)
            continue
        assert claims.busy(broker, name), f"round {r}: the key reads free while call 2 runs"
        second.end(False)
        assert not claims.busy(broker, name), f"round {r}: call 2's end left the key busy"
    for name in lost:
        repair(node, claims.claim_exchange(name))
        assert claims.claim(broker, name), f"{name}: not claimable after the repair"
        third = claims.Mark(broker, name, f"{name}-3", comes_back=comes_back)
        third.start(False)
        third.end(False)
        assert not claims.busy(broker, name)
    print(f"{ROUNDS} forced overlaps (khepri={khepri}): claim lost and repaired {len(lost)}")
