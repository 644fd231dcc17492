"""One fault scenario's moving parts: the shared history, a fenced and an unfenced protected
resource (every holder writes to both, so one run shows what fencing refused *and* what an
unfenced resource would have let through), holder processes, and a proxy per holder that
the test may fault.

Waiting is on conditions of the history or the resource log, polled with a deadline.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .checker import Verdict, check
from .history import Event, Recorder, load
from .holders import Holder, HolderSpec
from .proxy import FaultProxy
from .resource import ProtectedResource, Write

T = TypeVar("T")

POLL = 0.02


class FaultRun:
    def __init__(
        self,
        directory: Path,
        *,
        kind: str,
        url: str,
        name: str,
        permits: int,
        heartbeat: float,
    ) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kind, self.url, self.name = kind, url, name
        self.permits, self.heartbeat = permits, heartbeat
        self.history = self.dir / "history.jsonl"
        self.recorder = Recorder(self.history)
        self.fenced = ProtectedResource(fencing=True)
        self.unfenced = ProtectedResource(fencing=False)
        # Unix socket paths are limited to 108 bytes: pytest's tmp paths can be longer.
        self._sockets = Path(tempfile.mkdtemp(prefix="af-"))
        self.resources = (
            self.fenced.serve(self._sockets / "fenced.sock"),
            self.unfenced.serve(self._sockets / "unfenced.sock"),
        )
        self.holders: dict[str, Holder] = {}
        self.proxies: dict[str, FaultProxy] = {}
        self.started = time.monotonic()
        self._observer: Any = None

    # --- holders ------------------------------------------------------------------------

    def holder(
        self, worker: str, *, proxied: bool = False, url: str | None = None, **spec: Any
    ) -> Holder:
        """Start holder `worker`, through its own proxy when `proxied`."""
        target = url or self.url
        if proxied:
            from yarl import URL

            u = URL(target)
            proxy = FaultProxy(u.host or "127.0.0.1", u.port or 5672)
            self.proxies[worker] = proxy
            target = proxy.url()
        settings: dict[str, Any] = {"heartbeat": self.heartbeat, **spec}
        h = Holder(
            HolderSpec(
                worker=worker,
                url=target,
                kind=self.kind,
                name=self.name,
                history=str(self.history),
                resources=self.resources,
                stop_file=str(self.dir / f"{worker}.stop"),
                log_file=str(self.dir / f"{worker}.log"),
                **settings,
            )
        )
        self.holders[worker] = h
        return h.start()

    def kill(self, worker: str) -> float:
        return self.holders[worker].kill(self.recorder)

    # --- observing ----------------------------------------------------------------------

    def events(self) -> list[Event]:
        return load(self.history)

    def wait(self, find: Callable[[], T | None], timeout: float, what: str) -> T:
        """Poll `find` until it returns something, or fail naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            found = find()
            if found is not None and found is not False:
                return found
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}\n{self.logs()}"
                )
            for h in self.holders.values():
                killed = any(f == "kill" for _, f in h.faults)
                if not killed and h.process is not None and h.process.exitcode not in (None, 0):
                    raise AssertionError(f"holder {h.spec.worker} died\n{self.logs()}")
            time.sleep(POLL)

    def event(self, kind: str, worker: str, *, after: float = 0.0) -> Event | None:
        """The first `kind` event of `worker`'s grants at or after `after`."""
        for e in self.events():
            if e.kind == kind and e.grant.startswith(f"{worker}#") and e.t >= after:
                return e
        return None

    def end_of(self, grant: str) -> Event | None:
        for e in self.events():
            if e.grant == grant and e.kind != "grant":
                return e
        return None

    def wait_event(self, kind: str, worker: str, timeout: float, *, after: float = 0.0) -> Event:
        return self.wait(
            lambda: self.event(kind, worker, after=after), timeout, f"{kind} of {worker}"
        )

    def wait_waiting(self, count: int, holders: int, timeout: float = 30.0) -> None:
        """Until `count` acquires wait for the lock beside `holders` holders (so a fault
        starts with its waiters subscribed, not still starting up)."""
        from amqp_locks import Broker

        from . import primitives

        if self._observer is None:
            self._observer = Broker(self.url, heartbeat=5)
        observer = self._observer
        self.wait(
            lambda: primitives.waiting(self.kind, observer, self.name, holders) >= count,
            timeout,
            f"{count} waiting",
        )

    def writes(self, grant: str, *, after: float = 0.0) -> list[Write]:
        return [w for w in self.fenced.log if w.grant == grant and w.t >= after]

    def wait_write(self, grant: str, timeout: float, *, after: float = 0.0) -> Write:
        """The first write of `grant` at or after `after`, once both resources have it
        (returned as the fenced resource saw it)."""

        def both() -> Write | None:
            fenced = self.writes(grant, after=after)
            unfenced = [w for w in self.unfenced.log if w.grant == grant and w.t >= after]
            return fenced[0] if fenced and unfenced else None

        return self.wait(both, timeout, f"a write of {grant}")

    # --- ending -------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """Every holder releases and exits by itself (exit code 0 required)."""
        for h in self.holders.values():
            if h.alive:
                h.stop()
        for proxy in self.proxies.values():
            proxy.passthrough()
        codes = {w: h.join(timeout) for w, h in self.holders.items() if h.process is not None}
        killed = {w for w, h in self.holders.items() if any(f == "kill" for _, f in h.faults)}
        bad = {w: c for w, c in codes.items() if w not in killed and c != 0}
        assert not bad, f"holders did not exit cleanly: {bad}\n{self.logs()}"

    def verdict(self, *, fenced: bool = True, leaked: int | None = None) -> Verdict:
        resource = self.fenced if fenced else self.unfenced
        return check(
            self.events(),
            resource.log,
            permits=self.permits,
            run_end=time.monotonic(),
            leaked=leaked,
        )

    def logs(self) -> str:
        out = []
        for w, h in self.holders.items():
            tail = h.log_tail()
            if tail:
                out.append(f"--- {w} (pid {h.process.pid if h.process else '?'}) ---\n{tail}")
        return "\n".join(out)

    def close(self) -> None:
        for h in self.holders.values():
            if h.paused:
                with contextlib.suppress(ProcessLookupError):
                    h.resume()
            h.terminate()
        for proxy in self.proxies.values():
            proxy.close()
        if self._observer is not None:
            self._observer.close()
        self.fenced.close()
        self.unfenced.close()
        self.recorder.close()
        shutil.rmtree(self._sockets, ignore_errors=True)
