"""A Celery app whose tasks hold locks on the RabbitMQ Celery already uses.

Run it with ``run.sh`` (README.md): it starts a private RabbitMQ node, a worker with four
prefork children, and sends the tasks below. The lock broker is ``broker_url`` (AMQP), so
there is nothing else to configure.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from amqp_locks.celery import Singleton

app = Celery("example", broker=os.environ.get("AMQP_URL", "amqp://guest:guest@localhost//"))
app.conf.update(result_backend="rpc://", broker_connection_retry_on_startup=True)


@app.task(base=Singleton, bind=True, lock_key=["report_id"], on_conflict="skip")
def build_report(self: Singleton, report_id: int) -> str:
    """One build per report at a time; a second request while one runs is skipped."""
    assert self.lock is not None
    time.sleep(1.0)
    return f"report {report_id} built (fencing token {self.lock.fencing_token})"


@app.task(base=Singleton, lock_key=lambda *a, **k: "partner-api", lock_limit=3)
def call_partner(order_id: int) -> str:
    """At most three calls to the partner's API at once, whatever the order."""
    time.sleep(0.5)
    return f"order {order_id} sent"


@app.task(base=Singleton, once=True, lock_key=["index"])
def reindex(index: str) -> str:
    """Never queued twice: apply_async raises AlreadyQueued while one is queued or runs."""
    time.sleep(1.0)
    return f"{index} reindexed"
