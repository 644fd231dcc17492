"""Single-client latency: uncontended acquire/release, and acquire vs the number of slots.

The search for a free slot probes `A[k]`/`B[k]` in pipelined windows, so its cost depends
on *where* the free slot is: the last slot of C is the worst case of the ascending search,
the first the best. Probes are counted as the client sends them (:class:`ProbeCounter`).

Held slots are real leases (exclusive `B[k]`, watch consumers on `A[k]`/`B[k]`, a fencing
token) owned by a separate process with its own connection, as in production; they are
placed with the client's own claim step instead of C full acquires, so setting up C=1000
does not cost O(C^2) probes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from amqp_locks import Broker, Lease, Mutex, PersistentSemaphore, SemaphoreAdmin
from amqp_locks.names import fence_queue, holder_queue, slot_queue
from amqp_locks.semaphore.client import HOLDER_ARGS
from amqp_locks.transport.session import Session

try:  # steps 5 and 7 of acquire for a given slot: a real lease without the search
    from amqp_locks.semaphore.client import _claim
except ImportError:  # pragma: no cover - internal API moved: bare exclusive queues
    _claim = None

from .stats import CpuMeter, ms, summarize_reps


def unique_name(kind: str) -> str:
    """A lock name no earlier (possibly crashed) run left queues under."""
    return f"bench-{kind}-{uuid.uuid4().hex[:8]}"


class ProbeCounter:
    """Counts what the client's search really sends, by wrapping ``Session.probe``.

    The window policy is the library's business and changes (sizes, hints); counting the
    probes at the one place they go out keeps the figures true to the code measured.
    ``held`` are the probes that hit a held slot's queues: those reach the holder.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.queues = 0
        self.held = 0
        self.held_names: frozenset[str] = frozenset()
        self.last_sizes: list[int] = []
        self._sizes: list[int] = []

    def reset(self, held_names: frozenset[str] = frozenset()) -> None:
        self.calls = self.queues = self.held = 0
        self.held_names = held_names

    def start_op(self) -> None:
        self._sizes = []

    def end_op(self) -> None:
        self.last_sizes = list(self._sizes)

    @contextlib.contextmanager
    def installed(self) -> Iterator[ProbeCounter]:
        original = Session.probe

        async def probe(session: Session, queues: Sequence[str]) -> list[bool]:
            self.calls += 1
            self.queues += len(queues)
            self._sizes.append(len(queues))
            if self.held_names:
                self.held += sum(1 for q in queues if q in self.held_names)
            return await original(session, queues)

        Session.probe = probe  # type: ignore[method-assign]
        try:
            yield self
        finally:
            Session.probe = original  # type: ignore[method-assign]


@dataclass
class Budget:
    """How much to measure per cell: repetitions, a sample cap and a time cap per rep."""

    reps: int
    max_samples: int
    seconds: float
    warmup: int = 5


# ----------------------------------------------------------------------- uncontended


def uncontended(
    url: str, budget: Budget, rtt_ms: float, meter_pids: dict[str, int | None]
) -> dict[str, Any]:
    """Acquire then release, back to back, of a C=1 semaphore and of a mutex."""
    out: dict[str, Any] = {}
    with Broker(url) as broker:
        sem_name = unique_name("uc-sem")
        admin = SemaphoreAdmin(broker, sem_name)
        admin.create(1)
        mutex_name = unique_name("uc-mutex")
        locks: dict[str, Callable[[], Lease | None]] = {
            "semaphore_c1": PersistentSemaphore(broker, sem_name).acquire,
            "mutex": Mutex(broker, mutex_name).acquire,
        }
        try:
            for label, acquire in locks.items():
                out[label] = _uncontended_one(acquire, budget, rtt_ms, meter_pids)
        finally:
            admin.destroy(purge_fence=True)
            _delete_queues(broker, [mutex_name, fence_queue(mutex_name)])
    return out


def timed_cycles(
    cycle: Callable[[], tuple[float, float]],
    budget: Budget,
    meter: CpuMeter | None = None,
    on_measure: Callable[[], None] | None = None,
) -> tuple[list[list[float]], list[list[float]], dict[str, float]]:
    """Run ``cycle`` (returns acquire and release seconds) ``budget.warmup`` times untimed
    (then ``on_measure`` is called), then ``budget.reps`` repetitions within its caps (at
    least one cycle each): (acquire reps, release reps, CPU seconds per process)."""
    for _ in range(budget.warmup):
        cycle()
    if on_measure is not None:
        on_measure()
    acq: list[list[float]] = []
    rel: list[list[float]] = []
    if meter is not None:
        meter.start()
    for _ in range(budget.reps):
        acq.append([])
        rel.append([])
        end = time.monotonic() + budget.seconds
        while len(acq[-1]) < budget.max_samples and (not acq[-1] or time.monotonic() < end):
            a, r = cycle()
            acq[-1].append(a)
            rel[-1].append(r)
    return acq, rel, (meter.stop() if meter is not None else {})


def _uncontended_one(
    acquire: Callable[[], Lease | None],
    budget: Budget,
    rtt_ms: float,
    meter_pids: dict[str, int | None],
) -> dict[str, Any]:
    def cycle() -> tuple[float, float]:
        t0 = time.perf_counter()
        lease = acquire()
        t1 = time.perf_counter()
        if lease is None:
            raise RuntimeError("uncontended acquire returned None")
        lease.release()
        return t1 - t0, time.perf_counter() - t1

    # The warm-up's first acquire also checks the fence queue.
    acq, rel, cpu = timed_cycles(cycle, budget, CpuMeter(meter_pids))
    stats: dict[str, Any] = {}
    for label, reps in (("acquire", acq), ("release", rel)):
        s = summarize_reps(reps)
        s["p50_x_rtt"] = round(s["p50_ms"] / rtt_ms, 1)
        s["p99_x_rtt"] = round(s["p99_ms"] / rtt_ms, 1)
        stats[label] = s
    n = sum(len(r) for r in acq)
    stats["cpu_per_cycle_ms"] = {k: ms(v / n) for k, v in cpu.items()}
    stats["samples_acquire_ms"] = [ms(x) for r in acq for x in r]
    stats["samples_release_ms"] = [ms(x) for r in rel for x in r]
    return stats


def _delete_queues(broker: Broker, queues: list[str]) -> None:
    """Remove benchmark leftovers (the mutex's fence queue has no admin API)."""
    core = broker._core

    async def delete() -> None:
        session = await core.session()
        for q in queues:
            await session.delete(q)

    with contextlib.suppress(Exception):
        core.run(delete())


# ---------------------------------------------------------------- acquire vs C


HOLDERS_KIND = "leases" if _claim is not None else "bare exclusive queues"


def _holder_main(url: str, name: str, slots: list[int], pipe: Connection) -> None:
    """Child process: hold ``slots`` of ``name`` as real leases until told to let go.

    A real lease is the exclusive `B[k]` plus consumers on `A[k]` and `B[k]` (so probes of
    a held slot are delivered to its holder, as in production) and a fencing token.
    """
    # Closing right after the releases cancels their channel closes; aiormq warns about it.
    logging.getLogger("aiormq.channel").setLevel(logging.ERROR)
    broker = Broker(url, connection_name=f"amqp-locks bench holders of {name}")
    core = broker._core

    async def claim_all() -> list[Any]:
        session = await core.session()
        held: list[Any] = []
        for k in slots:
            if _claim is None:
                await session.declare(holder_queue(name, k), exclusive=True, arguments=HOLDER_ARGS)
                held.append(holder_queue(name, k))
                continue
            state = await _claim(core, session, name, k)
            if state is None:
                raise RuntimeError(f"slot {k} of {name!r} vanished while placing holders")
            held.append(state)
        return held

    async def release_all(held: list[Any]) -> None:
        session = await core.session()
        for h in held:
            await (session.delete(h) if isinstance(h, str) else h.release())

    try:
        held = core.run(claim_all())
        pipe.send(("held", len(held)))
        pipe.recv()  # "release"
        core.run(release_all(held))
        pipe.send(("released", 0))
    except Exception as exc:
        pipe.send(("error", repr(exc)))
    finally:
        broker.close()


@contextlib.contextmanager
def held_slots(url: str, name: str, slots: list[int]) -> Iterator[int | None]:
    """Hold ``slots`` from another process for the block; yields that process's pid."""
    if not slots:
        yield None
        return
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder_main, args=(url, name, slots, child), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not parent.poll(0.2):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"holder process died or hung (exit code {proc.exitcode})")
        status, detail = parent.recv()
        if status != "held":
            raise RuntimeError(f"holder process failed: {detail}")
        yield proc.pid
        parent.send("release")
        if parent.poll(120):
            parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def _search_cell(
    url: str,
    name: str,
    sem: PersistentSemaphore,
    capacity: int,
    free: int,
    budget: Budget,
    broker_pid: int | None,
    counter: ProbeCounter,
) -> dict[str, Any]:
    """One cell of the sweep: every slot but ``free`` held by another process."""
    held = [k for k in range(1, capacity + 1) if k != free]

    def op() -> tuple[float, float]:
        counter.start_op()
        t = time.perf_counter()
        lease = sem.acquire(blocking=False)
        dt = time.perf_counter() - t
        counter.end_op()
        if lease is None or lease.number != free:
            raise RuntimeError(f"expected slot {free} of {name!r}, got {lease!r}")
        lease.release()
        return dt, 0.0

    t0 = time.monotonic()
    with held_slots(url, name, held) as holder_pid:
        setup = time.monotonic() - t0
        meter = CpuMeter({"client": os.getpid(), "holders": holder_pid, "broker": broker_pid})
        names = frozenset(q for k in held for q in (slot_queue(name, k), holder_queue(name, k)))
        counter.reset(names)
        samples, _, cpu_s = timed_cycles(op, budget, meter, lambda: counter.reset(names))
    stats = summarize_reps(samples)
    n = sum(len(r) for r in samples)
    cpu = {k: ms(v / n) for k, v in cpu_s.items()}
    return {
        "capacity": capacity,
        "slot": free,
        **stats,
        "probes_sent": round(counter.queues / n),
        "probe_round_trips": round(counter.calls / n, 1),
        "held_probes": round(counter.held / n),
        "windows": counter.last_sizes,
        "cpu_per_acquire_ms": cpu,
        "setup_s": round(setup, 2),
        "samples_ms": [ms(x) for r in samples for x in r],
    }


def search_sweep(
    url: str,
    capacities: list[int],
    budget_for: Callable[[int, int], Budget],
    broker_pid: int | None,
    rtt_ms: float,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Acquire latency with C-1 of C slots held; the free slot last (worst) or first."""
    rows: list[dict[str, Any]] = []
    counter = ProbeCounter()
    with Broker(url) as broker, counter.installed():
        for capacity in capacities:
            name = unique_name(f"c{capacity}")
            admin = SemaphoreAdmin(broker, name)
            admin.create(capacity)
            sem = PersistentSemaphore(broker, name)
            positions = {"last": capacity} if capacity == 1 else {"last": capacity, "first": 1}
            try:
                for position, free in positions.items():
                    row = _search_cell(
                        url,
                        name,
                        sem,
                        capacity,
                        free,
                        budget_for(capacity, free),
                        broker_pid,
                        counter,
                    )
                    row["free_slot"] = position
                    row["p50_x_rtt"] = round(row["p50_ms"] / rtt_ms, 1)
                    rows.append(row)
                    log(
                        f"  C={capacity:<5} free={position:<5} p50={row['p50_ms']:.2f} ms "
                        f"p99={row['p99_ms']:.2f} ms n={row['n']} probes={row['probes_sent']}"
                    )
            finally:
                admin.destroy(purge_fence=True)
    # C=1 has one slot, first and last alike: it is the reference of both series.
    ref = next(r for r in rows if r["capacity"] == capacities[0])
    for r in rows:
        r["p50_x_c1"] = round(r["p50_ms"] / ref["p50_ms"], 1)
        r["p99_x_c1"] = round(r["p99_ms"] / ref["p99_ms"], 1)
        # What each extra probe costs client + broker, and each held-slot probe costs the
        # holders (when their consumers receive and discard it).
        cpu = r["cpu_per_acquire_ms"]
        # Against the free-slot-first cell of the same C: same holders, same semaphore.
        base = next(
            (x for x in rows if x["capacity"] == r["capacity"] and x["free_slot"] == "first"), ref
        )
        base_cpu = base["cpu_per_acquire_ms"]["client"] + base["cpu_per_acquire_ms"]["broker"]
        extra = r["probes_sent"] - base["probes_sent"]
        r["marginal_cpu_per_probe_us"] = (
            round(1000 * (cpu["client"] + cpu["broker"] - base_cpu) / extra, 1)
            if extra >= 100
            else None
        )
        r["holder_cpu_per_held_probe_us"] = (
            round(1000 * cpu["holders"] / r["held_probes"], 1) if r["held_probes"] >= 100 else None
        )
    return rows
