"""A release of an exclusive-queue lock (mutex, persistent semaphore) is two frames on one
channel, the delete and the wake-up notice (`Session.delete_and_notify`), then the
clean-up of the lease's channels. The holder's connection is cut after each frame it sends
from `release()` on, while another process waits subscribed: the waiter gets the lock every
time, within BOUND, with no operator's help (the broker deletes a dead connection's
exclusive queue and hands its sentinel to the waiter; a notice that went out wakes it)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import pytest

from amqp_locks import Broker, Lease, Mutex, PersistentSemaphore, SemaphoreAdmin
from amqp_locks.transport.session import Session

from .conftest import on_session, settle
from .faultproxy import FaultProxy

#: Seconds from the cut to the waiter's grant: the sentinel's push, or a back-off re-check
#: (at most 1 s), with room for a loaded machine.
BOUND = 10.0

Make = Callable[[Broker, str], "Mutex | PersistentSemaphore"]
KINDS: dict[str, Make] = {
    "mutex": lambda b, n: Mutex(b, n),
    "semaphore": lambda b, n: PersistentSemaphore(b, n),
}


def _subscribed(broker: Broker) -> bool:
    async def ready(session: Session) -> bool:
        return any(w.ready for w in session.waiters)

    return on_session(broker, ready)


def _frames_of_release(proxy: FaultProxy, make: Make, name: str) -> int:
    with contextlib.closing(Broker(proxy.url(), heartbeat=5.0)) as holder:
        lease = make(holder, name).acquire(timeout=10)
        assert lease is not None
        proxy.count_frames()
        lease.release(wait=True)
        settle(holder)  # the clean-up after it (sentinel, watch channel) is sent too
        return proxy.frames_sent


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_cut_of_a_release_lets_the_waiter_in(
    amqp_url: str, amqp_proxy: FaultProxy, name: str, kind: str
) -> None:
    make = KINDS[kind]
    with contextlib.closing(Broker(amqp_url)) as direct:
        if kind == "semaphore":
            SemaphoreAdmin(direct, name).create(1)
        frames = _frames_of_release(amqp_proxy, make, name)
        assert frames >= 4  # the delete, the notice's method, header and body, the clean-up
        took: dict[int, float] = {}
        for n in range(1, frames + 1):
            amqp_proxy.count_frames()  # accept the new holder's connection
            holder = Broker(amqp_proxy.url(), heartbeat=5.0)
            got: dict[str, Lease | None] = {}
            waiter: threading.Thread | None = None
            try:
                lease = make(holder, name).acquire(timeout=10)
                assert lease is not None

                def wait(got: dict[str, Lease | None] = got) -> None:
                    got["lease"] = make(direct, name).acquire(timeout=BOUND + 20)

                waiter = threading.Thread(target=wait)
                waiter.start()
                deadline = time.monotonic() + 10
                while not _subscribed(direct):
                    assert time.monotonic() < deadline, "the waiter never subscribed"
                    time.sleep(0.005)
                amqp_proxy.cut_after(n)
                cut_at = time.monotonic()
                with contextlib.suppress(Exception):  # the cut may fail the release
                    lease.release()
                waiter.join(BOUND + 25)
                took[n] = time.monotonic() - cut_at
                fired = amqp_proxy.fired
            finally:
                holder.close(timeout=1)
                if waiter is not None:
                    waiter.join(30)
            won = got.get("lease")
            assert won is not None, f"cut after release frame {n}: the waiter got nothing"
            assert took[n] <= BOUND, f"cut after release frame {n}: granted after {took[n]:.1f}s"
            won.release(wait=True)
            if not fired:  # the release and its clean-up took fewer frames: all cut points seen
                break
        assert len(took) >= 4, took  # the delete, and the notice's method, header and body
        if kind == "semaphore":
            SemaphoreAdmin(direct, name).destroy()
