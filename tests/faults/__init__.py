"""Fault-injection harness and scenarios (docs/failure-semantics.md): who held what, what the
protected resource accepted, the checker that judges a run (overlaps, stale writes, token
regressions, loss margins, leaks), and the faults — a TCP proxy, holder processes to kill
or pause, broker node faults, seeded random runs."""
