"""LockableService: standby -> master -> keep-alive -> demote (ActiveMQ's `Lockable`).

The service starts as standby and blocks in `locker.start()`. Once it holds the lock it is
master and runs the work (a callable given a `threading.Event` that asks it to stop) on its
own thread. Every `lock_keep_alive_period` seconds it calls `locker.keep_alive()`; a False
answer demotes it: the work is told to stop and joined, the lock is given up, and the
service waits as standby again (ActiveMQ restarts the broker as a slave). An exception in
the keep-alive is handed to the policy — ActiveMQ's IOException handler — which decides
whether to keep mastership; nothing in the loop dies silently. With `use_lock=False` the
work runs without any lock (ActiveMQ's development switch).

The keep-alive runs on a helper thread, so a call hung on a silent network cannot hold the
master: one that has not answered within `keep_alive_timeout` (default: the keep-alive
period) counts as failed — a `KeepAliveTimeout` for the policy. A lock that expires unless
renewed (the lease locker) adds one hard rule: the master stops believing `lease_margin`
seconds before its lease runs out (on its monotonic clock, counted from before the renewal),
whatever the keep-alive is doing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Protocol

from . import events, signals
from .errors import ConfigurationError, KeepAliveTimeout, LockerStopped
from .lockers.base import Locker
from .signals import handlers

log = logging.getLogger("amqp_locks.service")

#: What stops a `LockableService.run()` in the main thread, as `stop()` would.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class State(enum.Enum):
    STOPPED = "stopped"
    STANDBY = "standby"
    MASTER = "master"


class KeepAlivePolicy(Protocol):
    def on_error(self, locker: Locker, exc: BaseException) -> bool:
        """An exception escaped `keep_alive()`: True keeps mastership, False demotes."""
        ...


class LeaseAwarePolicy:
    """The default (ActiveMQ's LeaseLockerIOExceptionHandler): a lease locker rides out a
    database blip while its lease is still valid by its (corrected) local clock; any other
    locker demotes on the first error, since it cannot know whether it still holds."""

    def on_error(self, locker: Locker, exc: BaseException) -> bool:
        if locker.valid_without_server():
            log.warning("%r keep-alive error, lease still valid: staying master (%s)", locker, exc)
            return True
        log.error("%r keep-alive error: demoting (%s)", locker, exc)
        return False


Work = Callable[[threading.Event], Any]
StateCallback = Callable[["LockableService", State], Any]


class LockableService:
    """Run `work` only while this process holds `locker`'s lock.

    ``on_state(service, state)`` is called on every transition. ``work_stop_timeout``
    bounds the wait for the work to stop after demotion before the lock is given up
    anyway (a warning is logged: the work did not honour its stop event).

    ``keep_alive_timeout``: a keep-alive that has not answered after this many seconds
    counts as failed (`KeepAliveTimeout`, decided by the policy: every locker but a lease
    locker with a valid lease demotes). Default: the locker's
    ``default_keep_alive_timeout(period)`` — the keep-alive period, except for the AMQP
    locker, whose keep-alive ends by itself when missed heartbeats are detected.
    ``math.inf`` waits for ever (as before).

    ``lease_margin`` (lockers whose lock expires, i.e. the lease locker): the master
    demotes itself this many seconds before its lease runs out unless a keep-alive renewed
    it, even if the keep-alive has not answered. Default: half the slack between the lease
    and the keep-alive period, ``(lease_duration - lock_keep_alive_period) / 2``.
    """

    def __init__(
        self,
        locker: Locker,
        work: Work,
        *,
        use_lock: bool = True,
        lock_keep_alive_period: float = 0.0,
        policy: KeepAlivePolicy | None = None,
        on_state: StateCallback | None = None,
        work_stop_timeout: float = 30.0,
        keep_alive_timeout: float | None = None,
        lease_margin: float | None = None,
    ) -> None:
        if lock_keep_alive_period < 0:
            raise ConfigurationError(
                f"lock_keep_alive_period must be >= 0, got {lock_keep_alive_period}"
            )
        if use_lock:
            locker.check_keep_alive_period(lock_keep_alive_period)
        if lease_margin is None:
            lease_margin = locker.default_lease_margin(lock_keep_alive_period)
        if lease_margin < 0:
            raise ConfigurationError(f"lease_margin must be >= 0, got {lease_margin}")
        self.lease_margin = float(lease_margin)
        if keep_alive_timeout is None:
            keep_alive_timeout = locker.default_keep_alive_timeout(lock_keep_alive_period)
        if keep_alive_timeout is not None and not keep_alive_timeout > 0:
            raise ConfigurationError(f"keep_alive_timeout must be > 0, got {keep_alive_timeout}")
        self.keep_alive_timeout = keep_alive_timeout
        self._pending: concurrent.futures.Future[bool] | None = None
        self._pending_since = 0.0
        self.locker = locker
        self.work = work
        self.use_lock = use_lock
        self.lock_keep_alive_period = float(lock_keep_alive_period)
        self.policy: KeepAlivePolicy = policy or LeaseAwarePolicy()
        self.on_state = on_state
        self.work_stop_timeout = work_stop_timeout
        self._state = State.STOPPED
        self._stop = threading.Event()
        #: Wakes the master loop: stop(), the work's end, or the locker's alarm.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.masterships = 0
        self.work_error: BaseException | None = None
        #: Why `run()` ended with an exception (also logged), e.g. when run on `start()`'s
        #: background thread.
        self.error: BaseException | None = None
        #: The signal that stopped `run()` (SIGINT or SIGTERM), else None.
        self.signal_received: signal.Signals | None = None

    @classmethod
    def from_config(cls, path: str, work: Work, **options: Any) -> LockableService:
        """A service whose locker and keep-alive come from a TOML file (lockers.config)."""
        from .lockers.config import load

        config = load(path)
        return cls(
            config.locker,
            work,
            use_lock=config.use_lock,
            lock_keep_alive_period=config.lock_keep_alive_period,
            **options,
        )

    @property
    def state(self) -> State:
        return self._state

    def _set(self, state: State) -> None:
        if state is self._state:
            return
        log.info(
            "%s: %s -> %s (%r)", self.locker.holder_id, self._state.value, state.value, self.locker
        )
        self._state = state
        events.emit(
            events.Event("state", type(self.locker).__name__, self.locker.name, 0.0, state.value)
        )
        if self.on_state is not None:
            try:
                self.on_state(self, state)
            except Exception:
                log.exception("on_state callback failed")

    # --- life cycle -----------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stop()`, SIGINT/SIGTERM, or until the work returns by itself.

        Run in the main thread, `run()` takes SIGINT (Ctrl-C) and SIGTERM (``kill``,
        systemd, Kubernetes) for the time it runs: either is a `stop()` — the work's stop
        event is set, the work joined, the lock released — and `run()` returns normally
        (no KeyboardInterrupt traceback); ``signal_received`` says which signal it was.
        The previous handlers are restored when `run()` returns. Elsewhere (a thread,
        `start()`) signals stay the caller's business: call `stop()`."""
        self._stop.clear()
        self.signal_received = None
        with self._stop_on_signals():
            self._serve()

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the service while `run()` runs (main thread only: Python
        runs signal handlers there and nowhere else)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
            # Only flags: a handler interrupts the main thread anywhere (inside a lock
            # acquire, a join); the loop it interrupted sees them and winds down.
            self.signal_received = signal.Signals(signum)
            log.warning("%s received: stopping (%r)", self.signal_received.name, self.locker)
            self._stop.set()
            self._wake.set()
            self.locker.interrupt()

        with handlers(on_signal, STOP_SIGNALS):
            yield

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.use_lock:
                    self._run_work_until_done()
                    return
                self._set(State.STANDBY)
                try:
                    self.locker.start(self._stop)  # stop() or a signal ends it
                except LockerStopped:
                    return
                except Exception as exc:
                    # e.g. LockedElsewhere (fail_if_locked) or an unusable lock directory:
                    # reported, kept on `error`, and raised to whoever called run().
                    self.error = exc
                    log.exception("%r: could not take the lock", self.locker)
                    raise
                if self._serve_as_master():
                    return  # the work finished (or stop was asked): we are done
        finally:
            self.locker.stop()
            self._set(State.STOPPED)

    def start(self) -> threading.Thread:
        """`run()` on a background thread (an exception ends it, logged, on `error`)."""
        self._thread = threading.Thread(
            target=self._run_logged, name="amqp-locks-service", daemon=True
        )
        self._thread.start()
        return self._thread

    def _run_logged(self) -> None:
        try:
            self.run()
        except Exception as exc:
            self.error = exc

    def stop(self, timeout: float | None = None) -> None:
        """Stop the work, give up the lock (interrupting a standby wait), and wait.

        The lock is given up by `run()` only after the work has stopped: released any
        earlier, a standby could start its work while ours still runs."""
        self._stop.set()
        self._wake.set()
        self.locker.interrupt()
        if self._thread is not None and self._thread is not threading.current_thread():
            signals.join(self._thread, timeout)

    # --- mastership -------------------------------------------------------------------------

    def _serve_as_master(self) -> bool:
        """Hold mastership until demoted (False) or finished/stopped (True)."""
        period = self.lock_keep_alive_period
        self._pending = None  # a keep-alive of an earlier mastership says nothing about this
        self._wake.clear()
        if self.locker.settle_before_work and period > 0:
            # AMQ-4705: give a master that lost the file one keep-alive to notice first.
            if self._stop.wait(period):
                return True
            if not self._keep_alive_ok():
                self.locker.stop()
                return False
        if self._stop.is_set():  # stop() came as the lock was taken: no work, release
            return True
        unwatch = self.locker.watch(self._wake.set)  # a lost connection: keep-alive now
        self.masterships += 1
        self._set(State.MASTER)
        stop_work = threading.Event()
        worker = threading.Thread(
            target=self._work_thread, args=(stop_work,), name="amqp-locks-master", daemon=True
        )
        worker.start()
        demoted = False
        while True:
            wait = period if period > 0 else None
            deadline = self._believe_until()
            if deadline is not None:  # wake up in time to demote before the lease runs out
                left = max(0.0, deadline - time.monotonic())
                wait = left if wait is None else min(wait, left)
            if self._wait_stop_or_done(wait):
                break
            if not self._keep_alive_ok():
                demoted = True
                break
        unwatch()
        stop_work.set()
        signals.join(worker, self.work_stop_timeout)
        if worker.is_alive():
            log.warning("work did not stop within %.1fs of its stop event", self.work_stop_timeout)
        if demoted:
            events.emit(events.Event("demoted", type(self.locker).__name__, self.locker.name))
            log.warning(
                "%s demoted from %r: waiting as standby again", self.locker.holder_id, self.locker
            )
            # Not master any more: say so before giving the lock up, which may wait for a
            # keep-alive still hung on a silent connection.
            self._set(State.STANDBY)
            self.locker.stop()
            return False
        return True

    def _believe_until(self) -> float | None:
        """The monotonic instant past which this master must not believe (lease lockers)."""
        until = self.locker.valid_until()
        return None if until is None else until - self.lease_margin

    def _wait_stop_or_done(self, timeout: float | None) -> bool:
        """Wait up to `timeout` for stop(), the work's own end (which sets the stop event
        too) or the locker's alarm; True if stop or the end happened."""
        if self._stop.is_set():
            return True
        signals.wait_event(self._wake, timeout)  # run() in the main thread sees signals
        self._wake.clear()
        return self._stop.is_set()

    def _keep_alive_ok(self) -> bool:
        deadline = self._believe_until()
        if deadline is not None and time.monotonic() >= deadline:
            log.error(
                "%r: lease runs out within %.2fs and was not renewed: demoting",
                self.locker,
                self.lease_margin,
            )
            return False
        call = self._pending
        if call is None:  # else the previous keep-alive has not answered yet: wait for it
            call = self._pending = self._call_keep_alive()
            self._pending_since = time.monotonic()
        now = time.monotonic()
        limits = [] if deadline is None else [deadline - now]
        if self.keep_alive_timeout is not None and math.isfinite(self.keep_alive_timeout):
            limits.append(self._pending_since + self.keep_alive_timeout - now)
        try:
            ok = signals.result(call, max(0.0, min(limits)) if limits else None)
        except concurrent.futures.TimeoutError:
            if call.done():
                # Its own answer: an error (BrokerTimeout is one), or it answered as the
                # wait ran out (signals.result), which is no timeout.
                self._pending = None
                own = call.exception()
                if own is not None:
                    return self._policy(own)
                return self._renewed(call.result())
            if deadline is not None and time.monotonic() >= deadline:
                events.emit(events.keep_alive(self.locker, self._pending_since, None))
                log.error(
                    "%r: keep-alive did not answer and the lease runs out within %.2fs: demoting",
                    self.locker,
                    self.lease_margin,
                )
                return False
            # The call stays pending: the next check waits for the same one.
            return self._policy(
                KeepAliveTimeout(f"keep-alive did not answer within {self.keep_alive_timeout}s")
            )
        except Exception as exc:
            self._pending = None
            return self._policy(exc)
        self._pending = None
        return self._renewed(ok)

    def _renewed(self, ok: bool) -> bool:
        """The keep-alive's answer, reported."""
        events.emit(events.keep_alive(self.locker, self._pending_since, ok))
        return ok

    def _policy(self, exc: BaseException) -> bool:
        events.emit(events.keep_alive(self.locker, self._pending_since, exc))
        try:
            return self.policy.on_error(self.locker, exc)
        except Exception:
            log.exception("keep-alive policy failed: demoting")
            return False

    def _call_keep_alive(self) -> concurrent.futures.Future[bool]:
        """`locker.keep_alive()` on a helper thread (a hung call cannot hold us)."""
        fut: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def call() -> None:
            fut.set_running_or_notify_cancel()
            try:
                fut.set_result(self.locker.keep_alive())
            except BaseException as exc:
                fut.set_exception(exc)

        threading.Thread(target=call, name="amqp-locks-keep-alive", daemon=True).start()
        return fut

    def _work_thread(self, stop_work: threading.Event) -> None:
        try:
            self.work(stop_work)
        except BaseException as exc:
            self.work_error = exc
            log.exception("master work failed")
        finally:
            if not stop_work.is_set():
                self._stop.set()  # the work ended by itself: the service is done
                self._wake.set()

    def _run_work_until_done(self) -> None:
        self._set(State.MASTER)
        stop_work = threading.Event()
        worker = threading.Thread(target=self._work_thread, args=(stop_work,), daemon=True)
        worker.start()
        signals.wait_event(self._stop)
        stop_work.set()
        signals.join(worker, self.work_stop_timeout)
