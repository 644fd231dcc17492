"""Several node URLs: parsing, connecting to the first node that answers, naming every
node when none does, and the asyncio facade taking the same URLs."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from amqp_locks import Broker, ClusterUnreachable, ConfigurationError, Mutex, aio
from amqp_locks.transport.urls import resolve_urls
from amqp_locks_dev import devcluster


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_url_lists_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = "amqp://u:p@127.0.0.1:1/%2F", "amqp://u:p@127.0.0.1:2/%2F"
    assert [u.port for u in resolve_urls(f"{a}, {b}")] == [1, 2]
    assert [u.port for u in resolve_urls([a, b])] == [1, 2]
    monkeypatch.setenv("AMQP_URL", f"{a},{b}")
    assert [u.port for u in resolve_urls(None)] == [1, 2]
    for bad in (f"{a},", [], [a, "http://x"]):
        with pytest.raises(ConfigurationError):
            resolve_urls(bad)


def test_first_node_that_answers(cluster: devcluster.ClusterInfo, name: str) -> None:
    dead = f"amqp://guest:guest@127.0.0.1:{_dead_port()}/%2F"
    with Broker([dead, cluster.urls[1]], connect_timeout=5) as b:
        assert b.cluster  # several URLs: cluster mode
        lease = Mutex(b, name).acquire(timeout=10)
        assert lease is not None and str(cluster.node(2).amqp_port) in b.url
        lease.release()


def test_no_node_reachable_names_them_all() -> None:
    ports = [_dead_port(), _dead_port()]
    urls = [f"amqp://guest:secret@127.0.0.1:{p}/%2F" for p in ports]
    with Broker(urls, connect_timeout=5) as b, pytest.raises(ClusterUnreachable) as info:
        b.connect()
    assert all(str(p) in str(info.value) for p in ports)
    assert "secret" not in str(info.value)
    assert len(info.value.failures) == 2


def test_aio_broker_takes_the_same_urls(cluster: devcluster.ClusterInfo, name: str) -> None:
    async def go() -> None:
        async with aio.Broker(cluster.url, heartbeat=5) as b:
            assert len(b.urls) == 3
            async with aio.Mutex(b, name).acquire(timeout=10) as lease:
                assert lease.fencing_token >= 1

    asyncio.run(go())


def test_a_waiter_that_reaches_no_node_keeps_trying_until_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Waiters never fail because a node died: a blocking acquire in cluster mode that
    reaches no node tries the nodes again until its own deadline, then raises."""
    urls = [f"amqp://guest:guest@127.0.0.1:{_dead_port()}/%2F" for _ in range(2)]
    caplog.set_level(logging.INFO, logger="amqp_locks.transport")
    with Broker(urls, connect_timeout=1) as b:
        started = time.monotonic()
        with pytest.raises(ClusterUnreachable):
            Mutex(b, "nobody-home").acquire(timeout=2.5)
        assert time.monotonic() - started >= 2.5
        tries = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(tries) >= 4, "it gave up after one round"
        with pytest.raises(ClusterUnreachable):  # not blocking: one round, then the error
            Mutex(b, "nobody-home").acquire(blocking=False)
