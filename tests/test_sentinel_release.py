"""A release that overtakes its own sentinel's set-up (mutex, persistent semaphore).

A grant does not wait for its sentinel (queue_lease.hold_sentinel runs beside it): a hold
shorter than the sentinel's consume round trip, as the CLI's administration commands make
on a loaded machine, is released while the sentinel's channel is still being set up. The
sentinel's channel must then have one owner: once it closed that channel in the set-up
while the release handed it back to the session's ready channels too, and the next lease
took a closing channel as its watch channel and was lost at once ("watch channel closed";
CLI rehearsal 53, `semaphore add` exit 69). Now the set-up cleans it as every release does
(cancel, ack) and hands it back, once, and nothing closes it.

The interleaving is forced, not waited for: the sentinel's consume returns only once the
release has begun, and the release's delete goes out only once the set-up has ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from amqp_locks import Broker, Mutex, PersistentSemaphore, SemaphoreAdmin, queue_lease
from amqp_locks.names import sentinel_queue
from amqp_locks.transport.session import Session
from amqp_locks.transport.shield import closing

from .conftest import on_session, settle

KINDS = {"mutex": "mutex", "semaphore": "sem"}


class Overtake:
    """Patches that make the release begin while the sentinel's consume is answered, and
    record what becomes of the sentinel's channel."""

    def __init__(self, sentinels: str) -> None:
        self.sentinels = sentinels
        self.hold: asyncio.Task[Any] | None = None
        self.channel: Any = None
        self.parked = asyncio.Event()
        self.delivered = asyncio.Event()
        self.releasing = asyncio.Event()
        self.released = asyncio.Event()
        self.overtaken = False
        #: Channels queue_lease closed, and channels handed back to the ready pool.
        self.closed: list[Any] = []
        self.recycled: list[Any] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        consume, delete = queue_lease.consume_at, Session.delete_and_notify
        close, recycle = queue_lease.close_quietly, Session.recycle_ready

        async def consume_at(ch: Any, queue: str, on_message: Any, **kw: Any) -> str:
            if queue != self.sentinels or self.hold is not None:
                return await consume(ch, queue, on_message, **kw)

            async def hold(message: Any) -> None:
                await on_message(message)
                self.delivered.set()

            tag = await consume(ch, queue, hold, **kw)
            self.hold, self.channel = asyncio.current_task(), ch
            self.parked.set()
            await self.releasing.wait()  # returns into a lease already being released
            return tag

        async def delete_and_notify(session: Session, *args: Any, **kw: Any) -> Any:
            if self.hold is not None and not self.releasing.is_set():
                self.releasing.set()
                await asyncio.wait({self.hold})  # the set-up sees the release, then ends
                await self.delivered.wait()  # and the sentinel is ours, as under load
                self.overtaken = True
                try:
                    return await delete(session, *args, **kw)
                finally:
                    self.released.set()  # the release's clean-up runs before anyone wakes
            return await delete(session, *args, **kw)

        async def close_quietly(ch: Any) -> None:
            self.closed.append(ch)
            if ch is self.channel:  # its close goes out after the release's clean-up,
                await self.released.wait()  # as it did under load (frames of rehearsal 53)
            await close(ch)

        def recycle_ready(session: Session, ch: Any, clean: Any) -> None:
            self.recycled.append(ch)
            recycle(session, ch, clean)

        monkeypatch.setattr(queue_lease, "consume_at", consume_at)
        monkeypatch.setattr(queue_lease, "close_quietly", close_quietly)
        monkeypatch.setattr(Session, "delete_and_notify", delete_and_notify)
        monkeypatch.setattr(Session, "recycle_ready", recycle_ready)


def _lock(broker: Broker, kind: str, name: str) -> Mutex | PersistentSemaphore:
    if kind == "mutex":
        return Mutex(broker, name, fencing=False)
    return PersistentSemaphore(broker, name)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_release_during_the_sentinels_set_up_leaves_no_closing_channel_in_the_pool(
    broker: Broker, name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "semaphore":
        SemaphoreAdmin(broker, name).create(1)
    overtake = Overtake(sentinel_queue(name, KINDS[kind]))
    overtake.install(monkeypatch)

    lease = _lock(broker, kind, name).acquire(timeout=10)
    assert lease is not None
    # The sentinel's consume is answered and its task parked before the release.
    on_session(broker, lambda _: asyncio.wait_for(overtake.parked.wait(), 10))
    lease.release(wait=True)
    assert overtake.overtaken, "the release did not overtake the sentinel's set-up"
    settle(broker)  # the channels' clean-up and closes have run
    # The sentinel's channel had one owner: cleaned and handed back once, never closed.
    assert overtake.recycled.count(overtake.channel) == 1
    assert overtake.channel not in overtake.closed

    async def pool(session: Session) -> list[Any]:
        await session.probe([name])  # one more round trip: any close-ok is in by now
        return [ch for ch in session._ready if closing(ch)]

    assert on_session(broker, pool) == []
    monkeypatch.undo()
    # The next lease on this connection keeps its lock.
    again = _lock(broker, kind, name).acquire(timeout=10)
    assert again is not None
    assert again.verify() and not again.lost.is_set(), again.lost_reason
    again.release(wait=True)
