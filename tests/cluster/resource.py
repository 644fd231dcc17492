"""A fenced resource for the cluster tests: refuses writes with stale fencing tokens and
counts holders that overlap beyond the permits."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class FencedResource:
    """Keeps the highest token accepted per key (a lock, a slot, a permit id).

    `write` accepts a token >= the highest seen for its key and refuses a lower one: a
    holder whose lock was re-granted is fenced off once the new holder has written.
    `enter`/`leave` count holders the library reports as holding: more than `permits` at
    once is an overlap.
    """

    permits: int
    highest: dict[object, int] = field(default_factory=dict)
    accepted: list[tuple[object, int]] = field(default_factory=list)
    refused: list[tuple[object, int]] = field(default_factory=list)
    grants: dict[object, list[int]] = field(default_factory=lambda: defaultdict(list))
    inside: set[object] = field(default_factory=set)
    overlaps: int = 0
    max_inside: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, key: object, token: int) -> bool:
        with self._lock:
            if token < self.highest.get(key, 0):
                self.refused.append((key, token))
                return False
            self.highest[key] = token
            self.accepted.append((key, token))
            return True

    def enter(self, holder: object, key: object, token: int) -> None:
        with self._lock:
            self.grants[key].append(token)
            self.inside.add(holder)
            self.max_inside = max(self.max_inside, len(self.inside))
            if len(self.inside) > self.permits:
                self.overlaps += 1

    def leave(self, holder: object) -> None:
        with self._lock:
            self.inside.discard(holder)

    def tokens_strictly_increase(self) -> bool:
        """Per key, every grant's token is above the previous grant's."""
        return all(all(a < b for a, b in zip(t, t[1:])) for t in self.grants.values())
