"""The fault-injecting TCP proxy; it lives in `tests/faults/proxy.py` (kept importable here)."""

from __future__ import annotations

from .faults.proxy import FaultProxy

__all__ = ["FaultProxy"]
