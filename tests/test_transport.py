"""Transport on a real broker: typed errors for bad input, probes, fencing across restarts."""

from __future__ import annotations

import socket
import threading
import uuid

import pytest

from amqp_locks import (
    AccessRefused,
    AuthenticationFailed,
    Broker,
    BrokerUnreachable,
    ConfigurationError,
    InvalidName,
    Mutex,
    PersistentSemaphore,
    SemaphoreAdmin,
)
from amqp_locks.names import slot_queue
from amqp_locks_dev import devbroker

from .conftest import fence_counter, fence_messages
from .permissions import restricted_brokers


def test_unreachable_broker_is_a_typed_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    url = f"amqp://guest:guest@127.0.0.1:{port}/"
    with Broker(url, connect_timeout=5) as b, pytest.raises(BrokerUnreachable, match=str(port)):
        b.connect()


def test_wrong_credentials(node: devbroker.NodeInfo) -> None:
    url = f"amqp://guest:wrong@127.0.0.1:{node.amqp_port}/"
    with Broker(url) as b, pytest.raises(AuthenticationFailed, match="guest") as info:
        b.connect()
    assert "wrong" not in str(info.value)  # the password is never printed


def test_no_permission_on_vhost(node: devbroker.NodeInfo) -> None:
    user, password, vhost = f"u{uuid.uuid4().hex[:8]}", "pw", f"v{uuid.uuid4().hex[:8]}"
    devbroker.rabbitmqctl(node, "add_vhost", vhost)
    devbroker.rabbitmqctl(node, "add_user", user, password)
    try:
        url = f"amqp://{user}:{password}@127.0.0.1:{node.amqp_port}/{vhost}"
        with Broker(url) as b, pytest.raises(AccessRefused, match=vhost):
            b.connect()
        # allowed on the vhost, but may not configure queues: 403 on the declare
        devbroker.rabbitmqctl(node, "set_permissions", "-p", vhost, user, "^$", ".*", ".*")
        with Broker(url) as b, pytest.raises(AccessRefused, match="403"):
            SemaphoreAdmin(b, "locked-out", mutex_timeout=5).create(1)
    finally:
        devbroker.rabbitmqctl(node, "delete_user", user)
        devbroker.rabbitmqctl(node, "delete_vhost", vhost)


def test_bad_urls_and_settings() -> None:
    with pytest.raises(ConfigurationError, match="invalid AMQP URL"):
        Broker("http://example.org/")
    with pytest.raises(ConfigurationError, match="heartbeat"):
        Broker("amqp://127.0.0.1/", heartbeat=0)


def test_bad_names_are_refused_before_any_io(broker: Broker) -> None:
    for bad in ("", "x.slots", "x.mutex", "a\x00", "x" * 300):
        with pytest.raises(InvalidName):
            PersistentSemaphore(broker, bad)
        with pytest.raises(InvalidName):
            SemaphoreAdmin(broker, bad)
        with pytest.raises(InvalidName):
            Mutex(broker, bad)


def test_probes_are_pipelined_and_ordered(broker: Broker, name: str) -> None:
    SemaphoreAdmin(broker, name).create(5)

    async def probe() -> list[bool]:
        session = await broker.core.session()
        return await session.probe([slot_queue(name, k) for k in range(1, 301)])

    found = broker.core.run(probe())
    assert found == [True] * 5 + [False] * 295


def test_probes_leave_no_message_behind(
    broker: Broker, name: str, node: devbroker.NodeInfo
) -> None:
    SemaphoreAdmin(broker, name).create(1)

    async def probe() -> None:
        session = await broker.core.session()
        await session.probe([slot_queue(name, 1)] * 50)

    broker.core.run(probe())
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "messages", "--no-table-headers")
    row = [line.split() for line in out.splitlines() if line.startswith(slot_queue(name, 1))]
    assert row == [[slot_queue(name, 1), "0"]]


def test_fence_queue_is_quorum_and_holds_one_message(
    broker: Broker, name: str, node: devbroker.NodeInfo
) -> None:
    SemaphoreAdmin(broker, name).create(1)
    SemaphoreAdmin(broker, name).create(1)  # idempotent: still one fence message
    counter = fence_counter(broker, name)
    out = devbroker.rabbitmqctl(node, "list_queues", "name", "type", "--no-table-headers")
    row = [line.split() for line in out.splitlines() if line.split()[:1] == [counter]]
    assert row == [[counter, "quorum"]]
    assert fence_messages(broker, name) == 1


def test_repair_fence_keeps_tokens_rising(
    broker: Broker, name: str, node: devbroker.NodeInfo
) -> None:
    admin = SemaphoreAdmin(broker, name)
    admin.create(1)
    sem = PersistentSemaphore(broker, name)
    with sem.acquire() as lease:  # type: ignore[union-attr]
        last = lease.fencing_token
    assert admin.repair_fence(base=1000) is False  # nothing missing: nothing done
    # A purged counter needs no repair: the next grant waits fencing.HEAL_AFTER for the
    # message, then makes the next generation, every token of which is higher.
    devbroker.rabbitmqctl(node, "purge_queue", fence_counter(broker, name))
    assert admin.repair_fence(base=1000) is False
    with sem.acquire() as lease:  # type: ignore[union-attr]
        assert lease.fencing_token > last > 1000
        last = lease.fencing_token
    # Deleted by hand: rebuilt from the operator's floor, above it.
    devbroker.rabbitmqctl(node, "delete_queue", fence_counter(broker, name))
    assert admin.repair_fence(base=last + 2**40) is True
    with sem.acquire() as lease:  # type: ignore[union-attr]
        assert lease.fencing_token > last + 2**40


def test_documented_permissions_are_enough(node: devbroker.NodeInfo) -> None:
    """docs/operations.md's set_permissions example, for locks `images` and `reindex`."""
    names = (
        r"^((images|reindex)(-[0-9]+-[AB]|-(sem|mutex)-(wakeups|watch))?"
        r"|amqp-locks-fence-[0-9]+(-g[0-9]+(-done)?)?)$"
    )
    with restricted_brokers(node, names) as (b, other):
        SemaphoreAdmin(b, "images").create(1)
        held = PersistentSemaphore(b, "images").acquire()
        assert held is not None
        got: list[object] = []
        waiter = threading.Thread(
            target=lambda: got.append(PersistentSemaphore(other, "images").acquire(timeout=30))
        )
        waiter.start()
        held.release()
        waiter.join(30)
        assert got and got[0] is not None
        with Mutex(b, "reindex").acquire(timeout=5) as lease:  # type: ignore[union-attr]
            assert lease.fencing_token >= 1
        SemaphoreAdmin(other, "images").destroy()


def test_the_io_thread_leaves_outside_signals_to_the_main_thread() -> None:
    """A SIGTERM or SIGINT the kernel handed to the I/O thread would not interrupt the main
    thread's blocking call (the CLI's `waitpid`, a caller's lock wait), and its Python
    handler runs only in the main thread: the I/O thread blocks them."""
    import signal

    from amqp_locks.transport.iothread import IOThread

    io = IOThread()
    try:

        async def mask() -> set[int]:
            return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))

        blocked = io.submit(mask()).result(5)
    finally:
        io.stop()
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= blocked
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # ours only


def test_two_threads_stopping_the_io_thread_at_once_both_return_cleanly() -> None:
    """`Broker.close()` from two threads (a worker's and an atexit hook's) stops the I/O
    thread twice at once. The second stop must wait for the first, not cancel its work (the
    first caller then got a CancelledError) or find the loop closed under it (a
    RuntimeError, or its full timeout spent waiting on a loop that had stopped)."""
    import asyncio
    import concurrent.futures

    from amqp_locks.transport.iothread import IOThread

    io = IOThread()
    cancelled = threading.Event()  # the first stop is cancelling our task
    finish: asyncio.Event | None = None

    async def slow_to_cancel() -> None:
        nonlocal finish
        finish = asyncio.Event()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            await finish.wait()  # a release still running when its connection closes
            raise

    task = io.submit(slow_to_cancel())
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            io.stop(timeout=30)
        except BaseException as exc:  # what escapes is the finding
            errors.append(exc)

    first = threading.Thread(target=stop)
    first.start()
    assert cancelled.wait(10)
    second = threading.Thread(target=stop)
    second.start()
    second.join(0.5)  # the window in which the old stop cancelled the first one's work
    assert second.is_alive(), "the second stop returned while the first was still stopping"
    assert finish is not None
    io.loop.call_soon_threadsafe(finish.set)
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert errors == []
    assert not io.alive and io.loop.is_closed()
    with pytest.raises(concurrent.futures.CancelledError):
        task.result(0)
