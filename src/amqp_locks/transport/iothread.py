"""The private I/O thread: one asyncio loop that owns the AMQP connection.

Keeping the connection on its own thread is what lets heartbeats flow while the caller blocks
for minutes (sync code) or starves its own event loop (async code). Every protocol step runs
as a coroutine on this loop; the sync and asyncio facades only submit work to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("amqp_locks.transport")

T = TypeVar("T")
_ids = itertools.count(1)

#: Signals a process gets from outside (a user, a supervisor, its children). Python runs
#: their handlers in the main thread only, and a signal the kernel hands to our thread
#: does not interrupt the main thread's blocking call (`waitpid`, a lock wait): blocked
#: here, they always reach the main thread.
_ASYNC_SIGNALS = {
    getattr(signal, n)
    for n in (
        "SIGINT",
        "SIGTERM",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGWINCH",
        "SIGCONT",
        "SIGALRM",
        "SIGCHLD",
    )
    if hasattr(signal, n)
}


async def _cancel_others() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class IOThread:
    """A daemon thread running an asyncio loop until :meth:`stop`."""

    def __init__(self, name: str = "amqp-locks-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        #: One stop at a time: a second one (two threads closing one Broker) would cancel
        #: the first one's wait for the loop's tasks and stop the loop under it.
        self._stopping = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"{name}-{next(_ids)}", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the I/O loop; the returned future is thread-safe."""
        if self.in_thread:
            coro.close()
            raise RuntimeError("blocking call made from the amqp-locks I/O thread (deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop after cancelling what still runs on it (waiting up to `timeout`
        for those tasks, then as long again for the thread). From another thread while a
        stop is under way, wait for that one instead (as long again at most)."""
        if self.in_thread:  # a callback on the loop cannot wait for the loop's tasks
            self.loop.stop()
            return
        if not self._stopping.acquire(timeout=2 * timeout):
            log.warning("another stop of the I/O thread did not end within %.1fs", 2 * timeout)
            return
        try:
            if not self.alive:
                return
            try:
                asyncio.run_coroutine_threadsafe(_cancel_others(), self.loop).result(timeout)
            except concurrent.futures.TimeoutError:
                log.warning("I/O thread tasks did not finish within %.1fs", timeout)
            except RuntimeError:  # the loop closed on its own since `alive` was read
                pass
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        finally:
            self._stopping.release()
