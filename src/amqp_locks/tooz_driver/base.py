"""What every part of the driver stands on: the coordinator's connection (one
:class:`amqp_locks.Broker`), tooz's executor, group mutexes and the snapshot transaction."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar, cast

import tooz
from tooz import coordination, utils

from .. import Broker, Lease, Mutex
from ..errors import AmqpLocksError, ConfigurationError, QueueNotFound
from ..transport.session import Session
from ..transport.wire import AbstractChannel
from .names import as_bytes, broker_urls, encode_id, tooz_name
from .snapshot import Members, finish_snapshot, read_snapshot, translated

T = TypeVar("T")


class DriverBase(
    coordination.CoordinationDriverCachedRunWatchers,
    coordination.CoordinationDriverWithExecutor,
):
    """The connection's life cycle and the plumbing the groups and leaders share."""

    def __init__(self, member_id: bytes, parsed_url: Any, options: dict[str, Any]) -> None:
        super().__init__(as_bytes(member_id), parsed_url, options)
        self._urls = broker_urls(parsed_url)
        self._heartbeat = float(self._options.get("heartbeat", 10.0))
        self._connect_timeout = float(self._options.get("connect_timeout", 10.0))
        self._lock_timeout = float(self._options.get("lock_timeout", 30.0))
        self._broker: Broker | None = None
        #: Member queues this connection owns: group id -> queue name.
        self._member_queues: dict[bytes, str] = {}
        #: Groups this coordinator leads: group id -> the leader mutex's lease.
        self._leaders: dict[bytes, Lease] = {}

    # --- life cycle ------------------------------------------------------------------------

    @property
    def broker(self) -> Broker:
        if self._broker is None:
            raise tooz.ToozError("the coordinator is not started")
        return self._broker

    def _start(self) -> None:
        try:
            broker = Broker(
                self._urls,
                heartbeat=self._heartbeat,
                connect_timeout=self._connect_timeout,
                connection_name=f"tooz member={encode_id(self._member_id)}",
            )
        except ConfigurationError as exc:
            utils.raise_with_cause(tooz.ToozError, str(exc), cause=exc)
        try:
            broker.connect()
        except AmqpLocksError as exc:
            broker.close()
            utils.raise_with_cause(coordination.ToozConnectionError, str(exc), cause=exc)
        self._broker = broker
        self._member_queues = {}
        self._leaders = {}

    def stop(self) -> None:
        """Leave the joined groups, stand down, close the connection.

        As tooz's executor base class, except that the idle worker thread is not waited
        for (futurist's worker notices the shutdown only after a 1 s idle poll): every
        submitted call has finished by then, because leaving waits for its results."""
        coordination.CoordinationDriver.stop(self)
        executor, self._executor.executor = self._executor.executor, None
        self._executor.started = False
        if executor is not None:
            executor.shutdown(wait=False)

    def _close_broker(self) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            broker.close()  # every lock held through it is released by the broker
        self._member_queues = {}
        self._leaders = {}

    # --- plumbing --------------------------------------------------------------------------

    async def session(self) -> Session:
        """The Broker's live session (the hook into amqp-locks' transport; see the report
        in docs/tooz.md: a public ``Broker.run``/``channel`` would replace it)."""
        return await self.broker.core.session()

    def run(self, coro: Awaitable[T]) -> T:
        async def go() -> T:
            return await coro

        return self.broker.core.run(go())

    def on_session(self, op: Callable[[Session], Awaitable[T]]) -> T:
        """``op(session)`` on the Broker's loop: one queue operation outside a snapshot."""

        async def go() -> T:
            return await op(await self.session())

        return self.broker.core.run(go())

    def _submit(self, fn: Callable[[], T]) -> coordination.CoordinatorResult[T]:
        fut: futures.Future[T] = self._executor.submit(fn)
        return coordination.CoordinatorResult(fut, failure_translator=translated)

    @contextlib.contextmanager
    def _held(self, name: str) -> Iterator[None]:
        lease = Mutex(self.broker, name, fencing=False).acquire(timeout=self._lock_timeout)
        if lease is None:
            raise coordination.OperationTimedOut(
                f"mutex {name!r} still held by another coordinator after {self._lock_timeout}s"
            )
        try:
            yield
        finally:
            lease.release()

    def _txn(
        self,
        queue: str,
        fn: Callable[[Session, dict[str, Any]], Awaitable[tuple[bool, T]]],
        missing: Callable[[], Exception],
    ) -> T:
        """Read the snapshot in `queue`, let `fn` look (and change it: True), write it back.
        The caller holds the queue's mutex. `missing()` is raised if the queue is gone."""

        async def go() -> T:
            session = await self.session()

            async def body(ch: AbstractChannel) -> tuple[T | None, BaseException | None]:
                snap, last = await read_snapshot(ch, queue)
                state = snap if snap is not None else {"v": 0}
                try:
                    changed, result = await fn(session, state)
                except tooz.ToozError as exc:
                    await finish_snapshot(ch, queue, last, None)
                    return None, exc
                if changed:
                    state["v"] = int(state.get("v", 0)) + 1
                await finish_snapshot(ch, queue, last, state if changed else None)
                return result, None

            try:
                result, error = await session.call(queue, body)
            except QueueNotFound as exc:
                if exc.queue == queue:
                    raise missing() from None
                raise
            if error is not None:
                raise error
            return cast(T, result)  # None only together with an error

        return self.run(go())

    def _group_txn(
        self,
        group_id: bytes,
        fn: Callable[[Session, Members], Awaitable[tuple[bool, T]]],
    ) -> T:
        async def on_members(session: Session, state: dict[str, Any]) -> tuple[bool, T]:
            members = Members(state)
            changed, result = await fn(session, members)
            if changed:
                members.store()
            return changed, result

        with self._held(tooz_name(group_id, "group-lock")):
            return self._txn(
                tooz_name(group_id, "group"),
                on_members,
                lambda: coordination.GroupNotCreated(group_id),
            )

    async def _live(
        self, session: Session, group_id: bytes, members: Members
    ) -> tuple[bool, set[bytes]]:
        """Probe every recorded member's queue; drop records whose queue is gone."""
        ids = list(members.records)
        alive = await session.probe([tooz_name(group_id, "member", m) for m in ids])
        live = {m for m, ok in zip(ids, alive, strict=True) if ok}
        stale = [m for m in ids if m not in live]
        for m in stale:
            del members.records[m]
        return bool(stale), live
