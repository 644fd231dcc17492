"""A tooz driver on RabbitMQ: ``[coordination] backend_url = rabbit://user:pass@host:5672/``.

Registered under the ``tooz.backends`` entry point for ``amqp://``, ``amqps://`` and
``rabbit://`` (OpenStack's ``transport_url`` scheme). Install with ``amqp-locks[tooz]``;
this is the only module that imports tooz. docs/tooz.md is the operator's guide.

Every coordinator owns one :class:`amqp_locks.Broker` (one AMQP connection); whatever the
coordinator holds is tied to that connection, so it vanishes when the process dies, like
ZooKeeper's ephemeral nodes:

* a **lock** is an :class:`amqp_locks.ReadWriteLock` named ``tooz.<L>.lock`` (queues
  ``tooz.<L>.lock.rwlock-*``; docs/rwlock.md): an exclusive hold is its write hold, a
  shared hold a read hold. Both are unacknowledged deliveries, returned by the broker the
  moment the holder's connection dies; waiters are consumers, woken by the broker's push.
  Fencing tokens come from ``tooz.<L>.lock-fence``, the counter earlier versions' mutex
  locks used.
* a **group** is the durable queue ``tooz.<G>.group``, holding one snapshot message (the
  member records: id, capabilities, times; the last leader announced). It is read and
  rewritten only under the mutex ``tooz.<G>.group-lock`` (basic.get, then requeue or
  publish-then-ack; a reader picks the highest version, so a crash between the publish and
  the ack loses nothing). The list of groups is the same kind of snapshot in
  ``tooz.groups``, under ``tooz.groups.lock``.
* a **member** is alive while its exclusive queue ``tooz.<G>.member.<M>`` exists. A record
  whose queue is gone (its process died) is not a member; readers drop such records. One
  pipelined round of mandatory publishes checks every member at once.
* the **leader** of a group holds the mutex ``tooz.<G>.leader`` and the exclusive queue
  ``tooz.<G>.leader.<M>``, and writes its id into the group's snapshot; ``get_leader``
  returns that id only while that queue exists.

``<G>``, ``<M>``, ``<L>`` are the ids themselves when they are short and made of letters,
digits, ``_``, ``:`` and ``-``; otherwise ``~`` + hex, or ``#`` + SHA-256 for long ids.

The driver drives the Broker's session directly for the queue operations the public lock
classes do not offer (basic.get of a snapshot, probes, consumer counts); see
``_session`` below.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar, cast

from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp.commands import Basic

from . import Broker, Lease, Mutex, ReadWriteLock
from .extras import unavailable

try:
    import tooz
    from tooz import coordination, locking, utils
except ImportError:  # the extra is not installed
    raise unavailable("the tooz driver (amqp_locks.tooz_driver)", "tooz") from None
from .errors import (
    AmqpLocksError,
    BrokerUnreachable,
    ConfigurationError,
    ConnectionLost,
    QueueNotFound,
    ResourceLocked,
)
from .transport.session import Session

log = logging.getLogger("amqp_locks.tooz")

T = TypeVar("T")

REGISTRY_QUEUE = "tooz.groups"
REGISTRY_LOCK = "tooz.groups.lock"
#: Queues whose existence is a member or a leader: probes are dropped, never stored.
_FLAG_ARGS: dict[str, Any] = {"x-max-length": 0}

_SAFE = re.compile(rb"[A-Za-z0-9_:\-]{1,100}")


def encode_id(ident: bytes | str) -> str:
    """The queue-name form of a tooz id (group, member or lock name)."""
    raw = ident.encode("utf-8") if isinstance(ident, str) else bytes(ident)
    if _SAFE.fullmatch(raw):
        return raw.decode("ascii")
    if len(raw) <= 50:
        return "~" + raw.hex()
    return "#" + hashlib.sha256(raw).hexdigest()


def _as_bytes(ident: bytes | str) -> bytes:
    return ident.encode("utf-8") if isinstance(ident, str) else bytes(ident)


def group_queue(group: bytes) -> str:
    return f"tooz.{encode_id(group)}.group"


def group_lock(group: bytes) -> str:
    return f"tooz.{encode_id(group)}.group-lock"


def member_queue(group: bytes, member: bytes) -> str:
    return f"tooz.{encode_id(group)}.member.{encode_id(member)}"


def leader_lock(group: bytes) -> str:
    return f"tooz.{encode_id(group)}.leader"


def leader_queue(group: bytes, member: bytes) -> str:
    return f"tooz.{encode_id(group)}.leader.{encode_id(member)}"


def lock_name(name: bytes) -> str:
    return f"tooz.{encode_id(name)}.lock"


def broker_urls(parsed_url: Any) -> list[str]:
    """AMQP URLs from a tooz backend URL: ``rabbit://`` (oslo.messaging's ``transport_url``,
    hosts separated by commas) and ``amqp://`` become ``amqp://``; ``amqps://`` stays."""
    scheme = "amqps" if parsed_url.scheme == "amqps" else "amqp"
    path = parsed_url.path or "/"
    hosts = [h for h in (parsed_url.netloc or "").split(",") if h.strip()]
    if not hosts:
        raise coordination.ToozError(f"no broker host in the backend URL ({scheme}://...)")
    query = "&".join(
        part
        for part in (parsed_url.query or "").split("&")
        if part and part.split("=", 1)[0] in _PASSED_QUERY
    )
    tail = f"?{query}" if query else ""
    return [f"{scheme}://{h.strip()}{path}{tail}" for h in hosts]


#: Query options handed to the AMQP client (TLS); the others are the driver's own.
_PASSED_QUERY = frozenset({"cafile", "capath", "cadata", "keyfile", "certfile", "no_verify_ssl"})


# --- snapshots: one message in a queue, read and rewritten under a mutex -------------------


async def _read_snapshot(ch: AbstractChannel, queue: str) -> tuple[dict[str, Any] | None, int]:
    """Take every message of `queue` (unacked); the newest valid snapshot, the last tag."""
    best: dict[str, Any] | None = None
    last = 0
    while True:
        msg: DeliveredMessage = await ch.basic_get(queue, no_ack=False)
        if isinstance(msg.delivery, Basic.GetEmpty):
            return best, last
        assert isinstance(msg.delivery, Basic.GetOk)
        tag = int(msg.delivery.delivery_tag or 0)
        last = max(last, tag)
        try:
            data = utils.loads(msg.body)
        except Exception:  # a stray probe or foreign message: dropped on the next write
            continue
        fresh = isinstance(data, dict) and isinstance(data.get("v"), int)
        if fresh and (best is None or data["v"] > best["v"]):
            best = data


async def _finish_snapshot(
    ch: AbstractChannel, queue: str, last: int, new: dict[str, Any] | None
) -> None:
    """Publish `new` (confirmed) then ack the old messages; or give them back unchanged."""
    if new is not None:
        await ch.basic_publish(
            utils.dumps(new),
            routing_key=queue,
            mandatory=True,
            properties=Basic.Properties(delivery_mode=2),
        )
        if last:
            await ch.basic_ack(last, multiple=True)
    elif last:
        await ch.basic_nack(last, multiple=True, requeue=True)


def _now_ms() -> float:
    return time.time() * 1000.0


class _Members:
    """The member records of a group snapshot, keyed by member id."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.records: dict[bytes, dict[str, Any]] = {}
        for rec in state.get("members", []):
            self.records[bytes(rec["id"])] = rec

    def store(self) -> None:
        self.state["members"] = list(self.records.values())


# --- locks ---------------------------------------------------------------------------------


class AmqpLock(locking.Lock):
    """A tooz lock on :class:`amqp_locks.ReadWriteLock`: ``acquire()`` takes its write
    hold, ``acquire(shared=True)`` a read hold (many readers, no writer; a waiting writer
    keeps new readers out and waiting readers go before the next writer).

    Extras beyond tooz's API: :attr:`fencing_token` (strictly rising with every grant of
    this lock, shared or exclusive) and :attr:`lease` (the newest hold's
    :class:`amqp_locks.Lease`: ``lost``, ``on_lost``).
    """

    def __init__(self, driver: AmqpDriver, name: bytes) -> None:
        super().__init__(name)
        self._driver = driver
        self._rw = ReadWriteLock(driver.broker, lock_name(_as_bytes(name)))
        # The fencing counter of this lock's earlier, mutex-based versions: tokens go on
        # rising across the upgrade.
        self._rw.fence = lock_name(_as_bytes(name))
        self._mu = threading.Lock()
        #: Holds of this object, newest last (several only for shared holds).
        self._leases: list[Lease] = []
        self._token = 0

    @property
    def fencing_token(self) -> int:
        """The fencing token of the newest hold of this object (0 before the first)."""
        return self._token

    @property
    def lease(self) -> Lease | None:
        with self._mu:
            return self._leases[-1] if self._leases else None

    def acquire(
        self,
        blocking: bool | float = True,
        shared: bool = False,
        timeout: float | None = None,
    ) -> bool:
        wait, limit = utils.convert_blocking(blocking, timeout)
        side = self._rw.read_lock if shared else self._rw.write_lock
        with _translated():
            lease = side.acquire(blocking=wait, timeout=limit if wait else None)
        if lease is None:
            return False
        with self._mu:
            self._leases.append(lease)
            self._token = lease.fencing_token
        return True

    def release(self) -> bool:
        with self._mu:
            if not self._leases:
                return False
            lease = self._leases.pop()
        with _translated():
            held = lease.held
            lease.release()
            return held

    def is_still_owner(self) -> bool:
        lease = self.lease
        if lease is None:
            return False
        with _translated():
            return lease.held and lease.verify()

    def break_(self) -> bool:
        raise tooz.NotImplemented(
            "a held lock cannot be broken: its reader tokens and the writer's turn are "
            "unacknowledged deliveries of the holder's connection, which RabbitMQ returns "
            "only when the holder releases them or its connection dies"
        )


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """amqp-locks errors as tooz errors (connection problems as ToozConnectionError)."""
    try:
        yield
    except tooz.ToozError:
        raise
    except (BrokerUnreachable, ConnectionLost) as exc:
        utils.raise_with_cause(coordination.ToozConnectionError, str(exc), cause=exc)
    except AmqpLocksError as exc:
        utils.raise_with_cause(tooz.ToozError, str(exc), cause=exc)


# --- the driver ----------------------------------------------------------------------------


class AmqpDriver(
    coordination.CoordinationDriverCachedRunWatchers,
    coordination.CoordinationDriverWithExecutor,
):
    """tooz coordination on RabbitMQ (see the module docstring and docs/tooz.md).

    URL: ``amqp://user:pass@host:5672/vhost``, ``amqps://...`` or oslo.messaging's
    ``rabbit://user:pass@host1:5672,user:pass@host2:5672/vhost`` (several nodes of one
    cluster). Options (query string): ``heartbeat`` (seconds, default 10: a vanished host's
    members, leaderships and locks are released within about two of them),
    ``connect_timeout`` (seconds, default 10), ``lock_timeout`` (seconds a group operation
    waits for the group's mutex, default 30).
    """

    CHARACTERISTICS = (
        coordination.Characteristics.NON_TIMEOUT_BASED,
        coordination.Characteristics.DISTRIBUTED_ACROSS_THREADS,
        coordination.Characteristics.DISTRIBUTED_ACROSS_PROCESSES,
        coordination.Characteristics.DISTRIBUTED_ACROSS_HOSTS,
        coordination.Characteristics.CAUSAL,
    )
    """Not timeout based (membership, leadership and locks end when the connection does,
    not when a TTL lapses); not linearizable under network partitions (RabbitMQ may grant
    a lock again while a partitioned holder still believes it holds it: use the locks'
    fencing tokens)."""

    def __init__(self, member_id: bytes, parsed_url: Any, options: dict[str, Any]) -> None:
        super().__init__(_as_bytes(member_id), parsed_url, options)
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

    def _stop(self) -> None:
        for group_id in list(self._leaders):
            with contextlib.suppress(Exception):
                self.stand_down_group_leader(group_id)
        broker, self._broker = self._broker, None
        if broker is not None:
            broker.close()  # every lock held through it is released by the broker
        self._member_queues = {}
        self._leaders = {}

    # --- plumbing --------------------------------------------------------------------------

    async def session(self) -> Session:
        """The Broker's live session (the hook into amqp-locks' transport; see the report
        in docs/tooz.md: a public ``Broker.run``/``channel`` would replace it)."""
        return await self.broker._core.session()

    def run(self, coro: Awaitable[T]) -> T:
        async def go() -> T:
            return await coro

        return self.broker._core.run(go())

    def _submit(self, fn: Callable[[], T]) -> coordination.CoordinatorResult[T]:
        fut: futures.Future[T] = self._executor.submit(fn)
        return coordination.CoordinatorResult(fut, failure_translator=_translated)

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
                snap, last = await _read_snapshot(ch, queue)
                state = snap if snap is not None else {"v": 0}
                try:
                    changed, result = await fn(session, state)
                except tooz.ToozError as exc:
                    await _finish_snapshot(ch, queue, last, None)
                    return None, exc
                if changed:
                    state["v"] = int(state.get("v", 0)) + 1
                await _finish_snapshot(ch, queue, last, state if changed else None)
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
        fn: Callable[[Session, _Members], Awaitable[tuple[bool, T]]],
    ) -> T:
        async def on_members(session: Session, state: dict[str, Any]) -> tuple[bool, T]:
            members = _Members(state)
            changed, result = await fn(session, members)
            if changed:
                members.store()
            return changed, result

        with self._held(group_lock(group_id)):
            return self._txn(
                group_queue(group_id),
                on_members,
                lambda: coordination.GroupNotCreated(group_id),
            )

    async def _live(
        self, session: Session, group_id: bytes, members: _Members
    ) -> tuple[bool, set[bytes]]:
        """Probe every recorded member's queue; drop records whose queue is gone."""
        ids = list(members.records)
        alive = await session.probe([member_queue(group_id, m) for m in ids])
        live = {m for m, ok in zip(ids, alive, strict=True) if ok}
        stale = [m for m in ids if m not in live]
        for m in stale:
            del members.records[m]
        return bool(stale), live

    # --- groups ----------------------------------------------------------------------------

    def create_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        group_id = _as_bytes(group_id)

        def create() -> None:
            queue = group_queue(group_id)
            with self._held(REGISTRY_LOCK):

                async def exists() -> bool:
                    session = await self.session()
                    await session.declare(REGISTRY_QUEUE, durable=True)
                    return (await session.probe([queue]))[0]

                if self.run(exists()):
                    raise coordination.GroupAlreadyExist(group_id)

                async def add(session: Session, state: dict[str, Any]) -> tuple[bool, None]:
                    groups = [bytes(g) for g in state.get("groups", [])]
                    if group_id in groups:
                        return False, None
                    state["groups"] = [*groups, group_id]
                    return True, None

                # Listed first, created second: a crash in between leaves a listed group
                # without a queue, which get_groups drops.
                self._txn(REGISTRY_QUEUE, add, lambda: tooz.ToozError("registry vanished"))

                async def declare() -> None:
                    session = await self.session()
                    await session.declare(queue, durable=True)

                self.run(declare())

        return self._submit(create)

    def get_groups(self) -> coordination.CoordinatorResult[list[bytes]]:
        def groups() -> list[bytes]:
            with self._held(REGISTRY_LOCK):

                async def ensure() -> None:
                    session = await self.session()
                    await session.declare(REGISTRY_QUEUE, durable=True)

                self.run(ensure())

                async def listed(
                    session: Session, state: dict[str, Any]
                ) -> tuple[bool, list[bytes]]:
                    names = [bytes(g) for g in state.get("groups", [])]
                    alive = await session.probe([group_queue(g) for g in names])
                    live = [g for g, ok in zip(names, alive, strict=True) if ok]
                    if len(live) != len(names):
                        state["groups"] = live
                        return True, live
                    return False, live

                return self._txn(
                    REGISTRY_QUEUE, listed, lambda: tooz.ToozError("registry vanished")
                )

        return self._submit(groups)

    def delete_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        group_id = _as_bytes(group_id)

        def delete() -> None:
            with self._held(REGISTRY_LOCK):

                async def check(session: Session, members: _Members) -> tuple[bool, None]:
                    _, live = await self._live(session, group_id, members)
                    if live:
                        raise coordination.GroupNotEmpty(group_id)
                    await session.delete(group_queue(group_id))
                    return False, None

                self._group_txn(group_id, check)

                async def remove(session: Session, state: dict[str, Any]) -> tuple[bool, None]:
                    groups = [bytes(g) for g in state.get("groups", [])]
                    if group_id not in groups:
                        return False, None
                    state["groups"] = [g for g in groups if g != group_id]
                    return True, None

                self._txn(REGISTRY_QUEUE, remove, lambda: tooz.ToozError("registry vanished"))

        return self._submit(delete)

    def join_group(
        self, group_id: bytes, capabilities: coordination.Capabilities | None = None
    ) -> coordination.CoordinatorResult[None]:
        group_id = _as_bytes(group_id)
        member_id = self._member_id
        caps = capabilities

        def join() -> None:
            queue = member_queue(group_id, member_id)

            async def add(session: Session, members: _Members) -> tuple[bool, None]:
                _, live = await self._live(session, group_id, members)
                if member_id in live:
                    raise coordination.MemberAlreadyExist(group_id, member_id)
                try:
                    await session.declare(queue, exclusive=True, arguments=_FLAG_ARGS)
                except ResourceLocked:
                    raise coordination.MemberAlreadyExist(group_id, member_id) from None
                self._member_queues[group_id] = queue
                now = _now_ms()
                members.records[member_id] = {
                    "id": member_id,
                    "caps": caps,
                    "created_at": now,
                    "updated_at": now,
                }
                return True, None

            self._group_txn(group_id, add)
            self._joined_groups.add(group_id)

        return self._submit(join)

    def leave_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        group_id = _as_bytes(group_id)
        member_id = self._member_id

        def leave() -> None:
            async def remove(session: Session, members: _Members) -> tuple[bool, None]:
                changed, live = await self._live(session, group_id, members)
                if member_id not in live:
                    if changed:  # keep the clean-up, report the error
                        members.store()
                    raise coordination.MemberNotJoined(group_id, member_id)
                del members.records[member_id]
                return True, None

            try:
                self._group_txn(group_id, remove)
            finally:
                self._joined_groups.discard(group_id)
            queue = self._member_queues.pop(group_id, None)
            if queue is not None:

                async def drop() -> None:
                    session = await self.session()
                    await session.delete(queue)

                self.run(drop())

        return self._submit(leave)

    def get_members(self, group_id: bytes) -> coordination.CoordinatorResult[set[bytes]]:
        group_id = _as_bytes(group_id)

        def members() -> set[bytes]:
            async def read(session: Session, members: _Members) -> tuple[bool, set[bytes]]:
                return await self._live(session, group_id, members)

            return self._group_txn(group_id, read)

        return self._submit(members)

    def _member_record(self, group_id: bytes, member_id: bytes) -> dict[str, Any]:
        async def read(session: Session, members: _Members) -> tuple[bool, dict[str, Any]]:
            changed, live = await self._live(session, group_id, members)
            if member_id not in live:
                raise coordination.MemberNotJoined(group_id, member_id)
            return changed, dict(members.records[member_id])

        return self._group_txn(group_id, read)

    def get_member_capabilities(
        self, group_id: bytes, member_id: bytes
    ) -> coordination.CoordinatorResult[coordination.Capabilities | None]:
        group_id, member_id = _as_bytes(group_id), _as_bytes(member_id)
        return self._submit(lambda: self._member_record(group_id, member_id)["caps"])

    def get_member_info(
        self, group_id: bytes, member_id: bytes
    ) -> coordination.CoordinatorResult[dict[str, Any]]:
        group_id, member_id = _as_bytes(group_id), _as_bytes(member_id)

        def info() -> dict[str, Any]:
            rec = self._member_record(group_id, member_id)
            return {
                "capabilities": rec["caps"],
                "created_at": utils.millis_to_datetime(rec["created_at"]),
                "updated_at": utils.millis_to_datetime(rec["updated_at"]),
            }

        return self._submit(info)

    def get_members_with_capabilities(
        self, group_id: bytes
    ) -> coordination.CoordinatorResult[dict[bytes, coordination.Capabilities | None]]:
        group_id = _as_bytes(group_id)

        def read_all() -> dict[bytes, coordination.Capabilities | None]:
            async def read(
                session: Session, members: _Members
            ) -> tuple[bool, dict[bytes, Any]]:
                changed, live = await self._live(session, group_id, members)
                return changed, {m: members.records[m]["caps"] for m in live}

            return self._group_txn(group_id, read)

        return self._submit(read_all)

    def update_capabilities(
        self, group_id: bytes, capabilities: coordination.Capabilities
    ) -> coordination.CoordinatorResult[None]:
        group_id = _as_bytes(group_id)
        member_id = self._member_id

        def update() -> None:
            async def write(session: Session, members: _Members) -> tuple[bool, None]:
                changed, live = await self._live(session, group_id, members)
                if member_id not in live:
                    if changed:
                        members.store()
                    raise coordination.MemberNotJoined(group_id, member_id)
                rec = members.records[member_id]
                rec["caps"] = capabilities
                rec["updated_at"] = _now_ms()
                return True, None

            self._group_txn(group_id, write)

        return self._submit(update)

    # --- leaders ---------------------------------------------------------------------------

    def get_leader(self, group_id: bytes) -> coordination.CoordinatorResult[bytes]:
        group_id = _as_bytes(group_id)

        def leader() -> bytes:
            async def read(session: Session, members: _Members) -> tuple[bool, Any]:
                named = members.state.get("leader")
                if not named:
                    return False, None
                named = bytes(named)
                alive = (await session.probe([leader_queue(group_id, named)]))[0]
                return False, named if alive else None

            result: bytes = self._group_txn(group_id, read)
            return result

        return self._submit(leader)

    def get_leader_lease(self, group_id: bytes) -> Lease | None:
        """Extra: this coordinator's leadership of `group_id` as a :class:`Lease` (its
        ``fencing_token`` rises with every election; ``lost`` is set if the connection
        dies), or None when it does not lead the group."""
        lease = self._leaders.get(_as_bytes(group_id))
        return lease if lease is not None and lease.held else None

    def _try_lead(self, group_id: bytes) -> bool:
        current = self._leaders.get(group_id)
        if current is not None:
            if current.held:
                return False  # still leader: no new event
            self._leaders.pop(group_id, None)
        with _translated():
            lease = Mutex(self.broker, leader_lock(group_id)).acquire(blocking=False)
        if lease is None:
            return False
        flag = leader_queue(group_id, self._member_id)
        member_id = self._member_id

        async def announce() -> None:
            session = await self.session()
            await session.declare(flag, exclusive=True, arguments=_FLAG_ARGS)

        async def write(session: Session, members: _Members) -> tuple[bool, None]:
            members.state["leader"] = member_id
            return True, None

        try:
            with _translated():
                self.run(announce())
                self._group_txn(group_id, write)
        except coordination.GroupNotCreated:
            self._drop_leadership(group_id, lease)
            return False
        except BaseException:
            self._drop_leadership(group_id, lease)
            raise
        self._leaders[group_id] = lease
        return True

    def _drop_leadership(self, group_id: bytes, lease: Lease) -> None:
        flag = leader_queue(group_id, self._member_id)

        async def drop() -> None:
            session = await self.session()
            await session.delete(flag)

        try:
            with contextlib.suppress(AmqpLocksError):
                self.run(drop())
        finally:
            lease.release()

    def stand_down_group_leader(self, group_id: bytes) -> bool:
        group_id = _as_bytes(group_id)
        lease = self._leaders.pop(group_id, None)
        if lease is None:
            return False
        with _translated():
            self._drop_leadership(group_id, lease)
        return True

    def run_elect_coordinator(self) -> None:
        for group_id, hooks in list(self._hooks_elected_leader.items()):
            if self._try_lead(group_id):
                hooks.run(coordination.LeaderElected(group_id, self._member_id))

    def run_watchers(self, timeout: float | None = None) -> list[Any]:
        result = super().run_watchers(timeout=timeout)
        self.run_elect_coordinator()
        return result

    # --- locks -----------------------------------------------------------------------------

    def get_lock(self, name: bytes) -> AmqpLock:
        return AmqpLock(self, _as_bytes(name))


__all__ = ["AmqpDriver", "AmqpLock", "broker_urls", "encode_id"]
