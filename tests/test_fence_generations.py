"""Fence shards (issue 36, cases 3-5, and the crash-point harness for every fence path).

Design-agnostic where the issue's cases are concerned, so that they fail on 71753d0 (one
message per ``amqp-locks-shard-KK-fence``) and pass on generations (fencing.py): a
shard's *counter queues* are whatever queues of shard KK hold its counting message
(``amqp-locks-shard-KK-fence`` then, ``amqp-locks-fence-KK-g<G>`` now); its marker
``amqp-locks-fence-KK`` is not one. Each test resets its lock's shard to "never made"
first (every queue of it deleted), so tests do not see each other's counters.

The crash-point harness runs a path on a connection through a proxy that lets exactly n
client frames with an effect reach the broker (``FaultProxy.cut_after(n,
effects_only=True)``: pings and existence probes change nothing, so are not cut points)
and then resets the connection, for every n from 1 until the path completes uncut (the
path's count of cut points), and asserts that a client
with a normal connection then gets a token within :data:`BOUND` seconds, above every
token of that lock seen before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import aiormq
import pytest
from yarl import URL

from amqp_locks import Broker, Mutex, SemaphoreAdmin, fencing
from amqp_locks.errors import AmqpLocksError, FenceMissing
from amqp_locks.names import (
    FENCE_SHARDS,
    fence_generation,
    fence_marker,
    fence_shard_index,
    fence_tombstone,
)
from amqp_locks.transport.session import Session
from amqp_locks_dev import devbroker

from . import waiting
from .conftest import fence_messages, fence_shard_listed
from .faultproxy import FaultProxy
from .threads import run_together

#: How soon a name grants again after any cut (fencing.HEAL_AFTER is 5 s, plus a few
#: round trips and a queue creation); the issue's ceiling is 30 s.
BOUND = 15.0
_CUTS_SEEN: dict[str, int] = {}
T = TypeVar("T")


def _shard_queues(node: devbroker.NodeInfo, k: int) -> dict[str, int]:
    """Every queue of fence shard `k` (old and new names, tombstones too) -> its ready
    messages, exactly (declare-ok; list_queues' counts of quorum queues lag by seconds)."""
    return _existing(node.url, fence_shard_listed(node, k))


def _existing(url: str, names: list[str]) -> dict[str, int]:
    """Those of `names` that exist -> their ready messages, by passive declares on one
    connection."""

    async def counts() -> dict[str, int]:
        conn = await asyncio.wait_for(aiormq.connect(url), 30)
        found = {}
        try:
            for q in names:
                ch = await conn.channel()
                with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
                    ok = await ch.queue_declare(q, passive=True)
                    found[q] = int(ok.message_count or 0)
                    await ch.close()
        finally:
            await conn.close()
        return found

    # Bounded: a broker that stops answering fails the test instead of hanging it.
    return asyncio.run(asyncio.wait_for(counts(), 30 + 0.05 * len(names)))


def _counter_queues(node: devbroker.NodeInfo, k: int) -> list[str]:
    return sorted(q for q in _shard_queues(node, k) if q != f"amqp-locks-fence-{k:02d}")


#: Generations probed per round trip of :func:`_counters_below`.
WINDOW = 64


def _counters_below(url: str, k: int, top: int) -> list[str]:
    """:func:`_counter_queues` without ``rabbitmqctl`` (seconds each on a loaded node): the
    generations of shard `k` at or below `top` and their tombstones that exist, by passive
    declares on one connection. The generations that exist form one unbroken run
    (fencing.py), so the probes go down from `top` a window at a time and stop at the
    first window with none: a few windows, not one probe per generation since 0 (a shard
    renewed tens of thousands of times took longer than the test's timeout)."""
    found: dict[str, int] = {}
    hi = top
    while hi >= 0:
        lo = max(0, hi - WINDOW + 1)
        window = [
            q for g in range(lo, hi + 1) for q in (fence_generation(k, g), fence_tombstone(k, g))
        ]
        got = _existing(url, window)
        if not got:
            break
        found.update(got)
        hi = lo - 1
    return list(found)


def _generation_of(queue: str) -> int:
    return int(re.findall(r"-g(\d+)", queue)[-1])


def _delete(url: str, queues: list[str]) -> None:
    async def go() -> None:
        conn = await aiormq.connect(url)
        try:
            ch = await conn.channel()
            for q in queues:
                await ch.queue_delete(q)
        finally:
            await conn.close()

    asyncio.run(go())


def _reset_shard(node: devbroker.NodeInfo, url: str, k: int) -> None:
    """Shard `k` as on a broker that never saw it."""
    _delete(url, list(_shard_queues(node, k)))


def _fresh_shard(node: devbroker.NodeInfo, url: str, name: str) -> int:
    """The index of `name`'s fence shard, reset to never seen (:func:`_reset_shard`)."""
    k = fence_shard_index(name)
    _reset_shard(node, url, k)
    return k


def _known(k: int, upto: int = 8) -> list[str]:
    """Shard `k`'s marker, generations 0..`upto` and their tombstones."""
    gens = [q for g in range(upto + 1) for q in (fence_generation(k, g), fence_tombstone(k, g))]
    return [fence_marker(k), *gens]


def _reset_known(url: str, k: int) -> None:
    """Shard `k` as never made, where a test made nothing beyond :func:`_known` since a
    :func:`_reset_shard`: deletes by name (rabbitmqctl starts an Erlang VM per call,
    several seconds each on a loaded machine), then checks by passive declares."""
    _delete(url, _known(k))
    assert _existing(url, _known(k)) == {}


def _run(broker: Broker, make: Callable[[Session], Awaitable[int]]) -> int:
    async def go() -> int:
        return await make(await broker.core.session())

    return broker.core.run(go())


def _take(broker: Broker, name: str, timeout: float = 30.0) -> int:
    from amqp_locks.fencing import take_token

    return _run(broker, lambda s: take_token(s, name, timeout))


@pytest.fixture
def cut_proxy(node: devbroker.NodeInfo) -> Iterator[FaultProxy]:
    url = URL(node.url)
    p = FaultProxy(url.host or "127.0.0.1", url.port or 5672, amqp=True)
    yield p
    p.close()


def _timed_take(url: str, name: str) -> tuple[int, float]:
    """A token through a fresh connection (nothing cached), and how long it took."""
    with Broker(url, heartbeat=10.0) as b:
        t0 = time.monotonic()
        token = _take(b, name, timeout=30.0)
        return token, time.monotonic() - t0


def test_tokens_rise_fit_63_bits_and_stay_above_the_clock_based_release(
    amqp_url: str, broker: Broker, name: str
) -> None:
    tokens = [_take(broker, name) for _ in range(20)]
    with Broker(amqp_url) as other:
        tokens += [_take(other, name) for _ in range(5)]
    tokens += [_take(broker, name) for _ in range(5)]
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    # 71753d0's bases are the clock in µs (about 1.8e15 < 2**51) plus 2**40 per re-base.
    assert tokens[0] > 2**51 and tokens[-1] < 2**63


def test_case3_a_creator_cut_after_any_frame_leaves_a_name_that_grants_again(
    node: devbroker.NodeInfo, amqp_url: str, cut_proxy: FaultProxy, name: str
) -> None:
    """Issue 36 case 3 and the creation path of the harness: the first fenced grant of a
    never-made shard, cut after each frame it sends. On 71753d0 the cut between the
    declaration and the publish left the shard empty: FenceMissing after 30 s, every try."""
    k = _fresh_shard(node, amqp_url, name)
    cuts = _cut_every_frame(
        node,
        amqp_url,
        cut_proxy,
        name,
        # a cut creation and the two takes after it make at most generations 0-2
        setup=lambda: _reset_known(amqp_url, k),
        path=lambda s: _take_path(s, name),
        keep=False,
    )
    _CUTS_SEEN["creation"] = cuts
    assert cuts >= 3
    assert set(_shard_queues(node, k)) <= set(_known(k))  # what each cut's setup deleted


async def _connected(session: Session) -> int:
    return 0


async def _take_path(session: Session, name: str) -> int:
    from amqp_locks.fencing import take_token

    return await take_token(session, name, 30.0)


def _cut_every_frame(
    node: devbroker.NodeInfo,
    url: str,
    proxy: FaultProxy,
    name: str,
    *,
    setup: Callable[[], None],
    path: Callable[[Session], Awaitable[object]],
    warm: bool = False,
    keep: bool = True,
) -> int:
    """Cut `path` after its 1st, 2nd, ... frame until it runs through uncut; after each
    cut a fresh client must get a token within BOUND, above every earlier token of the
    lock in this round. Returns the number of cut points (frames the path sends)."""
    n = 1
    seen: list[int] = []
    while True:
        setup()
        if not keep:
            seen = []  # the shard was reset: a new counter
        proxy.count_frames()  # also lets new connections in after the last cut
        with Broker(proxy.url(), heartbeat=10.0) as cut:
            if warm:
                seen.append(_take(cut, name))  # the connection's first take consumes
            else:
                _run(cut, _connected)
            proxy.cut_after(n, effects_only=True)
            outcome: object = None
            with contextlib.suppress(AmqpLocksError, ConnectionError, OSError, TimeoutError):
                outcome = _run(cut, path)  # type: ignore[arg-type]
            uncut = not proxy.fired
        if isinstance(outcome, int):
            seen.append(outcome)
        for _ in range(2):
            token, took = _timed_take(url, name)
            assert took < BOUND, f"cut after frame {n}: the next token took {took:.1f}s"
            assert not seen or token > max(seen), (n, token, seen)
            seen.append(token)
        if uncut:
            return n - 1
        n += 1
        assert n < 150, "the path never completed"


def test_harness_warm_take_cut_after_each_frame(
    node: devbroker.NodeInfo, amqp_url: str, cut_proxy: FaultProxy, name: str
) -> None:
    """A warm take (probes + basic.get + reject) cut after each frame: the message it held
    comes back with the connection's end, and tokens keep rising."""
    with Broker(amqp_url) as b:
        _take(b, name)
    cuts = _cut_every_frame(
        node,
        amqp_url,
        cut_proxy,
        name,
        setup=lambda: None,
        path=lambda s: _take_path(s, name),
        warm=True,
    )
    _CUTS_SEEN["take"] = cuts
    assert cuts >= 1


def test_harness_renewal_cut_after_each_frame(
    node: devbroker.NodeInfo, amqp_url: str, cut_proxy: FaultProxy, name: str
) -> None:
    """Renewal, rebase and healing all make the next generation (fencing._supersede):
    cut after each frame it sends, the name grants again within BOUND and tokens rise;
    the current generation holds one counter message."""
    from amqp_locks.fencing import _supersede

    k = fence_shard_index(name)
    with Broker(amqp_url) as b:
        _take(b, name)

    async def renew(session: Session) -> int:
        from amqp_locks.fencing import take_token

        await take_token(session, name, 30.0)  # learns the current generation
        await _supersede(session, k, session.fence_gens[k])
        return 0

    cuts = _cut_every_frame(
        node, amqp_url, cut_proxy, name, setup=lambda: None, path=renew, warm=True
    )
    _CUTS_SEEN["renewal"] = cuts
    with Broker(amqp_url) as b:
        assert fence_messages(b, name) == 1
    assert cuts >= 3


def test_harness_repair_cut_after_each_frame(
    node: devbroker.NodeInfo, amqp_url: str, cut_proxy: FaultProxy, name: str
) -> None:
    """A rebuild from an operator's floor, cut after each frame: the name then either
    grants (above the floor) or still refuses typed until the repair is run again; never
    a token at or below the floor."""
    from amqp_locks.fencing import repair_fence

    k = fence_shard_index(name)
    floor = 0
    n = 1
    counters = _counter_queues(node, k)
    while True:
        with Broker(amqp_url) as b:
            floor = max(floor, _take(b, name), _take(b, name))
        # Each round makes a generation or two above the last: found by probes near it.
        top = max((_generation_of(q) for q in counters), default=0) + 16
        counters = _counters_below(amqp_url, k, top)
        assert counters and max(map(_generation_of, counters)) < top - 4, (counters, top)
        _delete(amqp_url, counters)  # an operator deletes the counter
        cut_proxy.count_frames()  # also lets new connections in after the last cut
        with Broker(cut_proxy.url(), heartbeat=10.0) as cut:
            _run(cut, _connected)
            # The marker's hints are read by gets returned on close: reads, not cut points.
            cut_proxy.cut_after(n, effects_only=True, reads=[fence_marker(k)])
            with contextlib.suppress(AmqpLocksError, ConnectionError, OSError, TimeoutError):
                _run(cut, lambda s, f=floor: repair_fence(s, name, f))  # type: ignore[misc]
            uncut = not cut_proxy.fired
        try:
            token, took = _timed_take(amqp_url, name)
        except FenceMissing:
            with Broker(amqp_url) as b:
                assert SemaphoreAdmin(b, name).repair_fence(floor) is True
            token, took = _timed_take(amqp_url, name)
        assert took < BOUND and token > floor, (n, token, floor, took)
        if uncut:
            break
        n += 1
        assert n < 150
    _CUTS_SEEN["repair"] = n - 1


def test_case4_a_deleted_counter_never_restarts_from_a_clock_behind(
    node: devbroker.NodeInfo, amqp_url: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 case 4: the shard's counter deleted by hand and the next grant made by a
    process whose clock is 10 minutes behind. On 71753d0 the shard was made again with
    the clock as base: the next token was lower. Now grants refuse typed (no advice to
    delete anything) until an operator rebuilds from a floor, and then rise above it."""
    k = _fresh_shard(node, amqp_url, name)
    with Broker(amqp_url) as b:
        before = [_take(b, name) for _ in range(3)]
    _delete(amqp_url, _counter_queues(node, k))
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 600 * 10**9)
    with Broker(amqp_url) as b:
        try:
            token = _take(b, name, timeout=10.0)
        except FenceMissing as exc:
            text = str(exc)
            assert "repair" in text and not re.search(r"delete (a|the) (fence )?shard", text)
            assert SemaphoreAdmin(b, name).repair_fence(max(before)) is True
            assert SemaphoreAdmin(b, name).repair_fence(max(before)) is False  # one counter
            token = _take(b, name)
        assert token > max(before), (token, before)


def test_case5_a_frozen_taker_and_repair_never_make_tokens_go_back(
    node: devbroker.NodeInfo, amqp_url: str, broker: Broker, name: str
) -> None:
    """Issue 36 case 5: a frozen taker holds the counter message unacked; another grant
    must still get a token (71753d0: FenceMissing after 30 s), repair_fence must not put
    a second counter (71753d0 did), and when the frozen taker's connection ends the
    tokens of one lock keep rising (71753d0: ...376, ...383, ...377, ...384)."""
    k = _fresh_shard(node, amqp_url, name)
    first = _take(broker, name)
    held = _shard_queues(node, k)
    [counter] = [q for q in _counter_queues(node, k) if held[q] == 1]

    async def freeze() -> tuple[aiormq.abc.AbstractConnection, int]:
        conn = await aiormq.connect(amqp_url)
        ch = await conn.channel()
        got = await ch.basic_get(counter, no_ack=False)
        assert got.delivery_tag is not None
        return conn, 0

    loop = asyncio.new_event_loop()
    try:
        frozen, _ = loop.run_until_complete(freeze())
        t0 = time.monotonic()
        tokens = [first, _take(broker, name, timeout=30.0)]
        assert time.monotonic() - t0 < BOUND
        with Broker(amqp_url) as other:
            SemaphoreAdmin(other, name).repair_fence(tokens[-1])
            tokens.append(_take(other, name))
        loop.run_until_complete(frozen.close())
    finally:
        loop.close()
    with Broker(amqp_url) as other:
        for _ in range(6):
            tokens.append(_take(broker, name))
            tokens.append(_take(other, name))
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    assert fence_messages(broker, name) == 1


def test_zz_report_cut_points() -> None:
    """Prints the cut points per path the harness ran (pytest -s shows them)."""
    print("fence crash points per path:", _CUTS_SEEN)
    assert FENCE_SHARDS == 16


def test_a_stale_renewer_or_creator_cannot_make_a_deleted_generation_again(
    amqp_url: str, node: devbroker.NodeInfo, name: str
) -> None:
    """A renewer that froze before its write (it saw generation g, which has since been
    superseded twice and deleted) and a first creator that slept through the shard's
    life both send their writes late: neither makes a generation, and tokens keep rising."""
    from amqp_locks.fencing import _genesis, _retire, _supersede
    from amqp_locks.names import fence_generation

    k = _fresh_shard(node, amqp_url, name)
    with Broker(amqp_url) as b:
        before = _take(b, name)  # generation 0

        async def advance(s: Session) -> int:
            await _supersede(s, k, 0)  # makes 1
            await _supersede(s, k, 1)  # makes 2
            _aged(s, k, 0)
            _aged(s, k, 1)
            await _retire(s, k, 1)  # deletes 0 and 1 (as RETIRE_AFTER later would)
            return 0

        _run(b, advance)

        async def stale(s: Session) -> int:
            await _supersede(s, k, 0)  # the frozen renewer of generation 0 wakes up
            return int(await _genesis(s, k, 0))  # the frozen first creator wakes up

        assert _run(b, stale) == 0
        gone = [fence_generation(k, 0), fence_generation(k, 1)]
        assert not any(q in _shard_queues(node, k) for q in gone)
        after = [_take(b, name) for _ in range(3)]
    with Broker(amqp_url) as fresh:  # nothing cached: finds generation 2
        after.append(_take(fresh, name))
    assert all(a < b for a, b in itertools.pairwise([before, *after])), (before, after)
    assert after[0] > shard_token_of(2)


def shard_token_of(g: int) -> int:
    from amqp_locks.fencing import shard_token

    return shard_token(g, 0) - 1


def test_the_current_generation_deleted_right_after_a_renewal_refuses_typed(
    amqp_url: str, node: devbroker.NodeInfo, name: str
) -> None:
    """An operator deletes the current generation while the previous one still exists
    (within RETIRE_AFTER of a renewal): the previous one is tombstoned, so grants raise
    FenceMissing instead of counting on it again (lower), until a rebuild from the floor."""
    from amqp_locks.fencing import _supersede
    from amqp_locks.names import fence_generation

    k = _fresh_shard(node, amqp_url, name)
    with Broker(amqp_url) as b:
        tokens = [_take(b, name) for _ in range(3)]
        _run(b, lambda s: _supersede(s, k, 0))  # type: ignore[arg-type, return-value]
        tokens.append(_take(b, name))  # from generation 1
        # Not retired yet (RETIRE_AFTER): asked by a passive declare, at once (listing the
        # queues with rabbitmqctl took past RETIRE_AFTER on a loaded CI lane).
        _run(b, lambda s: s.declare_passive_counts(fence_generation(k, 0)))  # type: ignore[arg-type, return-value]
    _delete(amqp_url, [fence_generation(k, 1)])
    with Broker(amqp_url) as fresh:
        with pytest.raises(FenceMissing, match="repair"):
            _take(fresh, name, timeout=10.0)
        assert SemaphoreAdmin(fresh, name).repair_fence(max(tokens)) is True
        after = [_take(fresh, name) for _ in range(2)]
    assert min(after) > max(tokens) and after[0] < after[1]


def _renew_until(
    broker: Broker, k: int, stop: float, pause: float, failures: list[BaseException], out: list[int]
) -> None:
    """Renew shard `k` (make its next generation; the old one is retired RETIRE_AFTER
    later) every `pause` seconds until monotonic time `stop`, on a thread: each renewed
    generation into `out`, an error into `failures`."""

    async def renew(session: Session) -> int:
        g = session.fence_gens[k]
        await fencing._supersede(session, k, g)
        return g

    try:
        while time.monotonic() < stop:
            out.append(_run(broker, renew))
            time.sleep(pause)
    except BaseException as exc:
        failures.append(exc)


def test_fresh_clients_never_see_a_counter_gone_while_it_is_renewed(
    node: devbroker.NodeInfo, amqp_url: str, broker: Broker, name: str
) -> None:
    """A client with no generation cached finds the current one while others renew the
    shard (CI on 3.10.8 once saw ``the fencing counter of shard 15 is gone`` in a CLI run of
    20 processes): its narrow scan can see generation G, then G's tombstone, written after
    G+1 in the same creation write, before the marker holds G+1's hint. It must look
    above G, never report the counter gone."""

    k = _fresh_shard(node, amqp_url, name)
    first = _take(broker, name)
    stop = time.monotonic() + 12.0
    failures: list[BaseException] = []
    seen: list[int] = []

    def fresh_client() -> None:
        while time.monotonic() < stop:
            try:
                with Broker(amqp_url) as b:
                    seen.append(_take(b, name, timeout=20.0))
            except BaseException as exc:
                failures.append(exc)

    import threading

    # a renewal a second (in use: one per 4,096 takes)
    threads = [threading.Thread(target=_renew_until, args=(broker, k, stop, 1.0, failures, []))]
    threads += [threading.Thread(target=fresh_client) for _ in range(6)]
    run_together(threads, 60)
    assert not failures, failures[:2]
    assert seen and min(seen) > first


def test_warm_cluster_takes_beside_renewals_and_retires_keep_their_connection(
    node: devbroker.NodeInfo,
    amqp_url: str,
    broker: Broker,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster-mode take writes its probes and its consume at once when its process saw
    the generation current less than STALE_AFTER ago (fencing._look_pushed): none it may
    consume can then be being deleted (RabbitMQ closes the whole connection, 541, of a
    client reading a quorum queue while it is deleted). Takers pausing for random times
    on both sides of STALE_AFTER, beside a renewal every 0.2 s whose generations are
    retired RETIRE_AFTER later (shortened fourfold, so deletes run all through; STALE_AFTER
    tenfold): every taker keeps its connection, its tokens rise, and both kinds of take were
    made (in one write while fresh; after a pause, the generation asked again first).
    A consume written within STALE_AFTER of a look that found its generation current meets
    a delete only if the broker reads it RETIRE_AFTER - STALE_AFTER later (5 s in the
    library). With 0.5 s here (1.0 and 0.5), CI on 3.10.8 with four lanes busy once saw
    the 541 this test forbids; 2.0 s leaves a loaded machine room."""
    import random
    import threading

    from amqp_locks import fencing

    monkeypatch.setattr(fencing, "RETIRE_AFTER", 2.5)
    monkeypatch.setattr(fencing, "STALE_AFTER", 0.5)
    at_once = 0
    probe_at_once = fencing.bulk_probe

    async def counted(ch: Any, queues: Any) -> list[bool]:
        nonlocal at_once
        at_once += 1  # cluster-mode takers never basic.get: each call is a take at once
        return await probe_at_once(ch, queues)

    monkeypatch.setattr(fencing, "bulk_probe", counted)
    rechecked = 0
    recheck = fencing._recheck

    async def counted_recheck(*args: Any) -> int:
        nonlocal rechecked
        rechecked += 1  # a take after a pause past STALE_AFTER: its generation asked again
        return await recheck(*args)

    monkeypatch.setattr(fencing, "_recheck", counted_recheck)
    k = _fresh_shard(node, amqp_url, name)
    first = _take(broker, name)
    stop = time.monotonic() + 15.0
    failures: list[BaseException] = []
    takes: list[int] = []
    renewals: list[int] = []

    def taker(seed: int) -> None:
        pauses = random.Random(seed)
        try:
            with Broker(amqp_url, cluster=True) as b:
                session = b.core.run(b.core.session())
                last = first
                while time.monotonic() < stop:
                    token = _take(b, name, timeout=20.0)
                    assert token > last, (token, last)
                    last = token
                    takes.append(token)
                    time.sleep(pauses.uniform(0.0, 1.0))  # half of them past STALE_AFTER
                assert b.core.run(b.core.session()) is session and session.alive
        except BaseException as exc:
            failures.append(exc)

    renewer = threading.Thread(target=_renew_until, args=(broker, k, stop, 0.2, failures, renewals))
    threads = [renewer] + [threading.Thread(target=taker, args=(i,)) for i in range(4)]
    run_together(threads, 90)
    assert not failures, failures[:2]
    assert len(renewals) >= 10, renewals
    assert len(takes) >= 20, takes
    assert _existing(amqp_url, [fence_generation(k, renewals[0])]) == {}  # retired meanwhile
    # Takes in one write, and takes after a pause that asked their generation again first
    # (those then go in one write too: the question is an answer from after the pause).
    assert at_once > 0 and rechecked > 0, (at_once, rechecked, len(takes))


#: Rounds of :func:`test_cold_searches_beside_a_retiring_generation_keep_their_connection`.
RETIRE_ROUNDS = 8


def test_cold_searches_beside_a_retiring_generation_keep_their_connection(
    node: devbroker.NodeInfo, amqp_url: str, name: str
) -> None:
    """RabbitMQ closes the whole connection of a client that publishes to (or reads from)
    a quorum queue while it is being deleted (3.10.8: 541; 4.3.6: 506 "failed to deliver
    message", once in 8 rounds of a CI rehearsal). A cold cluster-mode client searches
    from generation 0, so it meets the generation being retired: searches run in a loop,
    four at a time, while generation 0 is deleted (generation 1 made), and the searcher
    keeps its connection in every round (fencing._generations_exist: a buried generation
    is never probed, on every version)."""
    k = _fresh_shard(node, amqp_url, name)
    outcomes = [_search_while_retiring(node, amqp_url, name, k) for _ in range(RETIRE_ROUNDS)]
    lost = [o for o in outcomes if not o[0]]
    assert not lost, (len(lost), RETIRE_ROUNDS, lost[0][2][:2])
    assert all(o[1] > 0 for o in outcomes)


def _search_while_retiring(
    node: devbroker.NodeInfo, url: str, name: str, k: int
) -> tuple[bool, int, list[str]]:
    """One round: (the searcher's connection alive after, searches made, their errors)."""
    import threading

    from pamqp.commands import Queue

    from amqp_locks import fencing
    from amqp_locks.names import fence_generation

    # By name (rabbitmqctl per round, an Erlang VM each, took this test to 246 s of its
    # 300 s on a loaded machine): the test lists the shard once first.
    _reset_known(url, k)
    started, done = threading.Event(), threading.Event()

    async def supersede(s: Session) -> int:
        # fencing._supersede's write, without its background retire: retired below.
        check = Queue.Declare(queue=fencing._gen(k, 0), passive=True, nowait=True)
        return int(await fencing._write_creation(s, k, 1, [check], bury=True))

    async def search(s: Session) -> tuple[bool, int, list[str]]:
        searches, errors = 0, []

        async def loop() -> None:
            nonlocal searches
            while not done.is_set() and s.alive:
                s.fence_gens.pop(k, None)
                try:
                    await fencing._discover(s, k, time.monotonic() + 10.0, create=False)
                except AmqpLocksError as exc:
                    errors.append(str(exc)[:200])
                searches += 1
                started.set()

        await asyncio.gather(*(loop() for _ in range(4)))
        return s.alive, searches, errors

    async def retire(s: Session) -> int:
        _aged(s, k, 0)  # as RETIRE_AFTER after its tombstone
        await fencing._retire(s, k, 0)
        return 0

    with Broker(url) as writer, Broker(url, cluster=True) as searcher:
        _take(writer, name)  # generation 0
        assert _run(writer, supersede) == 1
        running = searcher.core.submit(_session_of(searcher, search))
        assert started.wait(30)
        _run(writer, retire)
        done.set()
        outcome = running.result(60)
        assert _existing(url, [fence_generation(k, 0), fence_tombstone(k, 0)]) == {}
    return outcome


def _aged(session: Session, k: int, g: int) -> None:
    """As if `session` had known generation g's tombstone for RETIRE_AFTER (a test's
    retire that stands for the background one, RETIRE_AFTER later)."""
    from amqp_locks import fencing
    from amqp_locks.transport.recent import RecentDict

    since = fencing._buried_since.setdefault(session, RecentDict())
    since[(k, g)] = time.monotonic() - fencing.RETIRE_AFTER


def test_a_retire_keeps_a_generation_whose_tombstone_it_has_not_known_long(
    amqp_url: str, node: devbroker.NodeInfo, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process wrote generation 0's tombstone a moment ago (a creator, or a retire
    burying a leftover): searches may have seen 0 unburied and still touch it, so a retire
    that finds the tombstone deletes 0 only RETIRE_AFTER after it first knew of it."""
    from pamqp.commands import Queue

    from amqp_locks import fencing
    from amqp_locks.names import fence_generation

    monkeypatch.setattr(fencing, "RETIRE_AFTER", 3.0)
    k = _fresh_shard(node, amqp_url, name)

    async def make_1(s: Session) -> int:  # _supersede's write, without its retire
        check = Queue.Declare(queue=fencing._gen(k, 0), passive=True, nowait=True)
        return int(await fencing._write_creation(s, k, 1, [check], bury=True))

    async def exists(s: Session) -> int:
        return int(await s.exists_passive(fence_generation(k, 0)))

    with Broker(amqp_url) as writer, Broker(amqp_url) as retirer:
        _take(writer, name)  # generation 0
        assert _run(writer, make_1) == 1
        started = time.monotonic()
        _run(retirer, lambda s: fencing._retire(s, k, 0))  # type: ignore[arg-type, return-value]
        assert _run(retirer, exists) == 1  # kept: the retirer had only just seen the tombstone
        waiting.wait_until(lambda: not _run(retirer, exists), 15, "generation 0 retired", 0.1)
        assert time.monotonic() - started >= fencing.RETIRE_AFTER  # by its own retry


async def _session_of(broker: Broker, step: Callable[[Session], Awaitable[T]]) -> T:
    return await step(await broker.core.session())


def test_a_retire_of_a_generation_another_retired_leaves_no_tombstone(
    amqp_url: str, node: devbroker.NodeInfo, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every session whose search saw a superseded generation retires it later, so two
    retires of one generation are common. The second, finding it gone with its tombstone,
    leaves nothing: it used to bury it again, a tombstone of nothing left for good once
    its session ended, which a run restarted below it (a reset shard) reads as a
    superseded top: CounterGone on a healthy counter."""
    from amqp_locks import fencing
    from amqp_locks.names import fence_generation, fence_tombstone

    monkeypatch.setattr(fencing, "RETIRE_AFTER", 3.0)
    k = _fresh_shard(node, amqp_url, name)
    zero = [fence_generation(k, 0), fence_tombstone(k, 0)]
    with Broker(amqp_url) as first, Broker(amqp_url) as second:
        before = _take(first, name)  # generation 0
        _run(first, lambda s: fencing._supersede(s, k, 0))  # type: ignore[arg-type, return-value]
        waiting.wait_until(lambda: not _existing(amqp_url, zero), 15, "0 retired by first", 0.1)
        _run(second, lambda s: fencing._retire(s, k, 0))  # type: ignore[arg-type, return-value]
        assert _existing(amqp_url, zero) == {}
        assert _take(second, name) > before  # from generation 1


def test_a_retire_drops_the_tombstone_a_dead_retire_left_below_the_run(
    amqp_url: str, node: devbroker.NodeInfo, name: str
) -> None:
    """A retire deletes a generation, then its tombstone: one that died between the two
    left a tombstone of nothing below the run. The next retire above it drops it (left,
    a run restarted below it would read it as a superseded top)."""
    from pamqp.commands import Queue

    from amqp_locks import fencing
    from amqp_locks.names import fence_generation, fence_tombstone

    k = _fresh_shard(node, amqp_url, name)

    def make(g: int) -> Callable[[Session], Awaitable[int]]:
        async def write(s: Session) -> int:  # _supersede's write, without its retire
            check = Queue.Declare(queue=fencing._gen(k, g - 1), passive=True, nowait=True)
            return int(await fencing._write_creation(s, k, g, [check], bury=True))

        return write

    with Broker(amqp_url) as first, Broker(amqp_url) as second:
        _take(first, name)  # generation 0
        assert _run(first, make(1)) == 1
        _delete(amqp_url, [fence_generation(k, 0)])  # a retire of 0 dies after its first delete
        assert _run(first, make(2)) == 1
        assert _existing(amqp_url, [fence_tombstone(k, 0)])
        _run(second, lambda s: fencing._retire(s, k, 1))  # type: ignore[arg-type, return-value]
        assert _existing(amqp_url, [fence_tombstone(k, 0)]) == {}
        # 1 itself waits RETIRE_AFTER: the second had only just seen its tombstone.
        kept = [fence_generation(k, 1), fence_generation(k, 2)]
        assert set(_existing(amqp_url, kept)) == set(kept)


def _marker_member(node: devbroker.NodeInfo, k: int, action: str) -> None:
    """Stop or restart (`action`: ``stop_server``/``restart_server``) the Raft member of
    shard `k`'s marker on this one-node broker: the queue's record stays, as while a
    genesis's marker is starting (its record written, its member not yet running)."""
    lookup = (
        f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, '
        f'<<"{fence_marker(k)}">>))'
    )
    out = devbroker.rabbitmqctl(
        node, "eval", f"{lookup}, ra:{action}(quorum_queues, amqqueue:get_pid(Q))."
    )
    assert out.strip() == "ok", out


def test_a_cold_take_beside_a_marker_not_running_keeps_the_connection(
    node: devbroker.NodeInfo, amqp_url: str, name: str
) -> None:
    """A marker a genesis just declared has its record before its Raft member runs: a
    ``basic.get`` of its hints then makes the broker close the reader's whole connection
    (541 "Cannot get a message ...: noproc": CI rehearsal 62, 3.10.8, the next client after
    a genesis cut after its marker's declaration), and every lease on it. With the marker's
    member stopped (the same state, held for the test), a connection that holds a lease of
    another shard makes its first fenced grant of this shard: granted, above the shard's
    earlier token, and the other lease is still held."""
    k = fence_shard_index(name)
    other = next(f"{name}-{i}" for i in range(100) if fence_shard_index(f"{name}-{i}") != k)
    with Broker(amqp_url) as b:
        before = _take(b, name)  # the shard and its marker exist, with a hint
    _marker_member(node, k, "stop_server")
    try:
        with Broker(amqp_url, heartbeat=10.0) as b:
            held = Mutex(b, other).acquire(timeout=30)
            assert held is not None
            lease = Mutex(b, name).acquire(timeout=30)  # a cold search of shard k
            assert lease is not None and lease.fencing_token > before
            assert held.held and held.lost_reason is None, held.lost_reason
            assert held.verify() and lease.verify()
            lease.release(wait=True)
            held.release(wait=True)
    finally:
        _marker_member(node, k, "restart_server")
    with Broker(amqp_url) as b:  # the restarted marker is read again
        assert _take(b, name) > before


def test_a_search_that_meets_leftovers_below_a_rebuilt_run_reads_the_hints_whole(
    amqp_url: str, node: devbroker.NodeInfo, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A counter deleted by hand right after a renewal and rebuilt far above (repair_fence)
    leaves its superseded generation 0 and its tombstone below the run, out of a wide
    scan's reach: a cold search finds the run only from the marker's hints. Other cold
    readers hold the hints a few round trips each, and a search that read none twice
    called the healthy counter gone (CI of stop 60, RabbitMQ 4.0.5, 8 racers on a fresh
    name: CounterGone "g0 superseded, none above it; marker hint None"). Here another
    connection holds every hint until the search comes to its verdict's read, which waits
    them out: the take is granted from the rebuilt run."""
    from pamqp.commands import Queue

    from amqp_locks import fencing

    k = fence_shard_index(name)
    far = 1000
    assert far > 1 + fencing.SCAN_WINDOW * fencing.SCAN_WINDOWS  # beyond a wide scan from 1
    left = [fence_generation(k, 0), fence_tombstone(k, 0)]
    doomed = [*_known(k), fence_generation(k, far), fence_tombstone(k, far)]
    _reset_shard(node, amqp_url, k)

    def write(g: int, after: str, bury: bool) -> Callable[[Session], Awaitable[int]]:
        async def go(s: Session) -> int:  # a creation write, without any retire
            check = Queue.Declare(queue=after, passive=True, nowait=True)
            return int(await fencing._write_creation(s, k, g, [check], bury=bury))

        return go

    verdict, held = threading.Event(), threading.Event()
    settled: list[float] = []  # the verdict reads' patience
    real = fencing._read_hint

    async def watched(session: Session, shard: int, settle: float = 0.0) -> int | None:
        if settle and shard == k:
            settled.append(settle)
            verdict.set()
        return await (real(session, shard, settle) if settle else real(session, shard))

    def hold(taken: list[int]) -> None:
        """Every hint of the marker taken on another connection, held until the verdict."""

        async def go() -> None:
            conn = await asyncio.wait_for(aiormq.connect(amqp_url), 30)
            try:
                ch = await conn.channel()
                while True:
                    got = await ch.basic_get(fence_marker(k), no_ack=False)
                    if type(got.delivery).__name__ != "GetOk":
                        break
                    taken.append(int(got.body))
                held.set()
                await asyncio.get_running_loop().run_in_executor(None, verdict.wait, 60)
            finally:
                await conn.close()  # the hints go back

        asyncio.run(go())

    try:
        with Broker(amqp_url) as b:
            _take(b, name)  # generation 0, hint 0
            assert _run(b, write(1, fence_generation(k, 0), bury=True)) == 1  # a renewal
            _delete(amqp_url, [fence_generation(k, 1)])  # deleted by hand
            assert _run(b, write(far, fence_marker(k), bury=False)) == 1  # repair's write
        assert set(_existing(amqp_url, doomed)) == {fence_marker(k), *left, fencing._gen(k, far)}
        taken: list[int] = []
        holder = threading.Thread(target=hold, args=(taken,))
        holder.start()
        try:
            assert held.wait(30), "the holder did not take the hints"
            assert taken == [far] * fencing.HINTS_KEPT  # the newest, in every copy
            monkeypatch.setattr(fencing, "_read_hint", watched)
            with Broker(amqp_url) as cold:
                token = _take(cold, name, timeout=60)
        finally:
            verdict.set()
            holder.join(30)
        assert token >= fencing.shard_token(far, 0)
        assert settled, "granted without a verdict's read: the hints were not held"
    finally:
        _delete(amqp_url, doomed)


class _SlowProbes:
    """A session whose probes answer after `slow[i]` seconds of a fake clock (the last
    figure for every later probe): finds nothing."""

    def __init__(self, clock: list[float], slow: list[float]) -> None:
        self.clock, self.slow, self.probes = clock, slow, 0

    async def probe(self, names: list[str]) -> list[bool]:
        self.clock[0] += self.slow[min(self.probes, len(self.slow) - 1)]
        self.probes += 1
        return [False] * len(names)


@pytest.mark.parametrize(
    ("slow", "probes", "raises"),
    [([fencing.RETIRE_AFTER], 3, True), ([fencing.RETIRE_AFTER, 0.1], 3, False)],
    ids=["always-slow", "slow-once"],
)
def test_a_search_keeps_its_deadline_when_every_probe_answers_slowly(
    monkeypatch: pytest.MonkeyPatch, slow: list[float], probes: int, raises: bool
) -> None:
    """fencing._generations_exist asks the tombstones again when their probe took over
    RETIRE_AFTER / 2 (a retire may have gone on meanwhile). A broker that answers every
    probe that slowly gets BrokerTimeout at the search's deadline, not a caller held for
    ever (without the deadline this test never ends); one slow answer is asked again and
    the search goes on (fake session and clock: the loop's logic)."""
    from types import SimpleNamespace

    from amqp_locks.errors import BrokerTimeout

    clock = [1000.0]
    monkeypatch.setattr(fencing, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    session: Any = _SlowProbes(clock, slow)
    search = fencing._generations_exist(session, 3, [0, 1], deadline=1025.0)
    if raises:
        with pytest.raises(BrokerTimeout, match="fence shard 03"):
            asyncio.run(search)
    else:
        assert asyncio.run(search) == [False, False]
    assert session.probes == probes
