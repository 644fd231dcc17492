"""The live "waiting for ..." line that `run` and `elect` show while they wait on a
terminal: what (kind and name), for how long (and the timeout), and who holds it (holder
id, host, pid, since, as the holders answer; slots, permits held and waiting). Only when
stderr is a terminal and without -q; it is erased when the wait ends.

The holders are read on a thread of their own (read-only, no admin mutex; a silent holder
costs that thread up to a second): a slow or failing read never delays the wait, it only
leaves the line without them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

log = logging.getLogger("amqp_locks.cli")

#: A wait shorter than this shows nothing (an uncontended lock is taken at once).
SHOW_AFTER = 0.3
#: How often the holders are read again.
PROBE_INTERVAL = 2.0

Probe = Callable[[], str | None]


def elapsed_text(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def wanted(quiet: bool) -> bool:
    """The line is shown only on a terminal, and never with -q."""
    try:
        return not quiet and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class WaitLine:
    """``with WaitLine("semaphore 'deploys'", timeout, probe, enabled=...): acquire()``.

    Also usable with explicit `start()` / `stop()` (elect's standby periods)."""

    def __init__(
        self,
        what: str,
        timeout: float | None = None,
        probe: Probe | None = None,
        *,
        enabled: bool,
        verb: str = "waiting for",
        show_after: float = SHOW_AFTER,
        probe_interval: float = PROBE_INTERVAL,
    ) -> None:
        self.what = what
        self.timeout = timeout
        self.probe = probe
        self.enabled = enabled
        self.verb = verb
        self.show_after = show_after
        self.probe_interval = probe_interval
        self.holders: str | None = None
        self._started = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._live: Any = None
        self._threads: list[threading.Thread] = []

    def text(self) -> str:
        line = f"amqp-locks: {self.verb} {self.what}, {elapsed_text(self._elapsed())}"
        if self.timeout is not None:
            line += f" of {elapsed_text(self.timeout)}"
        if self.holders:
            line += f"; {self.holders}"
        return line

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def _render(self) -> Any:
        from rich.text import Text

        return Text(self.text(), no_wrap=True, overflow="ellipsis")

    def start(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._threads:
                return
            self._stop.clear()
            self._started = time.monotonic()
            self.holders = None
            for target, name in ((self._show, "show"), (self._probe_loop, "probe")):
                if target == self._probe_loop and self.probe is None:
                    continue
                t = threading.Thread(target=target, name=f"amqp-locks-wait-{name}", daemon=True)
                t.start()
                self._threads.append(t)

    def _show(self) -> None:
        if self._stop.wait(self.show_after):
            return
        from rich.console import Console
        from rich.live import Live

        with self._lock:
            if self._stop.is_set():
                return
            console = Console(stderr=True, force_terminal=True)
            live = Live(
                console=console,
                get_renderable=self._render,
                refresh_per_second=2,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=True,  # log records print above the line
            )
            live.start()
            self._live = live

    def _probe_loop(self) -> None:
        assert self.probe is not None
        while not self._stop.is_set():
            try:
                self.holders = self.probe()
            except Exception as exc:  # the line just goes without them
                log.debug("wait line: reading the holders failed: %s", exc)
            if self._stop.wait(self.probe_interval):
                return

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            live, self._live = self._live, None
            self._threads = []
        if live is not None:
            live.stop()

    def __enter__(self) -> WaitLine:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
