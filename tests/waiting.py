"""Waiting for a condition by polling it, never by a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(cond: Callable[[], Any], timeout: float, what: str, step: float = 0.01) -> Any:
    """Poll `cond` every `step` seconds until it is truthy (returned) or `timeout` passes
    (AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)
