"""COMMAND as a child of `run` and `elect`: started, sent our signals, stopped when the
lock is lost (SIGTERM, then SIGKILL), its exit status as a shell reports it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from ..signals import handlers
from .common import CliError, Globals, error_line
from .exitcodes import Exit

#: Signals forwarded to COMMAND while it runs (SIGINT too: `kill -INT` from a script must
#: reach it; a terminal's Ctrl-C reaches both processes anyway, they share a group).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
    signal.SIGCONT,
)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it (128 + N when killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def own_group() -> bool:
    """Whether COMMAND gets a process group of its own: yes unless stdin is a terminal (an
    interactive COMMAND must stay in the terminal's foreground group to read from it)."""
    try:
        return not os.isatty(0)
    except OSError:
        return True


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a function for the child that asks for SIGKILL when its parent dies, so a
    COMMAND never outlives a killed `amqp-locks` (which no longer holds the lock)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:  # runs in the child between fork and exec: no locks, no allocation
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: we are on our own
            os._exit(Exit.UNAVAILABLE)

    return arm


PR_SET_PDEATHSIG = 1


def spawn(argv: list[str], env: dict[str, str], group: bool) -> subprocess.Popen[bytes]:
    """Start COMMAND; 127 when not found, 126 when not executable (one line each)."""
    try:
        return subprocess.Popen(
            argv,
            env=env,
            process_group=0 if group else None,
            preexec_fn=_parent_death_signal(),
        )
    except FileNotFoundError:
        raise CliError(Exit.NOT_FOUND, f"{argv[0]}: command not found") from None
    except (PermissionError, IsADirectoryError):
        raise CliError(Exit.NOT_EXECUTABLE, f"{argv[0]}: permission denied") from None
    except OSError as exc:
        raise CliError(Exit.NOT_EXECUTABLE, f"{argv[0]}: cannot execute: {exc.strerror}") from None


class Supervisor:
    """Runs COMMAND, forwards our signals to it, and stops it if the lock is lost:
    SIGTERM, then SIGKILL after `grace` seconds. With `group`, COMMAND leads a process
    group of its own and signals go to the whole group (its children too)."""

    def __init__(
        self, proc: subprocess.Popen[bytes] | None, grace: float, g: Globals, group: bool
    ) -> None:
        self._proc = proc
        self.grace = grace
        self.g = g
        self.group = group
        self.lost_reason: str | None = None
        self.lost_at = 0.0
        self._lock = threading.Lock()
        #: Signals forwarded before COMMAND was started (see `start`).
        self._pending: list[int] = []

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, "COMMAND not started"
        return self._proc

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        """Spawn COMMAND, then forward the signals that came while it was being started.
        Install `forward` before calling this: a signal in between would otherwise get its
        default action and kill us, leaving COMMAND unsupervised."""
        self._proc = spawn(argv, env, self.group)
        for signum in self._pending:
            self.signal(signum)
        self._pending.clear()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is not None and not self.group:
            return
        try:
            if self.group:
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)
        except (ProcessLookupError, PermissionError):
            pass

    def forward(self, signum: int, frame: FrameType | None) -> None:
        if self._proc is None:
            self._pending.append(signum)
        else:
            self.signal(signum)

    def on_lost(self, what: str, reason: str | None) -> None:
        with self._lock:
            if self.lost_reason is not None or self.proc.poll() is not None:
                return  # COMMAND already ended: it ran under the lock throughout
            self.lost_reason = reason or "lost"
        error_line(
            f"{what} lost ({self.lost_reason}); stopping COMMAND "
            f"(SIGTERM, SIGKILL after {self.grace:g}s)"
        )
        self.lost_at = time.monotonic()
        self.signal(signal.SIGTERM)
        timer = threading.Timer(self.grace, self._kill)
        timer.daemon = True
        timer.start()

    def _kill(self) -> None:
        self.signal(signal.SIGKILL)

    def wait(self) -> int:
        with handlers(self.forward, FORWARDED):
            # In slices: a signal handled by another thread of ours would not interrupt a
            # plain waitpid, and its handler (run by this thread) would wait with it.
            while True:
                try:
                    status = self.proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if self.lost_reason is not None and self.group:
                self._reap_group()
            return status

    def _reap_group(self) -> None:
        """The lock is lost and COMMAND ended: what is left of its group gets the rest of
        the grace period, then SIGKILL (nothing keeps working without the lock)."""
        deadline = self.lost_at + self.grace
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
