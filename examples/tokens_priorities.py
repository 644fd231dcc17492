"""Token semaphore, use case 4: prefer some processes over others (consumer priorities).

This process holds the only permit. Three waiter processes start one after the other with
priorities 1, 5 and 10 (the least preferred arrives first) and wait as consumers of the
token queue with `x-priority`. On each release the broker pushes the token to the waiting
consumer with the highest priority: 10, then 5, then 1, whatever the arrival order.

Run with `scripts/demo tokens_priorities` (it starts a private RabbitMQ node on loopback
unless AMQP_URL is set). See docs/tokens.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time

from rich.console import Console

from amqp_locks import Broker, TokenSemaphore

NAME = "example-priorities"
PRIORITIES = [1, 5, 10]  # in order of arrival
HOLD = 0.3
console = Console()
# Closing a Broker right after a release can make aiormq warn that a channel close was
# cancelled; it is harmless (closing the connection returns everything) and only noise here.
logging.getLogger("aiormq").setLevel(logging.ERROR)


def waiter(priority: int, events: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with Broker() as broker:
        sem = TokenSemaphore(broker, NAME, priority=priority)
        lease = sem.acquire(timeout=30)
        assert lease is not None, "no token within 30 s"
        with lease:
            events.put(("grant", priority, lease.fencing_token, time.monotonic()))
            time.sleep(HOLD)
            events.put(("release", priority, lease.fencing_token, time.monotonic()))


def wait_for_waiters(sem: TokenSemaphore, count: int, timeout: float = 15.0) -> None:
    """Poll status() until `count` consumers wait behind the holder (for the demo only:
    real waiters never poll)."""
    deadline = time.monotonic() + timeout
    while sem.status().waiting < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} waiters did not show up within {timeout}s")
        time.sleep(0.05)


def main() -> int:
    ctx = multiprocessing.get_context("spawn")
    with Broker() as broker:
        console.print(f"broker: [bold]{broker.url}[/bold]")
        sem = TokenSemaphore(broker, NAME)
        sem.destroy()  # leftovers of an interrupted run
        sem.setup(1)
        holder = sem.acquire(timeout=10)
        assert holder is not None
        start = time.monotonic()
        console.print(
            f"[green]{0:6.3f}s  main holds the only permit of {NAME!r} "
            f"(fencing token {holder.fencing_token})[/green]"
        )

        events = ctx.Queue()
        procs = []
        for n, priority in enumerate(PRIORITIES, start=1):
            p = ctx.Process(target=waiter, args=(priority, events))
            p.start()
            procs.append(p)
            wait_for_waiters(sem, n)  # so that they really arrive in this order
            console.print(
                f"[dim]{time.monotonic() - start:6.3f}s  waiter with priority {priority:2d} "
                f"is waiting ({n} waiting)[/dim]"
            )

        released_at = time.monotonic()
        console.print(f"[yellow]{released_at - start:6.3f}s  main releases[/yellow]")
        holder.release()
        order = []
        for _ in range(2 * len(PRIORITIES)):
            kind, priority, token, at = events.get(timeout=30)
            if kind == "grant":
                order.append(priority)
                console.print(
                    f"[green]{at - start:6.3f}s  priority {priority:2d} gets the token "
                    f"(fencing token {token})[/green]"
                )
            else:
                console.print(f"[dim]{at - start:6.3f}s  priority {priority:2d} releases[/dim]")
        for p in procs:
            p.join(30)
        sem.destroy()

    expected = sorted(PRIORITIES, reverse=True)
    ok = order == expected and all(p.exitcode == 0 for p in procs)
    console.print(
        f"[bold]arrival order {PRIORITIES}, grant order {order}"
        + (" (highest priority first)" if order == expected else f", expected {expected}")
        + "[/bold]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
