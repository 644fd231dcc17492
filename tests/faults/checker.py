"""Judges a fault run from its history and the protected resource's log.

(a) **overlaps**: maximal intervals in which more grants believed they held the lock than it
    has permits (``overlaps``), or two grants believed they held the same key
    (``key_overlaps``). A grant believes from its ``grant`` event to its first end event
    (release, lost, killed), or to the end of the run.
(b) **stale writes accepted**: writes the resource accepted from a grant after it had seen
    an attempt from a *newer* grant of the same key (newer = granted later). A resource
    that checks tokens refuses them as long as tokens rise with every grant of a key;
    ``token_regressions`` counts grants whose token was not above every earlier grant of
    their key, which is what would let stale writes through.
(c) **leaks** are the scenario's to measure (capacity after the run, from the broker or
    database); :class:`Verdict` carries the figure so one object says it all.

``cut`` (optional) stops counting a grant's belief at a given instant: a fault run cuts the
beliefs of holders it paused at the pause, because the design promises nothing for a
process that cannot run (fencing covers what it does after it resumes, and (b) is always
judged on the full log).

``margins`` are, per ``lost`` event, the time from the holder learning it lost the lock to
the next grant of the same key: positive means the holder knew before anyone else got it
(the design's promise for missed heartbeats and lease expiry); negative is an overlap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .history import ENDS, Event
from .resource import Write


@dataclass
class Verdict:
    permits: int
    grants: int = 0
    overlaps: int = 0
    overlap_seconds: float = 0.0
    key_overlaps: int = 0
    max_believers: int = 0
    stale_accepted: int = 0
    rejected: int = 0
    token_regressions: int = 0
    margins: list[float] = field(default_factory=list)
    unended: list[str] = field(default_factory=list)
    leaked: int | None = None

    @property
    def min_margin(self) -> float | None:
        return min(self.margins) if self.margins else None

    def summary(self) -> str:
        margin = "n/a" if self.min_margin is None else f"{self.min_margin * 1000:.0f} ms"
        return (
            f"grants={self.grants} permits={self.permits} max_believers={self.max_believers} "
            f"(a) overlaps={self.overlaps} ({self.overlap_seconds * 1000:.0f} ms) "
            f"key_overlaps={self.key_overlaps} (b) stale_accepted={self.stale_accepted} "
            f"rejected={self.rejected} token_regressions={self.token_regressions} "
            f"(c) leaked={self.leaked} min_margin={margin} unended={len(self.unended)}"
        )


@dataclass(frozen=True)
class Interval:
    grant: str
    key: int
    token: int
    start: float
    end: float
    ended_by: str


def intervals(events: Iterable[Event], run_end: float) -> list[Interval]:
    """The belief interval of every grant (to `run_end` when it never ended)."""
    starts: dict[str, Event] = {}
    ends: dict[str, Event] = {}
    for e in sorted(events, key=lambda e: e.t):
        if e.kind == "grant":
            if e.grant in starts:
                raise ValueError(f"grant id {e.grant!r} granted twice")
            starts[e.grant] = e
        elif e.kind in ENDS and e.grant not in ends:
            ends[e.grant] = e
    out = []
    for gid, s in starts.items():
        end = ends.get(gid)
        out.append(
            Interval(
                gid,
                s.key,
                s.token,
                s.t,
                max(s.t, end.t) if end else run_end,
                end.kind if end else "",
            )
        )
    return sorted(out, key=lambda i: i.start)


def _sweep(spans: list[Interval], limit: int) -> tuple[int, float, int]:
    """(times the count rose above `limit`, seconds spent above it, max count)."""
    points = [(i.start, 1) for i in spans] + [(i.end, -1) for i in spans]
    points.sort(key=lambda p: (p[0], p[1]))  # an end at the same instant goes first
    count = peak = episodes = 0
    above_since = 0.0
    seconds = 0.0
    for t, step in points:
        before = count
        count += step
        peak = max(peak, count)
        if before <= limit < count:
            episodes += 1
            above_since = t
        elif count <= limit < before:
            seconds += t - above_since
    return episodes, seconds, peak


def check(
    events: Iterable[Event],
    writes: Iterable[Write] = (),
    *,
    permits: int,
    run_end: float | None = None,
    leaked: int | None = None,
    cut: Mapping[str, float] | None = None,
) -> Verdict:
    events = sorted(events, key=lambda e: e.t)
    end = run_end if run_end is not None else (events[-1].t if events else 0.0)
    spans = intervals(events, end)
    if cut:
        spans = [
            Interval(
                i.grant, i.key, i.token, i.start, max(i.start, min(i.end, cut[i.grant])), "cut"
            )
            if i.grant in cut and cut[i.grant] < i.end
            else i
            for i in spans
        ]
    v = Verdict(permits=permits, grants=len(spans), leaked=leaked)
    v.unended = [i.grant for i in spans if not i.ended_by]

    v.overlaps, v.overlap_seconds, v.max_believers = _sweep(spans, permits)
    by_key: dict[int, list[Interval]] = defaultdict(list)
    for i in spans:
        by_key[i.key].append(i)
    for key_spans in by_key.values():
        v.key_overlaps += _sweep(key_spans, 1)[0]
        highest: int | None = None
        for i in key_spans:  # in grant order
            if highest is not None and i.token <= highest:
                v.token_regressions += 1
            highest = i.token if highest is None else max(highest, i.token)

    # Margins: a holder that learnt of its loss, against the next grant of its key.
    for i in spans:
        if i.ended_by != "lost":
            continue
        later = [j.start for j in by_key[i.key] if j.start > i.start and j.grant != i.grant]
        if later:
            v.margins.append(min(later) - i.end)

    granted_at = {i.grant: i.start for i in spans}
    newest_seen: dict[int, float] = {}
    for w in sorted(writes, key=lambda w: w.t):
        if not w.accepted:
            v.rejected += 1
        mine = granted_at.get(w.grant)
        if mine is None:
            raise ValueError(f"write from unknown grant {w.grant!r}")
        seen = newest_seen.get(w.key)
        if w.accepted and seen is not None and seen > mine:
            v.stale_accepted += 1
        if seen is None or mine > seen:
            newest_seen[w.key] = mine
    return v


def peak(spans: Iterable[Interval], since: float = float("-inf")) -> int:
    """The most grants believed at one instant at or after `since` (intervals clipped to
    start there): what a capacity change must bring down."""
    clipped = [
        Interval(i.grant, i.key, i.token, max(i.start, since), i.end, i.ended_by)
        for i in spans
        if i.end > since
    ]
    return _sweep(clipped, 0)[2]
