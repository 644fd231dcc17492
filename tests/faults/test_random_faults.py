"""Many holders under seeded random faults for a bounded time (see `chaos.py`).

The seed is printed and recorded; ``AMQP_LOCKS_FAULT_SEED=N`` replays a plan,
``AMQP_LOCKS_SOAK_SECONDS`` sets the soak's length per primitive (default 120).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from . import primitives, report
from .chaos import Chaos, seed_from_env
from .run import FaultRun

Make = Callable[..., FaultRun]
HB = 1.0


def random_run(make: Make, kind: str, *, duration: float, holders: int) -> dict[str, object]:
    seed = seed_from_env()
    replay = f"replay: AMQP_LOCKS_FAULT_SEED={seed}"
    print(f"\nrandom faults on {kind} for {duration:.0f}s, seed {seed} ({replay})")
    run = make(kind, permits=1 if kind == "mutex" else 2, heartbeat=HB)
    chaos = Chaos(run, seed, duration, holders)
    ended = chaos.execute()
    run.wait(  # live again once the faults are over
        lambda: any(e.kind == "grant" and e.t > ended for e in run.events()),
        30,
        f"a grant after the faults ({replay})",
    )
    run.stop()
    leaked = primitives.leaked(run.kind, run.url, run.name, run.permits)
    full, promised, figures = chaos.judge(leaked)
    report.record("random", kind, full, **figures)
    summary = (
        f"{replay}\nfull: {full.summary()}\npromised: {promised.summary()}\n{figures}\n"
        f"faults: {run.dir / 'faults.jsonl'}, history: {run.history}"
    )
    assert sum(chaos.applied.values()) >= 1, summary
    assert (full.stale_accepted, full.token_regressions) == (0, 0), summary
    assert (promised.overlaps, promised.key_overlaps) == (0, 0), summary
    assert promised.min_margin is None or promised.min_margin > 0, summary
    assert figures["reset_detection_max"] is None or figures["reset_detection_max"] < 1.0
    assert full.leaked == 0, summary
    return figures


@pytest.mark.slow
def test_random_faults_briefly(fault_run: Make) -> None:
    """A quick look: one primitive, a few seconds (`-m slow -k briefly`)."""
    random_run(fault_run, "semaphore", duration=8.0, holders=4)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", primitives.KINDS)
def test_random_faults_soak(fault_run: Make, kind: str) -> None:
    duration = float(os.environ.get("AMQP_LOCKS_SOAK_SECONDS", "120"))
    start = time.monotonic()
    random_run(fault_run, kind, duration=duration, holders=6)
    assert time.monotonic() - start < duration + 300  # it stops by itself
