"""A producer process for the dedup tests: at a given wall-clock time, try to enqueue
``once(key, seconds)`` a number of times; print what was sent, how many were refused and
how long each try took (JSON).

``python -m tests.celery.produce KEY SECONDS TRIES START_AT [INTERVAL [TASK]]`` with the
worker's environment (CELERY_TEST_BROKER, CELERY_TEST_QUEUE); INTERVAL: seconds from the
start of one try to the next (default 0: back to back); TASK: ``once`` (default) or
``once_late`` (``acks_late``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from . import app as tasks
from .app import app


def main() -> None:
    key, seconds, tries, start_at = (
        sys.argv[1],
        float(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
    )
    interval = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    once = getattr(tasks, sys.argv[6] if len(sys.argv) > 6 else "once")
    app.conf.broker_url = os.environ["CELERY_TEST_BROKER"]
    once.broker.connect()  # connected before the start line, as a running producer is
    with app.producer_or_acquire():
        pass
    time.sleep(max(0.0, start_at - time.time()))
    sent: list[tuple[str, float]] = []  # (task id, wall-clock time its claim had returned)
    refused = 0
    took: dict[str, list[float]] = {"sent": [], "refused": []}  # seconds per try
    next_at = time.monotonic()
    for _ in range(tries):
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at += interval
        t0 = time.monotonic()
        result = once.apply_async((key, seconds), once_graceful=True)
        took["sent" if result is not None else "refused"].append(time.monotonic() - t0)
        if result is None:
            refused += 1
        else:
            sent.append((result.id, time.time()))
    print(json.dumps({"sent": sent, "refused": refused, "took": took}))


if __name__ == "__main__":
    main()
