"""Fault-injection harness: who held what, what the protected resource accepted, and the
checker that judges a run (overlaps, stale writes, token regressions, loss margins)."""
