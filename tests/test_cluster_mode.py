"""Cluster mode's construction-time rules (no broker needed: nothing connects)."""

from __future__ import annotations

import pytest

from amqp_locks import (
    Broker,
    NotReplicated,
    ReadWriteLock,
    SemaphoreAdmin,
    TokenAdmin,
    TokenSemaphore,
    aio,
)

URLS = ["amqp://guest:guest@127.0.0.1:1/", "amqp://guest:guest@127.0.0.1:2/"]


@pytest.mark.parametrize(
    "make",
    [
        lambda b: TokenSemaphore(b, "n", quorum=False),
        lambda b: TokenAdmin(b, "n", quorum=False),
        lambda b: ReadWriteLock(b, "n", quorum=False),
        lambda b: SemaphoreAdmin(b, "n", quorum=False),
    ],
)
def test_classic_queues_are_refused_in_cluster_mode(make: object) -> None:
    b = Broker(URLS)
    assert b.cluster
    with pytest.raises(NotReplicated, match="cluster mode"):
        make(b)  # type: ignore[operator]
    b.close()


def test_quorum_is_the_default_in_cluster_mode_only() -> None:
    cluster, single = Broker(URLS), Broker(URLS[0])
    assert TokenSemaphore(cluster, "n").quorum is True
    assert ReadWriteLock(cluster, "n").quorum is True
    assert SemaphoreAdmin(cluster, "n")._ops.quorum is True
    assert TokenSemaphore(single, "n").quorum is False
    assert ReadWriteLock(single, "n").quorum is False
    assert TokenSemaphore(single, "n", quorum=True).quorum is True
    assert TokenSemaphore(Broker(URLS[0], cluster=True), "n").quorum is True
    cluster.close()
    single.close()


def test_aio_token_semaphore_follows_the_same_rule() -> None:
    b = aio.Broker(URLS)
    assert aio.TokenSemaphore(b, "n").admin._ops.quorum is True
    with pytest.raises(NotReplicated):
        aio.TokenSemaphore(b, "n", quorum=False)
