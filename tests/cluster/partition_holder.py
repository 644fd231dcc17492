"""A lock holder beside node 1, inside the partition harness's namespace (its own process).

``python -m tests.cluster.partition_holder URL NAME KIND NET_TICKTIME SETUP``
(NET_TICKTIME ``0``: not given, as a client not told the nodes' setting): connects to
node 1 only, in cluster mode, sets the lock up when SETUP is ``1`` (so node 1 leads its
queues), acquires, prints ``HELD <token>``, and when the lease is lost prints
``LOST <CLOCK_MONOTONIC seconds> <reason>`` (one clock for every process on the machine,
whatever its network namespace), then exits.
"""

from __future__ import annotations

import sys
import threading
import time

from amqp_locks import Broker

from .locks import set_up, take


def main(url: str, name: str, kind: str, net_ticktime: str, setup: str) -> None:
    # "0": a client not told the nodes' net_ticktime (the library's defaults).
    tick = float(net_ticktime) or None
    broker = Broker(url, cluster=True, heartbeat=5, net_ticktime=tick)
    if setup == "1":
        set_up(broker, kind, name)
    lease = take(broker, kind, name, 60).lease
    told = threading.Event()
    lease.on_lost(lambda _l: told.set())
    print(f"HELD {lease.fencing_token}", flush=True)
    lease.lost.wait()
    at = time.monotonic()
    print(f"LOST {at:.6f} {lease.lost_reason}", flush=True)
    told.wait(5)
    broker.close()


if __name__ == "__main__":
    main(*sys.argv[1:6])
