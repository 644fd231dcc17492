"""Token semaphore, use case 3: consumers take turns on a work queue.

AMQP has exclusive queues and exclusive consumers, but an idle consumer cannot learn when
the queue became free. Here three consumer processes share the work queue
`example-turns-work` through a token semaphore of one permit: the holder consumes a turn
of at most TURN messages, cancels its consumer and releases; the broker pushes the token
to the next waiting consumer at once. Nobody polls. (A `Mutex` of the same name would do
too; the token semaphore is the blog's design and hands over by push.)

The consumers use the asyncio API (`amqp_locks.aio`) and a plain aiormq channel for the
work queue. Run with `scripts/demo tokens_consumers_take_turns` (it starts a private
RabbitMQ node on loopback unless AMQP_URL is set). See docs/tokens.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import sys
import time

import aiormq
from rich.console import Console

from amqp_locks import aio
from amqp_locks.transport.urls import DEFAULT_URL

NAME = "example-turns"
WORK = f"{NAME}-work"
CONSUMERS = 3
JOBS = 24
TURN = 4  # messages per turn
console = Console()
# Closing a Broker right after a release can make aiormq warn that a channel close was
# cancelled; it is harmless (closing the connection returns everything) and only noise here.
logging.getLogger("aiormq").setLevel(logging.ERROR)


def amqp_url() -> str:
    return os.environ.get("AMQP_URL") or DEFAULT_URL


async def take_turn(ch: aiormq.abc.AbstractChannel, limit: int) -> list[str]:
    """Consume up to `limit` messages (push, prefetch 1), then cancel the consumer."""
    inbox: asyncio.Queue[aiormq.abc.DeliveredMessage] = asyncio.Queue()
    await ch.basic_qos(prefetch_count=1)
    ok = await ch.basic_consume(WORK, inbox.put, no_ack=False)
    done: list[str] = []
    while len(done) < limit:
        message = await inbox.get()
        await asyncio.sleep(0.04)  # process the job
        await ch.basic_ack(message.delivery.delivery_tag)  # type: ignore[union-attr]
        done.append(message.body.decode())
    await ch.basic_cancel(ok.consumer_tag)
    while not inbox.empty():  # pushed after our last ack: not ours to process
        message = inbox.get_nowait()
        await ch.basic_reject(message.delivery.delivery_tag, requeue=True)  # type: ignore[union-attr]
    return done


async def consumer(i: int, events: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    connection = await aiormq.connect(amqp_url())
    ch = await connection.channel()
    async with aio.Broker() as broker:
        sem = aio.TokenSemaphore(broker, NAME)
        while True:
            async with sem.acquire(timeout=30) as lease:
                began = time.monotonic()
                # We hold the turn, so nobody else has messages unacked: the ready count
                # is the work left.
                ok = await ch.queue_declare(WORK, passive=True)
                left = ok.message_count or 0
                jobs = await take_turn(ch, min(TURN, left)) if left else []
                ended = time.monotonic()
            events.put(("turn", i, lease.fencing_token, jobs, began, ended))
            if not jobs:
                break
            await asyncio.sleep(0.05)  # work on the batch outside the turn
    await connection.close()


def run_consumer(i: int, events: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    asyncio.run(consumer(i, events))


async def prepare(publish: bool) -> None:
    connection = await aiormq.connect(amqp_url())
    ch = await connection.channel()
    if publish:
        await ch.queue_declare(WORK, durable=True)
        await ch.queue_purge(WORK)
        await ch.confirm_delivery()
        for n in range(1, JOBS + 1):
            await ch.basic_publish(f"job-{n:02d}".encode(), routing_key=WORK)
    else:
        await ch.queue_delete(WORK)
    await connection.close()


async def setup_lock(create: bool) -> None:
    async with aio.Broker() as broker:
        sem = aio.TokenSemaphore(broker, NAME)
        await sem.destroy()  # on create: leftovers of an interrupted run
        if create:
            await sem.setup(1)


def main() -> int:
    asyncio.run(setup_lock(create=True))
    asyncio.run(prepare(publish=True))
    console.print(f"work queue {WORK!r}: {JOBS} jobs; lock {NAME!r}: 1 permit")

    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    procs = [ctx.Process(target=run_consumer, args=(i, events)) for i in range(CONSUMERS)]
    start = time.monotonic()
    for p in procs:
        p.start()
    turns = []
    finished = 0
    while finished < CONSUMERS:
        _, i, token, jobs, began, ended = events.get(timeout=60)
        turns.append((began, ended, i, jobs))
        if not jobs:
            finished += 1
            console.print(f"[dim]{began - start:6.3f}s  consumer {i}: queue empty, done[/dim]")
            continue
        console.print(
            f"[green]{began - start:6.3f}s  consumer {i} (token {token}): "
            f"{', '.join(jobs)}[/green]  [dim]{(ended - began) * 1000:.0f} ms[/dim]"
        )
    for p in procs:
        p.join(30)
    asyncio.run(prepare(publish=False))
    asyncio.run(setup_lock(create=False))

    turns.sort()
    overlaps = sum(1 for a, b in itertools.pairwise(turns) if b[0] < a[1])
    consumed = sorted(job for *_, jobs in turns for job in jobs)
    per_consumer = {i: sum(len(t[3]) for t in turns if t[2] == i) for i in range(CONSUMERS)}
    ok = (
        overlaps == 0
        and consumed == [f"job-{n:02d}" for n in range(1, JOBS + 1)]
        and all(p.exitcode == 0 for p in procs)
    )
    console.print(
        f"[bold]{len(consumed)} jobs, each consumed once, in {sum(1 for t in turns if t[3])} "
        f"turns; never two consumers at once.\njobs per consumer: {per_consumer}[/bold]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
