"""A keep-alive that does not answer counts as failed after `keep_alive_timeout`.

Found by tests/faults/test_lockers_faults.py: a DatabaseLocker master cut off from the
database waited on its keep-alive for as long as the partition lasted; when the database
ended its session meanwhile (idle-in-transaction timeout, TCP keepalive, an administrator)
the standby took the row lock, and two masters ran until the partition healed.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from amqp_locks import Broker, ConfigurationError
from amqp_locks.lockers import AmqpLocker, Locker, SharedFileLocker
from amqp_locks.service import KeepAliveTimeout, LeaseAwarePolicy, LockableService, State


class HangingFileLocker(SharedFileLocker):
    """A file locker whose keep-alive can be made to hang (a hard NFS mount, a database
    call on a silent connection)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, lock_acquire_sleep_interval=0.05)
        self.hang = threading.Event()
        self.unblock = threading.Event()

    def _keep_alive(self) -> bool:
        if self.hang.is_set():
            self.unblock.wait(30)
        return super()._keep_alive()


class RecordingPolicy(LeaseAwarePolicy):
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def on_error(self, locker: Locker, exc: BaseException) -> bool:
        self.errors.append(exc)
        return super().on_error(locker, exc)


def _serve(
    locker: HangingFileLocker, **options: Any
) -> tuple[LockableService, list[tuple[float, State]]]:
    states: list[tuple[float, State]] = []
    service = LockableService(
        locker,
        lambda stop: stop.wait(),
        lock_keep_alive_period=0.2,
        on_state=lambda _, s: states.append((time.monotonic(), s)),
        **options,
    )
    service.start()
    deadline = time.monotonic() + 10
    while service.state is not State.MASTER:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return service, states


def test_hung_keep_alive_demotes_after_the_timeout(tmp_path: Path) -> None:
    locker = HangingFileLocker(tmp_path)
    policy = RecordingPolicy()
    service, states = _serve(locker, keep_alive_timeout=0.3, policy=policy)
    try:
        hung_from = time.monotonic()
        locker.hang.set()
        deadline = time.monotonic() + 5
        while not any(s is State.STANDBY for _, s in states[2:]):
            assert time.monotonic() < deadline, "a hung keep-alive held the master"
            time.sleep(0.01)
        demoted = next(t for t, s in states[2:] if s is State.STANDBY)
        # The hung call started within one period of `hung_from`; it had 0.3 s to answer.
        assert 0.3 <= demoted - hung_from < 0.2 + 0.3 + 1.0
        assert len(policy.errors) == 1 and isinstance(policy.errors[0], KeepAliveTimeout)
    finally:
        locker.unblock.set()
        service.stop(10)


def _states_after_a_hang(
    tmp_path: Path, keep_alive_timeout: float, hang: float, then: float
) -> list[State]:
    """The states a service went through when its keep-alives hung for ``hang`` seconds
    and then answered again for ``then`` seconds."""
    locker = HangingFileLocker(tmp_path)
    service, states = _serve(locker, keep_alive_timeout=keep_alive_timeout)
    try:
        locker.hang.set()
        time.sleep(hang)  # the scenario: keep-alives stuck this long
        locker.hang.clear()
        locker.unblock.set()
        time.sleep(then)  # the scenario: then keep-alives answer again for a while
        return [s for _, s in states]
    finally:
        service.stop(10)


def test_a_keep_alive_answering_within_the_timeout_keeps_mastership(tmp_path: Path) -> None:
    # stuck 0.5 s, well under the 2 s timeout
    states = _states_after_a_hang(tmp_path, keep_alive_timeout=2.0, hang=0.5, then=0.5)
    assert states == [State.STANDBY, State.MASTER]


def test_an_infinite_timeout_waits_for_the_answer(tmp_path: Path) -> None:
    # stuck 0.6 s, answering afterwards
    states = _states_after_a_hang(tmp_path, keep_alive_timeout=math.inf, hang=0.6, then=0.3)
    assert states == [State.STANDBY, State.MASTER]


def test_default_timeouts(tmp_path: Path, amqp_url: str) -> None:
    file_service = LockableService(
        SharedFileLocker(tmp_path), lambda stop: None, lock_keep_alive_period=0.7
    )
    assert file_service.keep_alive_timeout == 0.7  # by then the next keep-alive is due
    assert LockableService(SharedFileLocker(tmp_path), lambda s: None).keep_alive_timeout is None
    with Broker(amqp_url, heartbeat=5) as broker:
        amqp = LockableService(AmqpLocker(broker, "x"), lambda s: None, lock_keep_alive_period=1)
        assert amqp.keep_alive_timeout is None  # missed heartbeats end its keep-alive
    forever = LockableService(
        SharedFileLocker(tmp_path), lambda s: None, keep_alive_timeout=math.inf
    )
    assert forever.keep_alive_timeout == math.inf
    for bad in (0, -1):
        with pytest.raises(ConfigurationError, match="keep_alive_timeout"):
            LockableService(SharedFileLocker(tmp_path), lambda s: None, keep_alive_timeout=bad)


class TolerantPolicy(RecordingPolicy):
    """A user's policy that rides out every error (records it)."""

    def on_error(self, locker: Locker, exc: BaseException) -> bool:
        self.errors.append(exc)
        return True


def test_a_keep_alive_raising_a_timeout_error_is_an_error_and_is_called_again(
    tmp_path: Path,
) -> None:
    """A keep-alive's own `TimeoutError` (a socket timeout in a custom locker; the
    library's `BrokerTimeout` is one too) is its answer, handed to the policy as it is,
    and the next period calls the keep-alive again. It was taken for "no answer yet": the
    policy was told `KeepAliveTimeout` at every check and the keep-alive never called
    again (a lease locker would then demote when its lease ran out)."""
    failed = TimeoutError("the keep-alive's socket timed out (test)")
    calls: list[float] = []

    class Once(HangingFileLocker):
        def _keep_alive(self) -> bool:
            calls.append(time.monotonic())
            if len(calls) == 2:
                raise failed
            return super()._keep_alive()

    policy = TolerantPolicy()
    service, states = _serve(Once(tmp_path), keep_alive_timeout=5.0, policy=policy)
    try:
        deadline = time.monotonic() + 10
        while len(calls) < 5:
            assert time.monotonic() < deadline, f"keep-alive called {len(calls)} times"
            time.sleep(0.05)
        assert policy.errors == [failed]
        assert [s for _, s in states] == [State.STANDBY, State.MASTER]
    finally:
        service.stop(10)
