"""Client connections lost while an administrator removes and re-adds a persistent
semaphore's top slot (docs/protocol.md, "Known gaps": quorum slots removed while in use).

    python -m benchmarks.slot_churn [--rabbitmq 4.3] [--quorum] [--seconds 30] [--grace S]

CLIENTS threads, each with its own Broker, loop ``acquire(blocking=False)`` /
``release(wait=True)`` on a semaphore of SLOTS slots while this process removes and
re-adds the top slot as fast as it can. A client's connection counts as lost when its
Broker's session at the end is not the one it started with (the broker closed it; the
library reconnected). With quorum slots RabbitMQ closes a connection whose probe or watch
meets the slot's queue while it is deleted (measured 2026-11-30: 3.10.8 and 4.3.6), which
the library's burial of quorum slots (semaphore/burial.py) keeps clients from doing. Each
quorum removal waits the burial grace (10 s); ``--grace`` shortens it (and the clients'
look freshness to half of it) so that a run makes more removals.
On a private node of its own (``amqplockschurn``), stopped at the end.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from dataclasses import dataclass, field

from amqp_locks import Broker, PersistentSemaphore, SemaphoreAdmin
from amqp_locks.semaphore import burial
from amqp_locks_dev import devbroker

NODE = "amqplockschurn"
CLIENTS = 4
SLOTS = 4


@dataclass
class Churn:
    """What one run saw."""

    name: str = ""  # the semaphore's
    rounds: int = 0
    grants: list[int] = field(default_factory=list)  # per client
    #: Clients whose connection was replaced: why their first one ended (the broker's
    #: close, as the library logged it).
    lost: dict[int, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _client(url: str, name: str, stop: float, index: int, out: Churn) -> None:
    try:
        with Broker(url) as broker:
            first = broker.core.run(broker.core.session())
            sem = PersistentSemaphore(broker, name)
            grants = 0
            while time.monotonic() < stop:
                try:
                    lease = sem.acquire(blocking=False)
                except Exception as exc:  # a lost connection surfaces here: counted below
                    out.errors.append(f"client {index}: {exc!r}"[:300])
                    continue
                if lease is not None:
                    grants += 1
                    lease.release(wait=True)
            out.grants.append(grants)
            last = broker.core.run(broker.core.session())
            if last is not first or not first.alive:
                out.lost[index] = first.lost_reason or "replaced"
    except Exception as exc:
        out.errors.append(f"client {index}: {exc!r}"[:300])
        out.lost[index] = f"{exc!r}"[:300]


def churn(url: str, quorum: bool, seconds: float) -> Churn:
    """One run against the broker at `url` (see the module docstring)."""
    name = f"churn-{uuid.uuid4().hex[:8]}"
    out = Churn(name=name)
    with Broker(url) as admin_broker:
        admin = SemaphoreAdmin(admin_broker, name, quorum=quorum)
        admin.create(SLOTS)
        stop = time.monotonic() + seconds
        threads = [
            threading.Thread(target=_client, args=(url, name, stop, i, out)) for i in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        try:
            while time.monotonic() < stop:
                admin.remove_slots(1)
                admin.add_slots(1)
                out.rounds += 1
        finally:
            for t in threads:
                t.join()
            admin.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rabbitmq", choices=devbroker.VERSIONS, default=None)
    parser.add_argument("--quorum", action="store_true", help="quorum slot queues")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--grace", type=float, default=burial.BURY_GRACE, help="burial grace")
    args = parser.parse_args()
    burial.BURY_GRACE, burial.LOOK_FRESH = args.grace, args.grace / 2
    version = devbroker.check_version(args.rabbitmq or devbroker.default_version())
    info = devbroker.start(NODE, version=version)
    try:
        out = churn(info.url, args.quorum, args.seconds)
    finally:
        devbroker.stop(NODE, version=version)
    kind = "quorum" if args.quorum else "classic"
    print(
        f"RabbitMQ {version}, {kind} slots, burial grace {args.grace:g} s, "
        f"{args.seconds:.0f} s: {out.rounds} remove/add "
        f"rounds, {sum(out.grants)} grants, client connections lost: {len(out.lost)} of "
        f"{CLIENTS}"
    )
    for line in out.errors[:3] + list(out.lost.values())[:3]:
        print("  ", line)


if __name__ == "__main__":
    main()
