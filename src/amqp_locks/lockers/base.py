"""The `Locker` protocol (ActiveMQ's `Locker` interface, in seconds).

A locker guards one named lock. `start()` blocks until the lock is held — a standby waits
here, re-trying every `lock_acquire_sleep_interval` seconds (ActiveMQ's default: 10 s);
with `fail_if_locked` it raises at once instead. `stop()`, from any thread, interrupts a
waiting `start()` promptly and releases a held lock. `keep_alive()` says whether the lock
is still held; a master calls it every keep-alive period and demotes itself on False.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from ..errors import ConfigurationError, LockedElsewhere, LockerStopped

log = logging.getLogger("amqp_locks.lockers")

#: ActiveMQ's defaults, in seconds.
DEFAULT_LOCK_ACQUIRE_SLEEP_INTERVAL = 10.0


class Locker(ABC):
    """Base of every locker: the waiting loop, stop/interrupt, and the fencing token."""

    #: A new master should wait one keep-alive period before starting work (file locker:
    #: gives an old master that lost the file its keep-alive to notice, AMQ-4705).
    settle_before_work = False

    def __init__(
        self,
        name: str = "default",
        *,
        lock_acquire_sleep_interval: float = DEFAULT_LOCK_ACQUIRE_SLEEP_INTERVAL,
        fail_if_locked: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ConfigurationError(
                f"locker name must be a non-empty str of <= 200 chars: {name!r}"
            )
        if lock_acquire_sleep_interval <= 0:
            raise ConfigurationError(
                "lock_acquire_sleep_interval must be > 0 seconds, "
                f"got {lock_acquire_sleep_interval}"
            )
        self.name = name
        self.lock_acquire_sleep_interval = float(lock_acquire_sleep_interval)
        self.fail_if_locked = fail_if_locked
        self._stopping = threading.Event()
        self._state_lock = threading.RLock()
        self._held = False
        self.fencing_token = 0
        #: Failed attempts so far, and set once `start()` waits as standby (observable).
        self.attempts = 0
        self.standing_by = threading.Event()
        self._watchers: list[Callable[[], None]] = []
        self._watch_lock = threading.Lock()  # not _state_lock: a hung keep-alive holds that

    # --- what a locker implements ---------------------------------------------------------

    @abstractmethod
    def _try_acquire(self) -> bool:
        """One attempt; True when the lock is now held (and `fencing_token` set)."""

    @abstractmethod
    def _release(self) -> None:
        """Give the lock back (only called while held)."""

    @abstractmethod
    def _keep_alive(self) -> bool:
        """True if the lock is still held; may raise on I/O errors (the policy decides)."""

    def check_keep_alive_period(self, period: float) -> None:  # noqa: B027 - optional hook
        """Refuse a keep-alive period this locker cannot work with (lease lockers)."""

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (from any thread) whenever the held lock may just have been
        lost — the connection holding it closed, its lease marked lost — so that the
        master's service runs a keep-alive at once instead of at the next period. Returns
        a function that removes the callback."""
        with self._watch_lock:
            self._watchers.append(callback)

        def unwatch() -> None:
            with self._watch_lock:
                if callback in self._watchers:
                    self._watchers.remove(callback)

        return unwatch

    def _alarm(self) -> None:
        """Tell the watchers the lock may be lost (a locker calls this; never blocks on I/O)."""
        with self._watch_lock:
            watchers = list(self._watchers)
        for callback in watchers:
            try:
                callback()
            except Exception:
                log.exception("%r: lock watcher failed", self)

    def default_keep_alive_timeout(self, period: float) -> float | None:
        """How long a master's keep-alive may go unanswered before it counts as failed
        (`LockableService(keep_alive_timeout=None)`): one keep-alive period — by then the
        next one is due. None: no limit (the service waits for the call)."""
        return period if period > 0 else None

    def valid_without_server(self) -> bool:
        """Is the lock known to hold without asking its server? A lease still valid by the
        local clock is (a keep-alive error is then ridden out, as ActiveMQ's
        LeaseLockerIOExceptionHandler does); a lock tied to a session is not."""
        return False

    def default_lease_margin(self, period: float) -> float:
        """`LockableService(lease_margin=None)`: how long before the lock expires by itself
        a master demotes unless renewed. 0 for locks that do not expire."""
        return 0.0

    def valid_until(self) -> float | None:
        """For a lock that expires unless renewed (a lease): the ``time.monotonic()``
        instant it runs out, on this process's monotonic clock — past it the holder
        must not believe it holds, whatever its keep-alive is doing. None: the lock does
        not expire by itself (it lives as long as a process, a transaction, a connection).
        """
        return None

    @property
    def holder_id(self) -> str:
        """Who holds the lock when we do (for logs and status)."""
        import os
        import socket

        return f"{socket.gethostname()}:{os.getpid()}"

    def close(self) -> None:
        """Release resources (connections); the locker may not be used again."""
        self.stop()

    # --- the protocol -------------------------------------------------------------------

    @property
    def held(self) -> bool:
        return self._held

    def start(self, stop: threading.Event | None = None) -> None:
        """Block until the lock is held (standby waits here). `stop`: the caller's own
        event, which ends the wait too once set, even when it was set just before this
        call, which `interrupt()` then cannot be (start() forgets earlier interrupts)."""
        self._stopping.clear()
        attempt = 0
        while True:
            if self._stopping.is_set() or (stop is not None and stop.is_set()):
                raise LockerStopped(f"{self!r}: stopped while waiting for the lock")
            with self._state_lock:
                if self._held:
                    return
                if self._try_acquire():
                    self._held = True
                    self.standing_by.clear()
                    log.info(
                        "%r acquired by %s (fencing token %d)",
                        self,
                        self.holder_id,
                        self.fencing_token,
                    )
                    return
            attempt += 1
            self.attempts += 1
            if self.fail_if_locked:
                raise LockedElsewhere(f"{self!r} is held by someone else (fail_if_locked)")
            if attempt == 1:
                log.info("%r is held elsewhere; %s waits as standby", self, self.holder_id)
                self.standing_by.set()
            self._pause()

    def _pause(self) -> None:
        """Between attempts: sleep one interval, waking at once on `stop()`."""
        self._stopping.wait(self.lock_acquire_sleep_interval)

    def interrupt(self) -> None:
        """Make a waiting `start()` give up (`LockerStopped`) without releasing a held lock:
        whoever holds it releases with `stop()` once the work it guards has stopped."""
        self._stopping.set()

    def stop(self) -> None:
        """Interrupt a waiting `start()` and release the lock if held. Idempotent."""
        self._stopping.set()
        with self._state_lock:
            if self._held:
                self._held = False
                try:
                    self._release()
                finally:
                    log.info("%r released by %s", self, self.holder_id)

    def keep_alive(self) -> bool:
        """Whether the lock is still held. False (or an exception) means demote."""
        with self._state_lock:
            if not self._held:
                return False
            ok = self._keep_alive()
            if not ok:
                log.warning("%r keep-alive failed for %s: the lock is lost", self, self.holder_id)
            return ok

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
