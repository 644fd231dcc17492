"""A persistent semaphore's acquire against the number of slots C, all but one held by
another process (real leases, placed with the client's own claim step: C full acquires
would cost O(C^2) probes at C = 1000). The free slot last is the worst case of the
ascending search, first the best; probes are counted where they go out (``ProbeCounter``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

from amqp_locks import Broker, PersistentSemaphore
from amqp_locks.names import holder_queue, slot_queue
from amqp_locks.semaphore.client import claim_slot  # a lease on a given slot, no search
from amqp_locks.transport.session import Session

from .peers.worker import Crew, Sync, what
from .stats import Budget, CpuMeter, brief, fresh_lock, ms, summarize_reps, timed


class ProbeCounter:
    """What the client's search really sends, counted where probes go out (``Session.probe``):
    the window policy is the library's business; ``held`` probes hit a held slot's queues."""

    def __init__(self) -> None:
        self.reset()
        self.sizes: list[int] = []

    def reset(self, held_names: frozenset[str] = frozenset()) -> None:
        self.calls = self.queues = self.held = 0
        self.held_names = held_names

    @contextlib.contextmanager
    def installed(self) -> Iterator[ProbeCounter]:
        original = Session.probe

        async def probe(session: Session, queues: Sequence[str]) -> list[bool]:
            self.calls += 1
            self.queues += len(queues)
            self.sizes.append(len(queues))
            self.held += len(self.held_names.intersection(queues))
            return await original(session, queues)

        with mock.patch.object(Session, "probe", probe):
            yield self


def _holder(job: tuple[str, str, list[int]], idx: int, sync: Sync) -> None:
    """Hold ``slots`` of semaphore ``name`` as real leases until told to stop, then release."""
    url, name, slots = job
    # Closing right after the releases cancels their channel closes; aiormq warns about it.
    logging.getLogger("aiormq.channel").setLevel(logging.ERROR)
    with Broker(url, connection_name=f"amqp-locks bench holders of {name}") as broker:
        core = broker.core

        async def claim() -> list[Any]:
            session = await core.session()
            return [await claim_slot(core, session, name, k) for k in slots]

        try:
            held = core.run(claim())
            if None in held:
                raise RuntimeError(f"a slot of {name!r} vanished while placing holders")
        except BaseException as exc:
            sync.out.put(("error", idx, what(exc)))
            return
        sync.out.put(("ready", idx))
        sync.stop.wait()
        for state in held:
            core.run(state.release())
        sync.out.put(("released", idx))


@contextlib.contextmanager
def held_slots(url: str, name: str, slots: list[int]) -> Iterator[int | None]:
    """Hold ``slots`` from another process for the block; yields that process's pid."""
    if not slots:
        yield None
        return
    with Crew() as crew:
        crew.spawn((url, name, slots), target=_holder)
        yield crew.procs[0].pid
        crew.sync.stop.set()
        crew.expect("released", 0, 120)


def _cell(
    url: str,
    sem: PersistentSemaphore,
    free: int,
    capacity: int,
    budget: Budget,
    broker_pid: int | None,
    counter: ProbeCounter,
) -> dict[str, Any]:
    """One cell of the sweep: every slot but ``free`` held by another process."""
    held = [k for k in range(1, capacity + 1) if k != free]
    names = frozenset(q for k in held for q in (slot_queue(sem.name, k), holder_queue(sem.name, k)))

    def op() -> float:
        counter.sizes = []
        t = time.perf_counter()
        lease = sem.acquire(blocking=False)
        dt = time.perf_counter() - t
        if lease is None or lease.number != free:
            raise RuntimeError(f"expected slot {free} of {sem.name!r}, got {lease!r}")
        lease.release()
        return dt

    with held_slots(url, sem.name, held) as holder_pid:
        meter = CpuMeter({"client": os.getpid(), "holders": holder_pid, "broker": broker_pid})
        samples = timed(op, budget, lambda: (counter.reset(names), meter.start()))
        cpu = meter.stop()
    n = sum(map(len, samples))
    return {
        "capacity": capacity,
        "slot": free,
        **summarize_reps(samples, samples=True),
        "probes_sent": round(counter.queues / n),
        "probe_round_trips": round(counter.calls / n, 1),
        "held_probes": round(counter.held / n),
        "windows": counter.sizes,
        "cpu_per_acquire_ms": {k: ms(v / n) for k, v in cpu.items()},
    }


def search_sweep(
    url: str,
    capacities: list[int],
    budget_for: Callable[[int, int], Budget],
    broker_pid: int | None,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Acquire latency with C-1 of C slots held; the free slot last (worst) or first."""
    rows: list[dict[str, Any]] = []
    counter = ProbeCounter()
    with Broker(url) as broker, counter.installed():
        for c in capacities:
            with fresh_lock(url, "semaphore", c, f"c{c}") as name:
                sem = PersistentSemaphore(broker, name)
                for position, free in (("last", c), ("first", 1))[: min(2, c)]:
                    cell = _cell(url, sem, free, c, budget_for(c, free), broker_pid, counter)
                    rows.append({"free_slot": position, **cell})
                    log(f"  C={c} free={position} probes={cell['probes_sent']} {brief(cell)}")
    return rows
