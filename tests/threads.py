"""Running functions in threads and collecting what they raised."""

from __future__ import annotations

import threading
from collections.abc import Callable


def _catching(target: Callable[[], object], errors: list[BaseException]) -> Callable[[], None]:
    """``target``, appending what it raises to ``errors`` instead of raising it."""

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    return run


def run_in_threads(
    target: Callable[[], None], count: int, join_timeout: float = 120
) -> list[BaseException]:
    """Runs ``target`` in ``count`` threads started together, joins each (``join_timeout``
    seconds at most) and returns what the threads raised, in the order they raised it."""
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_catching(target, errors)) for _ in range(count)]
    _start_and_join(threads, join_timeout)
    return errors


def _start_and_join(threads: list[threading.Thread], join_timeout: float) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)


def start_catching(
    target: Callable[[], object], daemon: bool = False
) -> tuple[threading.Thread, list[BaseException]]:
    """Starts ``target`` in a thread; returns the thread and the list that receives what
    it raised (the test joins the thread when its scenario says so)."""
    errors: list[BaseException] = []
    thread = threading.Thread(target=_catching(target, errors), daemon=daemon)
    thread.start()
    return thread, errors


def run_together(threads: list[threading.Thread], join_timeout: float) -> None:
    """Starts ``threads``, joins each (``join_timeout`` seconds at most) and asserts that
    none is still running: a thread left hanging is a failure, not a slow pass."""
    _start_and_join(threads, join_timeout)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still running after {join_timeout} s: {hung}"
