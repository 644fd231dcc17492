"""A producer process for the dedup tests: at a given wall-clock time, try to enqueue
``once(key, seconds)`` a number of times; print how many were sent and refused (JSON).

``python -m tests.celery.produce KEY SECONDS TRIES START_AT`` with the worker's
environment (CELERY_TEST_BROKER, CELERY_TEST_QUEUE).
"""

from __future__ import annotations

import json
import os
import sys
import time

from .app import app, once


def main() -> None:
    key, seconds, tries, start_at = (
        sys.argv[1],
        float(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
    )
    app.conf.broker_url = os.environ["CELERY_TEST_BROKER"]
    once.broker.connect()  # connected before the start line, as a running producer is
    with app.producer_or_acquire():
        pass
    time.sleep(max(0.0, start_at - time.time()))
    sent: list[tuple[str, float]] = []  # (task id, wall-clock time its claim had returned)
    refused = 0
    for _ in range(tries):
        result = once.apply_async((key, seconds), once_graceful=True)
        if result is None:
            refused += 1
        else:
            sent.append((result.id, time.time()))
    print(json.dumps({"sent": sent, "refused": refused}))


if __name__ == "__main__":
    main()
