"""How long a quorum queue has no leader after its leader's node is SIGKILLed, as a client
on a surviving node sees it: the time from the kill to the first answered ``basic.get``
(docs/cluster.md, "Riding out a node's loss"). This is what a holder on a surviving node
must outlast: the quorum guard drops a connection whose held lock's leader does not
answer within ``quorum_timeout``.

Raw aiormq against a private 3-node cluster of the chosen line; each trial declares a
fresh quorum queue through node 1 (so node 1 leads it), kills node 1, asks through node 2
every ``POLL`` seconds (a ``basic.get`` that meets no leader closes the whole connection,
541, so each failed ask reconnects), then restarts node 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiormq

from amqp_locks_dev import devcluster

NAME = "amqplockselection"
#: Seconds between asks after the kill.
POLL = 0.05
#: Give up on a trial after this many seconds.
LIMIT = 30.0


async def _ask(url: str, queue: str) -> bool:
    """One ``basic.get`` through a new connection: True when the queue's leader answered."""
    try:
        conn = await asyncio.wait_for(aiormq.connect(url), 5)
    except Exception:
        return False
    try:
        ch = await conn.channel()
        await asyncio.wait_for(ch.basic_get(queue, no_ack=True), 5)
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), 2)


async def _trial(info: devcluster.ClusterInfo, base: Path, queue: str) -> float | None:
    conn = await aiormq.connect(info.urls[0])
    ch = await conn.channel()
    await ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    assert await _ask(info.urls[1], queue), "the queue answers before the kill"
    killed = time.monotonic()
    assert devcluster.kill_node(NAME, 1, base)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(conn.close(), 1)
    while time.monotonic() - killed < LIMIT:
        if await _ask(info.urls[1], queue):
            return round(time.monotonic() - killed, 3)
        await asyncio.sleep(POLL)
    return None


def run(version: str, trials: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Seconds without a leader per trial (None: none within :data:`LIMIT`)."""
    os.environ["AMQP_LOCKS_RABBITMQ"] = version
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)  # each 541 it expects, traced
    seconds: list[float | None] = []
    with tempfile.TemporaryDirectory(prefix="amqp-locks-election-") as tmp:
        base = Path(tmp)
        info = devcluster.start(NAME, 3, base)
        try:
            for i in range(trials):
                took = asyncio.run(_trial(info, base, f"election-{os.getpid()}-{i}"))
                log(f"trial {i + 1}: first answer {took} s after the kill")
                seconds.append(took)
                devcluster.start_node(NAME, 1, base)
        finally:
            devcluster.stop(NAME, base)
    done = [s for s in seconds if s is not None]
    return {
        "version": version,
        "trials": trials,
        "seconds": seconds,
        "min": min(done, default=None),
        "max": max(done, default=None),
        "load": os.getloadavg(),
    }
