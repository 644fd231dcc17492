"""Signals and the main thread: handlers installed for the length of a block (the CLI's
supervisor passes signals on to its child; ``LockableService.run()`` takes SIGINT/SIGTERM as
``stop()``), and waits in the main thread that let those handlers run.

The kernel hands a signal sent to the process to any of its threads that does not block it
(the main thread when it can take it at once; another one, such as a thread that was
already running, otherwise). Python runs the handler in the main thread only, between two
of its bytecodes. A signal taken by another thread does not interrupt the main thread's
wait for a lock, an event or a thread, so a wait with no timeout there would never run the
handler: CI rehearsal 62, ``amqp-locks elect``'s master ignored SIGTERM (its main thread in
``Thread.join()``; the signal taken by one of its service threads; reproduced under load,
and at once with ``tgkill`` to such a thread). Waits in the main thread therefore block
SIGNAL_SLICE seconds at a time."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

#: The longest one wait in the main thread blocks before Python may run a pending
#: signal handler (see the module docstring): a signal is acted on within this.
SIGNAL_SLICE = 0.2


def _slices(timeout: float | None) -> Iterator[float | None]:
    """The lengths to wait, one after the other, for a wait of `timeout` seconds (None:
    no limit): the whole of it outside the main thread, SIGNAL_SLICE at most in it."""
    if threading.current_thread() is not threading.main_thread():
        yield timeout
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if deadline is None:
            yield SIGNAL_SLICE
            continue
        left = deadline - time.monotonic()
        yield max(0.0, min(SIGNAL_SLICE, left))
        if left <= SIGNAL_SLICE:
            return


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)`` that lets signal handlers run in the main thread."""
    for seconds in _slices(timeout):
        if event.wait(seconds):
            return True
    return event.is_set()


def join(thread: threading.Thread, timeout: float | None = None) -> None:
    """``thread.join(timeout)`` that lets signal handlers run in the main thread."""
    for seconds in _slices(timeout):
        thread.join(seconds)
        if not thread.is_alive():
            return


def result(fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """``fut.result(timeout)`` that lets signal handlers run in the main thread (a
    TimeoutError the future itself holds is raised as it is). A slice that ran out as the
    future finished (it is done when we look again) gives the future's own answer, never
    the slice's TimeoutError: rehearsal 112 lost a granted lease's return that way
    (tests/test_signal_waits.py)."""
    for seconds in _slices(timeout):
        try:
            return fut.result(seconds)
        except concurrent.futures.TimeoutError:
            if fut.done():
                break
    return fut.result(0)


@contextmanager
def handlers(
    handler: Callable[[int, FrameType | None], Any], sigs: tuple[int, ...]
) -> Iterator[None]:
    """`handler` for each of `sigs` while the block runs; the previous handlers after."""
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
