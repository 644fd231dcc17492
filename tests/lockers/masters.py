"""Counting masters across every locker test: never two at once."""

from __future__ import annotations

import threading


class MasterLedger:
    """Every service reports entering/leaving mastership here; overlaps are counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: set[str] = set()
        self.overlaps = 0
        self.grants = 0

    def enter(self, who: str) -> None:
        with self._lock:
            if self.current:
                self.overlaps += 1
            self.current.add(who)
            self.grants += 1

    def leave(self, who: str) -> None:
        with self._lock:
            self.current.discard(who)
