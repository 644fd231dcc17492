"""amqp-locks in 30 seconds: five processes share a persistent semaphore of two slots.

Run with `scripts/demo`: it starts a private RabbitMQ node on loopback (unless AMQP_URL is
set) and passes its URL in AMQP_URL, which `Broker()` reads, so nothing needs configuring.
"""

from __future__ import annotations

import multiprocessing
import os
import time

from rich.console import Console

from amqp_locks import Broker, PersistentSemaphore, SemaphoreAdmin

NAME = "demo-images"
SLOTS = 2
WORKERS = 5
console = Console()


def worker(i: int, events: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with Broker() as broker:
        sem = PersistentSemaphore(broker, NAME)
        with sem.acquire(timeout=60) as lease:  # type: ignore[union-attr]
            events.put(("grant", i, lease.number, lease.fencing_token, time.monotonic()))
            time.sleep(0.5)  # the work done while holding the slot
            events.put(("release", i, lease.number, lease.fencing_token, time.monotonic()))


def main() -> None:
    with Broker() as broker:
        console.print(f"broker: [bold]{broker.url}[/bold]  (pid {os.getpid()})")
        admin = SemaphoreAdmin(broker, NAME)
        admin.destroy()
        admin.create(SLOTS)
        console.print(f"created semaphore {NAME!r} with {admin.max_slots()} slots")

        ctx = multiprocessing.get_context("spawn")
        events = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(i, events)) for i in range(WORKERS)]
        start = time.monotonic()
        for p in procs:
            p.start()
        holding, peak = 0, 0
        for _ in range(2 * WORKERS):
            kind, i, slot, token, at = events.get(timeout=120)
            holding += 1 if kind == "grant" else -1
            peak = max(peak, holding)
            colour = "green" if kind == "grant" else "dim"
            console.print(
                f"[{colour}]{at - start:6.3f}s  worker {i} {kind:7s} slot {slot} "
                f"(fencing token {token})  holders now {holding}[/{colour}]"
            )
        for p in procs:
            p.join()

        lease = PersistentSemaphore(broker, NAME).acquire()
        assert lease is not None
        lease.on_lost(lambda lease: console.print(f"[red]told: {lease.lost_reason}[/red]"))
        admin.remove_slots(SLOTS)  # an administrator removes every slot, ours included
        lease.lost.wait(10)
        lease.release()
        admin.destroy()
        console.print(
            f"[bold]peak holders {peak} of {SLOTS} slots; {WORKERS} workers served; "
            f"a holder learns at once when its slot is removed.[/bold]"
        )


if __name__ == "__main__":
    main()
