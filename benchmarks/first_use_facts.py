"""The broker facts a first-use token queue rests on (tokens/fresh.py), checked on a node:

    python -m benchmarks.first_use_facts URL [--expires-ms 3000]

(a) a quorum queue declared again with another ``x-max-length`` is refused (406), the same
    one is accepted; of 20 connections declaring one fresh queue with their own stamps,
    one is accepted; a queue made without ``x-expires`` (the earlier release's) refuses a
    stamped declaration too;
(b) ``x-expires``: an unused quorum queue holding a ready message goes (how long after),
    passive declares do not keep it; a held message (consumer, unacked) keeps it for
    three expiry periods, and it goes that long after the holder left;
(c) 30 connections racing ``queue.declare`` (own stamp, no-wait) + a publish in one write
    (five rounds): one is accepted per round, and the queue holds exactly one message;
(d) the residual window: a creator whose TCP connection is aborted right after that write
    (within 0-2 ms) leaves the queue made but without its message how often.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import aiormq
from aiormq.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed
from pamqp.commands import Basic, Queue

from amqp_locks.transport.aiormq_compat import publish_frames, send_together

_random = random.SystemRandom()


def _stamp() -> int:
    return _random.randrange(2**40, 2**62)


def _args(version: tuple[int, int], expires: int | None, stamp: int | None) -> dict[str, Any]:
    a: dict[str, Any] = {"x-queue-type": "quorum"}
    if version >= (4, 0):
        a["x-delivery-limit"] = -1
    if expires is not None:
        a["x-expires"] = expires
    if stamp is not None:
        a["x-max-length"] = stamp
    return a


async def _declare(conn: aiormq.Connection, queue: str, args: dict[str, Any]) -> bool:
    try:
        await (await conn.channel()).queue_declare(queue, durable=True, arguments=args)
    except ChannelPreconditionFailed:
        return False
    return True


async def _exists(conn: aiormq.Connection, queue: str) -> bool:
    try:
        await (await conn.channel()).queue_declare(queue, passive=True)
    except ChannelNotFoundEntity:
        return False
    return True


async def _gone_after(conn: aiormq.Connection, queue: str, limit: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not await _exists(conn, queue):
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return None


async def _create(conn: aiormq.Connection, queue: str, args: dict[str, Any]) -> bool:
    ch = await conn.channel(publisher_confirms=False)
    await ch.tx_select()  # commit-ok: the broker handled the write (declare and publish)
    frames: list[Any] = [Queue.Declare(queue=queue, durable=True, nowait=True, arguments=args)]
    frames += publish_frames(b"1", queue, Basic.Properties(delivery_mode=2))
    await send_together(ch, frames)
    try:
        await ch.tx_commit()
    except ChannelPreconditionFailed:
        return False
    return True


def window(url: str, tries: int) -> dict[str, int]:
    """(d): write the declaration and the publish, abort the connection at once, look."""
    import logging
    import uuid

    from aiormq.abc import ChannelFrame
    from pamqp.body import ContentBody
    from pamqp.header import ContentHeader

    from amqp_locks import Broker
    from amqp_locks.tokens import fresh

    logging.disable(logging.WARNING)  # the aborted connections
    seen = {"not made": 0, "with its message": 0, "without its message": 0}
    with Broker(url, cluster=True) as creator, Broker(url, cluster=True) as reader:
        for _ in range(tries):
            q = f"facts-w-{uuid.uuid4().hex[:10]}"

            async def write_and_abort(q: str = q) -> None:
                session = await creator.core.session()
                ch: Any = await session.open_channel()
                args = fresh.fresh_arguments(session, _stamp())
                frames: list[Any] = [
                    Queue.Declare(queue=q, durable=True, nowait=True, arguments=args),
                    Basic.Publish(exchange="", routing_key=q),
                    ContentHeader(properties=Basic.Properties(delivery_mode=2), body_size=1),
                    ContentBody(b"1"),
                ]
                await ch.write_queue.put(
                    ChannelFrame.marshall(channel_number=ch.number, frames=frames)
                )
                await asyncio.sleep(_random.random() * 0.002)
                session.drop("first_use_facts: the creator dies")

            async def look(q: str = q) -> str:
                session = await reader.core.session()
                for _ in range(50):
                    if await session.exists_passive(q):
                        break
                    await asyncio.sleep(0.01)
                else:
                    return "not made"
                await asyncio.sleep(1.0)  # any message in flight has landed
                ready, _ = await session.declare_passive_counts(q)
                await session.delete(q)
                return "with its message" if ready == 1 else "without its message"

            creator.core.run(write_and_abort())
            seen[reader.core.run(look())] += 1
    return seen


async def main(url: str, expires: int) -> None:
    conn = aiormq.Connection(url)
    await conn.connect()
    v = tuple(int(x) for x in str(conn.server_properties["version"]).split(".")[:2])
    version = (v[0], v[1])
    print("RabbitMQ", conn.server_properties["version"])
    q = f"facts-{_random.getrandbits(32):x}"
    # (a)
    s1 = _stamp()
    first = await _declare(conn, q, _args(version, 60000, s1))
    other = await _declare(conn, q, _args(version, 60000, _stamp()))
    same = await _declare(conn, q, _args(version, 60000, s1))
    print(f"(a) declare {first}, another stamp {other}, the same stamp {same}")
    conns = [aiormq.Connection(url) for _ in range(30)]
    await asyncio.gather(*(c.connect() for c in conns))
    race = await asyncio.gather(
        *(_declare(c, q + "-race", _args(version, 60000, _stamp())) for c in conns[:20])
    )
    print(f"(a) 20 racers: {race.count(True)} accepted, {race.count(False)} refused")
    await _declare(conn, q + "-old", _args(version, None, None))
    print(
        f"(a) an old queue accepts a stamped declaration: "
        f"{await _declare(conn, q + '-old', _args(version, 60000, s1))}"
    )
    # (b)
    ch = await conn.channel()
    await ch.queue_declare(q + "-exp", durable=True, arguments=_args(version, expires, s1))
    await ch.basic_publish(
        b"1", routing_key=q + "-exp", properties=Basic.Properties(delivery_mode=2)
    )
    gone = await _gone_after(conn, q + "-exp", expires / 1000 + 60)
    print(
        f"(b) x-expires {expires} ms, a ready message, passive polls every 50 ms: gone "
        f"after {gone if gone is None else round(gone, 2)} s"
    )
    await ch.queue_declare(q + "-held", durable=True, arguments=_args(version, expires, s1))
    await ch.basic_publish(
        b"1", routing_key=q + "-held", properties=Basic.Properties(delivery_mode=2)
    )
    holder = aiormq.Connection(url)
    await holder.connect()
    hch = await holder.channel()
    await hch.basic_qos(prefetch_count=1)
    got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def on(message: Any) -> None:
        if not got.done():
            got.set_result(message)

    await hch.basic_consume(q + "-held", on, no_ack=False)
    await got
    await asyncio.sleep(3 * expires / 1000)
    alive = await _exists(conn, q + "-held")
    await holder.close()
    gone = await _gone_after(conn, q + "-held", expires / 1000 + 60)
    print(
        f"(b) held for {3 * expires} ms: still there {alive}; after the holder left, gone "
        f"after {gone if gone is None else round(gone, 2)} s"
    )
    # (c)
    for n in range(5):
        queue = f"{q}-c{n}"
        made = await asyncio.gather(
            *(_create(c, queue, _args(version, 60000, _stamp())) for c in conns)
        )
        ok = await (await conn.channel()).queue_declare(queue, passive=True)
        print(f"(c) round {n}: {made.count(True)} of 30 accepted, {ok.message_count} message(s)")
        await (await conn.channel()).queue_delete(queue)
    for queue in (q, q + "-race", q + "-old"):
        await (await conn.channel()).queue_delete(queue)
    for c in conns:
        await c.close()
    await conn.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--expires-ms", type=int, default=3000)
    parser.add_argument("--tries", type=int, default=40)
    ns = parser.parse_args()
    asyncio.run(main(ns.url, ns.expires_ms))
    print(f"(d) creator aborted right after its write, {ns.tries} tries:", window(ns.url, ns.tries))
