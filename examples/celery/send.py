"""Send the example's tasks and print what happened (run by ``run.sh``)."""

from __future__ import annotations

import time

from amqp_locks.celery import AlreadyQueued, is_skipped

from .tasks import build_report, call_partner, reindex


def main() -> None:
    # Two builds of report 7 at once: one runs, the other is skipped.
    builds = [build_report.delay(7), build_report.delay(7)]
    for r in builds:
        out = r.get(timeout=60)
        print(
            "build_report(7):", "skipped (another build held the lock)" if is_skipped(out) else out
        )

    # Nine partner calls: three at a time, so about 1.5 s rather than 0.5 s or 4.5 s (with
    # at least 3 worker slots: run.sh starts 4).
    t0 = time.monotonic()
    calls = [call_partner.delay(i) for i in range(9)]
    for r in calls:
        r.get(timeout=60)
    print(f"call_partner x9 with lock_limit=3: {time.monotonic() - t0:.1f} s")

    # The second reindex of "books" is refused while the first is queued or running.
    first = reindex.delay("books")
    try:
        reindex.delay("books")
    except AlreadyQueued as exc:
        print("reindex('books') again:", type(exc).__name__)
    print("reindex('books'):", first.get(timeout=60))


if __name__ == "__main__":
    main()
