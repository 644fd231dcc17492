"""A seeded run of many holders under random faults, for a bounded time.

The seed fixes the whole fault plan up front (:func:`plan`: when, which holder, what,
how long), so a failing seed replays the same faults (``AMQP_LOCKS_FAULT_SEED``); process
scheduling still varies between runs. Faults: SIGKILL (the holder is replaced by a new
one), SIGSTOP for a short or a long time, a blackhole of the holder's proxy for a short or
a long time, a connection reset, added latency.

Faults strike a holder that holds the lock at that moment when the plan says so (most of
them), else the plan's slot: faults on idle waiters test little.

Judging: the design promises nothing for a paused process, so each grant's belief is cut
at the moment its holder was first paused while holding (what it does after it resumes is
fencing's business: stale writes must all be refused). A reset is seen by both ends at the
same instant, so the old holder may take its few milliseconds to process it while the
broker hands the lock on: beliefs are cut at a reset too, and the time the holder took to
learn is reported instead. On the cut ("promised") beliefs there must be no overlap at all;
on the full history no stale write may be accepted and no token regress.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .checker import Verdict, check, intervals
from .history import open_grants
from .holders import Holder
from .run import FaultRun

ACTIONS = ("kill", "pause", "blackhole", "reset", "delay")
WEIGHTS = (2, 3, 3, 2, 1)


def seed_from_env() -> int:
    """``$AMQP_LOCKS_FAULT_SEED``, else a fresh random seed (printed by the caller)."""
    raw = os.environ.get("AMQP_LOCKS_FAULT_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(2**32)


@dataclass(frozen=True)
class Step:
    at: float
    action: str
    slot: int
    length: float = 0.0
    amount: float = 0.0
    #: Strike a holder that holds the lock now, if there is one (else `slot`).
    at_holder: bool = True


def plan(seed: int, duration: float, slots: int, heartbeat: float) -> list[Step]:
    """The faults of a run: one every 0.3-1.5 s; pauses and blackholes are short (under half
    a heartbeat: nobody should notice) or long (3-4 heartbeats: the broker re-grants)."""
    rng = random.Random(seed)
    steps: list[Step] = []
    t = rng.uniform(1.0, 2.0)
    while t < duration:
        action = rng.choices(ACTIONS, WEIGHTS)[0]
        slot = rng.randrange(slots)
        length = amount = 0.0
        if action in ("pause", "blackhole"):
            long = rng.random() < 0.5
            length = (
                rng.uniform(3.0, 4.0) * heartbeat if long else rng.uniform(0.1, 0.4) * heartbeat
            )
        elif action == "delay":
            length, amount = rng.uniform(1.0, 3.0), rng.uniform(0.005, 0.1)
        at_holder = rng.random() < 0.8
        steps.append(Step(round(t, 3), action, slot, round(length, 3), round(amount, 4), at_holder))
        t += rng.uniform(0.3, 1.5)
    return steps


@dataclass
class Chaos:
    run: FaultRun
    seed: int
    duration: float
    slots: int
    steps: list[Step] = field(default_factory=list)
    current: dict[int, str] = field(default_factory=dict)
    generation: dict[int, int] = field(default_factory=dict)
    _undo: list[tuple[float, Any]] = field(default_factory=list)
    applied: dict[str, int] = field(default_factory=dict)
    #: Every fault as applied: time, worker struck, the plan's step.
    log: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.steps = plan(self.seed, self.duration, self.slots, self.run.heartbeat)
        self._rng = random.Random(self.seed ^ 0x5EED)

    def _spawn(self, slot: int) -> Holder:
        gen = self.generation.get(slot, -1) + 1
        self.generation[slot] = gen
        worker = f"s{slot}g{gen}"
        self.current[slot] = worker
        # Short holds hand the lock on often; long ones outlast a partition's detection
        # (about one heartbeat), so the watchdog and the broker race for real.
        long = self._rng.random() < 0.5
        hold = round(self._rng.uniform(1.5, 4.0) if long else self._rng.uniform(0.2, 0.6), 3)
        rest = round(self._rng.uniform(0.0, 0.2), 3)
        return self.run.holder(worker, proxied=True, hold=hold, rest=rest)

    def execute(self) -> float:
        """Start the holders, play the plan, undo every fault; returns when faults ended."""
        for slot in range(self.slots):
            self._spawn(slot)
        start = time.monotonic()
        for step in self.steps:
            self._until(start + step.at)
            self._apply(step)
        while self._undo:
            self._until(min(due for due, _ in self._undo))
        for proxy in self.run.proxies.values():
            proxy.passthrough()
        for h in self.run.holders.values():
            if h.paused and h.alive:
                h.resume()
        return time.monotonic()

    def _until(self, when: float) -> None:
        """Sleep until `when` (the plan's clock), undoing faults whose time has come."""
        while True:
            now = time.monotonic()
            for item in sorted(self._undo, key=lambda u: u[0]):
                if item[0] <= now:
                    self._undo.remove(item)
                    item[1]()
            if now >= when:
                return
            nxt = min([when, *(due for due, _ in self._undo)])
            time.sleep(max(0.0, min(nxt - now, 0.05)))

    def _target(self, step: Step) -> int:
        if step.at_holder:
            holding = open_grants(self.run.events(), "")
            slots = sorted(
                slot
                for slot, worker in self.current.items()
                if any(g.grant.startswith(f"{worker}#") for g in holding)
            )
            if slots:
                return slots[step.slot % len(slots)]
        return step.slot

    def _apply(self, step: Step) -> None:
        slot = self._target(step)
        worker = self.current[slot]
        h = self.run.holders[worker]
        proxy = self.run.proxies[worker]
        now = time.monotonic()
        if not h.alive:
            return
        self.log.append({"t": now, "worker": worker, **asdict(step)})
        if step.action == "kill":
            self.run.kill(worker)
            proxy.passthrough()
            self._spawn(slot)
        elif step.action == "pause":
            if h.paused:
                return
            h.pause()
            self._undo.append((now + step.length, lambda: h.resume() if h.alive else None))
        elif step.action == "blackhole":
            proxy.blackhole()
            self._undo.append((now + step.length, proxy.heal))
        elif step.action == "reset":
            proxy.reset()
            h.faults.append((now, "reset"))
        elif step.action == "delay":
            proxy.delay(step.amount)
            self._undo.append((now + step.length, lambda: proxy.delay(0)))
        self.applied[step.action] = self.applied.get(step.action, 0) + 1

    # --- judging --------------------------------------------------------------------

    def paused_at(self) -> dict[str, list[tuple[float, float]]]:
        """Per worker, the intervals it spent stopped."""
        out: dict[str, list[tuple[float, float]]] = {}
        for worker, h in self.run.holders.items():
            spans, began = [], None
            for t, what in h.faults:
                if what == "pause" and began is None:
                    began = t
                elif what in ("resume", "kill") and began is not None:
                    spans.append((began, t))
                    began = None
            if began is not None:
                spans.append((began, float("inf")))
            out[worker] = spans
        return out

    def judge(self, leaked: int | None) -> tuple[Verdict, Verdict, dict[str, Any]]:
        """(full verdict, verdict on the promised beliefs — cut at each holder's first pause
        or reset while holding —, figures)."""
        events = self.run.events()
        end = time.monotonic()
        pauses = self.paused_at()
        cut: dict[str, float] = {}
        reset_detection: list[float] = []
        for i in intervals(events, end):
            worker = i.grant.split("#")[0]
            faults = self.run.holders[worker].faults if worker in self.run.holders else []
            paused = [a for a, b in pauses.get(worker, []) if b > i.start and a < i.end]
            resets = [t for t, what in faults if what == "reset" and i.start <= t < i.end]
            frozen = resets and any(a <= min(resets) < b for a, b in pauses.get(worker, []))
            if resets and i.ended_by == "lost" and not frozen:  # a paused one learns on resume
                reset_detection.append(i.end - min(resets))
            if paused or resets:
                cut[i.grant] = max(i.start, min(paused + resets))
        log = self.run.fenced.log
        full = check(events, log, permits=self.run.permits, run_end=end, leaked=leaked)
        promised = check(events, log, permits=self.run.permits, run_end=end, cut=cut)
        unfenced = check(events, self.run.unfenced.log, permits=self.run.permits, run_end=end)
        (self.run.dir / "faults.jsonl").write_text(
            "".join(json.dumps(entry) + "\n" for entry in self.log)
        )
        figures = {
            "seed": self.seed,
            "duration": self.duration,
            "holders": self.slots,
            "faults": dict(self.applied),
            "grants_cut": len(cut),
            "lost_events": sum(1 for e in events if e.kind == "lost"),
            "promised_overlaps": promised.overlaps,
            "promised_key_overlaps": promised.key_overlaps,
            "promised_min_margin": promised.min_margin,
            "promised_margins": len(promised.margins),
            "reset_detection_max": max(reset_detection, default=None),
            "full_overlap_seconds": full.overlap_seconds,
            "stale_refused": full.rejected,
            "stale_accepted_unfenced": unfenced.stale_accepted,
        }
        return full, promised, figures
