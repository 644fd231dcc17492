"""The history of a fault run: grant/release/loss events, recorded by every process.

Every process of a run appends JSON lines to one file opened with ``O_APPEND``; one
``write()`` per line keeps lines whole across processes. Times are ``time.monotonic()``,
which on Linux is one clock for every process on the machine, so events from different
processes order correctly.

A *grant* is one successful acquire, named by a run-unique id; it ends with the first of
``release`` (the holder let go), ``lost`` (the holder learnt it lost the lock) or ``killed``
(the test killed the holder: it stopped believing anything at that instant). Until then the
holder *believes* it holds the lock, whatever the broker thinks.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["grant", "release", "lost", "killed"]
ENDS: frozenset[str] = frozenset({"release", "lost", "killed"})


@dataclass(frozen=True)
class Event:
    t: float
    kind: Kind
    grant: str
    key: int
    """What the fencing token orders: the slot number, the token id, 0 for a mutex."""
    token: int
    detail: str = ""


class Recorder:
    """Appends events to a history file shared by the processes of a run."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def record(
        self,
        kind: Kind,
        grant: str,
        key: int,
        token: int,
        detail: str = "",
        t: float | None = None,
    ) -> Event:
        event = Event(time.monotonic() if t is None else t, kind, grant, key, token, detail)
        line = (json.dumps(asdict(event), separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
        return event

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(path: str | os.PathLike[str]) -> list[Event]:
    """Every event of a history file, in time order."""
    events = [
        Event(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()
    ]
    return sorted(events, key=lambda e: e.t)


def open_grants(events: list[Event], prefix: str) -> list[Event]:
    """Grants whose id starts with `prefix` and that have not ended yet (what a holder
    believes it holds: the parent records them ``killed`` before it kills the holder)."""
    ended = {e.grant for e in events if e.kind in ENDS}
    return [
        e
        for e in events
        if e.kind == "grant" and e.grant.startswith(prefix) and e.grant not in ended
    ]
