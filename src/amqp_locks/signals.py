"""Installing signal handlers for the length of a block, and putting back what was there:
the CLI's supervisor (passing signals on to its child) and ``LockableService.run()``
(SIGINT/SIGTERM as ``stop()``) both need it, in the main thread only."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


@contextmanager
def handlers(
    handler: Callable[[int, FrameType | None], Any], sigs: tuple[int, ...]
) -> Iterator[None]:
    """`handler` for each of `sigs` while the block runs; the previous handlers after."""
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
