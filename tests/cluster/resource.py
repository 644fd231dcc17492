"""A fenced resource for the cluster tests: refuses writes with stale fencing tokens and
counts holders that overlap beyond the permits."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field

from amqp_locks import Lease

from ..faults.resource import ProtectedResource


@dataclass
class FencedResource:
    """The fault suite's fencing resource (``tests/faults/resource.py``: a token at least
    the highest seen for its key is accepted, a lower one refused; a key is a lock, a slot,
    a permit id), plus live overlap tracking of in-process leases.

    `enter`/`leave` track holders inside the critical section; entering while `permits`
    others are inside whose leases are not known lost is an overlap, and how long those
    leases then took to be marked lost is recorded.
    """

    permits: int
    store: ProtectedResource = field(default_factory=ProtectedResource)
    grants: dict[object, list[int]] = field(default_factory=lambda: defaultdict(list))
    inside: dict[object, Lease] = field(default_factory=dict)
    overlaps: int = 0
    #: Per overlap: seconds until the older holders' leases were marked lost.
    windows: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, key: Hashable, token: int) -> bool:
        return self.store.write("", key, token)

    def highest(self, key: Hashable) -> int:
        return self.store.highest(key) or 0

    @property
    def accepted(self) -> int:
        return sum(w.accepted for w in self.store.log)

    @property
    def refused(self) -> int:
        return sum(not w.accepted for w in self.store.log)

    def enter(self, holder: object, key: object, lease: Lease) -> None:
        with self._lock:
            self.grants[key].append(lease.fencing_token)
            live = [other for other in self.inside.values() if not other.lost.is_set()]
            if len(live) >= self.permits:
                self.overlaps += 1
                threading.Thread(target=self._measure, args=(live,), daemon=True).start()
            self.inside[holder] = lease

    def _measure(self, live: list[Lease]) -> None:
        """How long after an overlapping grant the older holders were told they lost
        (the crash window that only fencing covers); 10 s means never."""
        start = time.monotonic()
        told = [lease.lost.wait(10) for lease in live]
        window = time.monotonic() - start
        with self._lock:
            self.windows.append(window if all(told) else 10.0)

    def leave(self, holder: object) -> None:
        with self._lock:
            self.inside.pop(holder, None)

    def duplicate_tokens(self) -> dict[object, list[int]]:
        """Per key, tokens handed to more than one grant (must be empty)."""
        dupes = {}
        for key, tokens in self.grants.items():
            seen = sorted(t for t in set(tokens) if tokens.count(t) > 1)
            if seen:
                dupes[key] = seen
        return dupes
