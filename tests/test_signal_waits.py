"""Waits in slices (amqp_locks/signals.py) and a future that finishes as a slice runs out.

Rehearsal 112 (4.3.6, 2 CPU burners): a non-blocking acquire's caller got a bare
``TimeoutError`` from ``concurrent.futures`` with no timeout given. The traceback ended in
the wait's own slice (``Future.result(0.2)``, "raise TimeoutError()"), not in the
acquire: the slice ran out with the future unfinished, the future finished before the next
bytecode asked ``fut.done()``, and the slice's error was raised as if the future held it.
A caller so answered loses what the call returned (a granted lease, held and never
released). The race is forced here by a future that finishes inside the timed-out wait;
the same future forces it where a `with` block's exit waits for its release's confirmation
(``BrokerCore.release_leaving``), which logged a confirmed release as late.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from amqp_locks import BrokerTimeout, ReleaseUnconfirmed, signals
from amqp_locks.lockers import SharedFileLocker
from amqp_locks.service import LockableService
from amqp_locks.transport import core as core_module
from amqp_locks.transport.core import BrokerCore

from .lockers.test_keep_alive_timeout import RecordingPolicy


class _FinishedAsItRanOut(concurrent.futures.Future[Any]):
    """A future whose first timed wait runs out unfinished, and which finishes (with
    `outcome`) right after, before its waiter looks again: the race, made certain."""

    def __init__(self, outcome: Any) -> None:
        super().__init__()
        self.outcome = outcome
        self.timed_out = 0

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None and timeout > 0 and not self.done():
            self.timed_out += 1
            if isinstance(self.outcome, BaseException):
                self.set_exception(self.outcome)
            else:
                self.set_result(self.outcome)
            raise concurrent.futures.TimeoutError()
        return super().result(timeout)


def _called_in(thread: str, fn: Callable[[], Any]) -> Any:
    """`fn()` in the main thread (waits in slices), or in another one (one slice: the
    whole timeout); its error raised as itself."""
    if thread == "main":
        return fn()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(10)


@pytest.mark.parametrize(
    ("thread", "timeout"),
    # Outside the main thread a wait with no timeout is one untimed wait: no slice.
    [("main", None), ("main", 5.0), ("other", 5.0)],
    ids=["main-no-timeout", "main-timeout", "other-timeout"],
)
def test_a_future_that_finished_as_a_slice_ran_out_gives_its_result(
    thread: str, timeout: float | None
) -> None:
    fut = _FinishedAsItRanOut("granted")
    got = _called_in(thread, lambda: signals.result(fut, timeout))
    assert fut.timed_out == 1
    assert got == "granted"


@pytest.mark.parametrize("thread", ["main", "other"])
def test_a_timeout_error_the_future_holds_is_raised_as_it_is(thread: str) -> None:
    held = BrokerTimeout("the broker answered nothing in time")
    fut = _FinishedAsItRanOut(held)
    with pytest.raises(BrokerTimeout) as caught:
        _called_in(thread, lambda: signals.result(fut, 5.0))
    assert caught.value is held


def test_a_wait_that_runs_out_still_raises_timeout_error() -> None:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    with pytest.raises(concurrent.futures.TimeoutError):
        signals.result(fut, 0.3)
    assert not fut.done()


@pytest.mark.parametrize("keep_alive_timeout", [None, 5.0], ids=["no-timeout", "timeout"])
def test_a_keep_alive_answered_as_the_wait_ran_out_is_its_answer(
    tmp_path: Path, keep_alive_timeout: float | None
) -> None:
    """The service's keep-alive wait: a keep-alive that answered True as the wait ran out
    is a renewal, not an error handed to the policy (which may demote a healthy master)."""
    policy = RecordingPolicy()
    locker = SharedFileLocker(tmp_path)
    service = LockableService(
        locker, lambda stop: None, policy=policy, keep_alive_timeout=keep_alive_timeout
    )
    fut = _FinishedAsItRanOut(True)
    service._call_keep_alive = lambda: fut  # type: ignore[method-assign]
    try:
        assert service._keep_alive_ok() is True
        assert fut.timed_out == 1 and policy.errors == []
    finally:
        locker.close()


def test_a_keep_alive_s_own_timeout_error_goes_to_the_policy(tmp_path: Path) -> None:
    policy = RecordingPolicy()
    locker = SharedFileLocker(tmp_path)
    service = LockableService(locker, lambda stop: None, policy=policy, keep_alive_timeout=5.0)
    held = BrokerTimeout("keep-alive: the broker answered nothing in time")
    service._call_keep_alive = lambda: _FinishedAsItRanOut(held)  # type: ignore[method-assign]
    try:
        service._keep_alive_ok()
        assert policy.errors == [held] and policy.errors[0] is held
    finally:
        locker.close()


def test_a_keep_alive_that_answers_just_after_the_wait_ran_out_is_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race one step later: the whole wait ran out (keep_alive_timeout), and the
    keep-alive answered before the service looked at it: a renewal, not a timeout."""
    real = signals.result

    def ran_out_then_answered(fut: concurrent.futures.Future[Any], timeout: float | None) -> Any:
        try:
            return real(fut, timeout)
        finally:
            fut.set_result(True)

    monkeypatch.setattr(signals, "result", ran_out_then_answered)
    policy = RecordingPolicy()
    locker = SharedFileLocker(tmp_path)
    service = LockableService(locker, lambda stop: None, policy=policy, keep_alive_timeout=0.3)
    never: concurrent.futures.Future[bool] = concurrent.futures.Future()
    service._call_keep_alive = lambda: never  # type: ignore[method-assign]
    try:
        assert service._keep_alive_ok() is True
        assert never.done() and policy.errors == []
    finally:
        locker.close()


def _leave(fut: concurrent.futures.Future[Any]) -> None:
    """BrokerCore.release_leaving (a `with` block's exit) with `fut` as its release."""
    state = SimpleNamespace(kind="mutex", number=1, name="orders")
    core = SimpleNamespace(_closed=False, submit_release=lambda _state, _wait: fut)
    BrokerCore.release_leaving(core, state)  # type: ignore[arg-type]


def test_a_release_confirmed_as_the_block_s_wait_ran_out_is_not_reported_late(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fut = _FinishedAsItRanOut(None)
    with caplog.at_level(logging.WARNING, logger="amqp_locks"):
        _leave(fut)
    assert fut.timed_out == 1
    assert caplog.records == []


def test_a_release_still_unconfirmed_after_the_wait_is_reported(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_module, "RELEASE_HANDOFF", 0.2)
    never: concurrent.futures.Future[None] = concurrent.futures.Future()
    with caplog.at_level(logging.WARNING, logger="amqp_locks"):
        _leave(never)
    [record] = caplog.records
    assert "release of mutex 1 of 'orders' not confirmed within 0 s" in record.getMessage()


@pytest.mark.parametrize(
    "failure",
    [
        ReleaseUnconfirmed("release of mutex 1 of 'orders' not confirmed: channel closed"),
        BrokerTimeout("the broker answered nothing in time"),
    ],
    ids=["unconfirmed", "broker-timeout"],
)
def test_a_release_that_failed_as_the_wait_ran_out_is_reported_as_its_failure(
    caplog: pytest.LogCaptureFixture, failure: Exception
) -> None:
    """Logged with the release's own reason, never raised over the block's outcome."""
    fut = _FinishedAsItRanOut(failure)
    with caplog.at_level(logging.WARNING, logger="amqp_locks"):
        _leave(fut)
    [record] = caplog.records
    message = record.getMessage()
    assert "release of mutex 1 of 'orders' not confirmed" in message
    assert str(failure) in message and "within" not in message
