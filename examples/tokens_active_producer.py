"""Token semaphore, use case 2: one active producer out of a set (a binary semaphore).

Three producer processes wait on a token semaphore of one permit. The holder is the active
producer and publishes; the others sit idle as consumers of the token queue, without
polling. The first active producer stops and releases (basic.reject, requeue); the second
is killed with SIGKILL, and the broker requeues the token when its connection drops. Either
way the broker pushes the token to the next producer at once: the takeover latencies are
printed at the end.

Run with `scripts/demo tokens_active_producer` (it starts a private RabbitMQ node on loopback
unless AMQP_URL is set). See docs/tokens.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.synchronize import Event

from rich.console import Console

from amqp_locks import Broker, TokenSemaphore

NAME = "example-active-producer"
PRODUCERS = 3
ACTIVE_FOR = 1.0  # seconds each active producer publishes before main stops or kills it
console = Console()
# Closing a Broker right after a release can make aiormq warn that a channel close was
# cancelled; it is harmless (closing the connection returns everything) and only noise here.
logging.getLogger("aiormq").setLevel(logging.ERROR)


def producer(i: int, out: Connection, stop: Event) -> None:
    with Broker() as broker:
        out.send(("waiting", i, 0, time.monotonic()))
        lease = TokenSemaphore(broker, NAME).acquire(timeout=30)
        assert lease is not None, "no token within 30 s"
        with lease:
            out.send(("active", i, lease.fencing_token, time.monotonic()))
            seq = 0
            while not stop.wait(0.25) and not lease.lost.is_set():
                seq += 1  # a real producer would publish to its exchange here
                out.send(("publish", i, seq, time.monotonic()))
            out.send(("release", i, seq, time.monotonic()))
        # leaving the `with` released the token: the next producer takes over


def main() -> int:
    ctx = multiprocessing.get_context("spawn")
    with Broker() as broker:
        console.print(f"broker: [bold]{broker.url}[/bold]")
        sem = TokenSemaphore(broker, NAME)
        sem.destroy()  # leftovers of an interrupted run
        sem.setup(1)
        console.print(f"token semaphore {NAME!r}: 1 permit, so one active producer")

        stops = [ctx.Event() for _ in range(PRODUCERS)]
        readers: dict[Connection, int] = {}
        procs, writers = [], []
        for i in range(PRODUCERS):
            # One pipe per producer: killing one cannot break the others' reporting.
            reader, writer = ctx.Pipe(duplex=False)
            procs.append(ctx.Process(target=producer, args=(i, writer, stops[i])))
            readers[reader] = i
            writers.append(writer)
        start = time.monotonic()
        for p in procs:
            p.start()
        for w in writers:
            w.close()  # the producers hold the write ends now; EOF when one exits or dies

        plan = ["release", "kill", "release"]  # what happens to the 1st, 2nd, 3rd producer
        active: int | None = None
        active_since = 0.0
        handed_over_at: float | None = None  # when the previous producer stopped or died
        how = ""
        latencies: list[tuple[str, float]] = []
        tokens: list[int] = []
        overlap = False
        while readers and time.monotonic() - start < 30:
            batch = []
            for reader in wait(list(readers), timeout=0.05):
                try:
                    while reader.poll():  # type: ignore[union-attr]
                        batch.append(reader.recv())  # type: ignore[union-attr]
                except EOFError:
                    del readers[reader]  # type: ignore[arg-type]
            # Pipes are read in fd order: sort what arrived by when it happened.
            for kind, i, value, at in sorted(batch, key=lambda event: event[3]):
                t = f"{at - start:6.3f}s"
                if kind == "waiting":
                    console.print(f"[dim]{t}  producer {i} waits for the token[/dim]")
                elif kind == "active":
                    if active is not None:
                        overlap = True
                    active, active_since = i, at
                    tokens.append(value)
                    after = ""
                    if handed_over_at is not None:
                        latency = at - handed_over_at
                        latencies.append((how, latency))
                        after = f", {latency * 1000:.1f} ms after the last one {how}"
                    console.print(
                        f"[green]{t}  producer {i} is active, token {value}{after}[/green]"
                    )
                elif kind == "publish":
                    console.print(f"[dim]{t}  producer {i} publishes message {value}[/dim]")
                elif kind == "release":
                    console.print(f"[yellow]{t}  producer {i} stops and releases[/yellow]")
                    active, handed_over_at, how = None, at, "released"
            if active is not None and time.monotonic() - active_since >= ACTIVE_FOR:
                step = plan[len(tokens) - 1]
                if step == "release":
                    stops[active].set()
                    active_since = float("inf")  # asked once; its "release" will follow
                else:
                    victim = procs[active]
                    handed_over_at, how = time.monotonic(), "was killed"
                    assert victim.pid is not None
                    os.kill(victim.pid, signal.SIGKILL)
                    console.print(
                        f"[red]{handed_over_at - start:6.3f}s  SIGKILL producer {active} "
                        f"(pid {victim.pid}): no release[/red]"
                    )
                    active = None
        for p in procs:
            p.join(10)
        sem.destroy()

    console.print("\n[bold]takeover latencies[/bold] (stop or kill → next producer active):")
    for how, latency in latencies:
        console.print(f"  previous producer {how:10s}  {latency * 1000:7.1f} ms")
    codes = [p.exitcode for p in procs]
    ok = (
        len(tokens) == PRODUCERS
        and len(latencies) == PRODUCERS - 1
        and not overlap
        and sorted(codes) == [-signal.SIGKILL, 0, 0]  # type: ignore[type-var]
        and tokens == sorted(tokens)
    )
    console.print(
        f"[bold]{len(tokens)} producers took turns, never two at once; "
        f"fencing tokens {tokens}.[/bold]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
