"""Per-name memory of a session, bounded: what it remembers of the names used last.

A session remembers a few things per lock name to save round trips (the fence queue
exists, the sentinel queue is declared, the mode was checked, when we last released it).
Applications lock per entity (``order-{id}``), so a long-lived process meets names without
end: these maps keep the `NAMES_REMEMBERED` names used most recently. Forgetting a name
costs at most the round trip its entry saved; nothing depends on an entry being there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping, MutableSet
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: Names each per-name map of a session keeps (the least recently used go first).
NAMES_REMEMBERED = 1024


class RecentSet(MutableSet[K]):
    """A set of at most `size` members; a lookup that finds a member keeps it longest."""

    def __init__(self, size: int | None = None) -> None:
        self.size = NAMES_REMEMBERED if size is None else size
        self._items: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        if key not in self._items:
            return False
        self._items.move_to_end(key)  # type: ignore[arg-type]
        return True

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: K) -> None:
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def discard(self, key: K) -> None:
        self._items.pop(key, None)


class RecentDict(MutableMapping[K, V]):
    """A dict of at most `size` entries; reading or writing an entry keeps it longest."""

    def __init__(self, size: int | None = None) -> None:
        self.size = NAMES_REMEMBERED if size is None else size
        self._items: OrderedDict[K, V] = OrderedDict()

    def __getitem__(self, key: K) -> V:
        value = self._items[key]
        self._items.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)
