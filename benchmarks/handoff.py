"""Our one-permit locks (``peers.kinds.OURS``) through the comparison's code: handoff, the
same with the releaser asking again at once (re-ask), holder kill -9, and the fairness loop.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import dataclass
from typing import Any

from .compare import chain, crash_series, loop
from .stats import fairness_summary, ms, summarize_reps

LOCKS = ("token", "token_nofence", "mutex", "semaphore")


@dataclass
class Plan:
    reps: int  # handoff repetitions
    samples: int  # handoffs per repetition
    warmup: int  # untimed handoffs first
    settle: float  # seconds the waiter is blocked before the release
    crash_samples: int
    reask_reps: int
    reask_samples: int
    reask_warmup: int
    fair_seconds: float = 10.0
    fair_processes: int = 4
    fair_hold: float = 0.005
    crash_settle: tuple[float, float] = (0.1, 2.5)


def _reps(xs: list[float], reps: int, k: int) -> dict[str, Any]:
    """The summary of ``xs`` cut into ``reps`` repetitions of ``k`` samples."""
    return summarize_reps([xs[i * k : i * k + k] for i in range(reps)], samples=True)


def handoff(url: str, plan: Plan) -> dict[str, Any]:
    """Release -> the blocked waiter's acquire returned, per lock (one permit, two processes)."""
    out: dict[str, Any] = {}
    for kind in ("token", "token_nofence", "token_quorum", "mutex", "semaphore"):
        n, hold = plan.reps * plan.samples, (plan.settle, plan.settle)
        gaps, calls, _ = chain(kind, {"amqp": url}, 1, hold, n, 60 + n * plan.settle, plan.warmup)
        out[kind] = _reps(gaps, plan.reps, plan.samples)
        out[kind]["release_call_p50_ms"] = ms(statistics.median(calls))
    return out


def crash(url: str, plan: Plan) -> dict[str, Any]:
    """kill -9 of the holder -> the blocked waiter's acquire returned, per lock."""
    rng, out = random.Random(4), {}
    for kind in ("token", "mutex", "semaphore"):
        args = (plan.crash_samples, rng.randrange(1 << 30), plan.crash_settle, 90)
        s = out[kind] = crash_series(kind, "default", {"amqp": url}, *args)
        s["errors"] += ["the waiter did not acquire within 90 s of the kill"] * s["censored"]
    return out


def reask(url: str, plan: Plan) -> dict[str, Any]:
    """Release (the other process blocked ``settle`` s) -> whichever ``acquire()`` returns
    first, the releaser asking again at once; how often it won its lock back."""
    out: dict[str, Any] = {}
    n, warmup = plan.reask_reps * plan.reask_samples, plan.reask_warmup
    for kind in LOCKS:
        grants = loop(kind, {"amqp": url}, 1, 2, 60 + n * plan.settle, plan.settle, n + warmup + 1)
        pairs = [(b[2] - a[3], a[0] == b[0]) for a, b in itertools.pairwise(grants)]
        pairs = pairs[warmup:][:n]
        s = out[kind] = _reps([gap for gap, _ in pairs], plan.reask_reps, plan.reask_samples)
        won = [gap for gap, releaser in pairs if releaser]
        s["releaser_won"], s["handoffs"] = len(won), len(pairs)
        s["to_waiter"] = summarize_reps([[gap for gap, releaser in pairs if not releaser]])
        s["to_releaser"] = summarize_reps([won])
    return out


def fairness(url: str, plan: Plan) -> dict[str, Any]:
    """Per lock: processes loop acquire -> hold -> release; ``stats.fairness_summary``."""
    out: dict[str, Any] = {}
    n = plan.fair_processes
    for kind in LOCKS:
        errors: list[str] = []
        try:
            grants = loop(kind, {"amqp": url}, 1, n, plan.fair_seconds, plan.fair_hold)
        except Exception as exc:
            grants, errors = [], [str(exc)]
        s = out[kind] = fairness_summary([[g[1:3] for g in grants if g[0] == i] for i in range(n)])
        s["errors"], s["grants_per_s"] = errors, round(len(grants) / plan.fair_seconds, 1)
    return out
