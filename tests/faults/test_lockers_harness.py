"""The locker fault harness's own judgement: which overlaps the soak may excuse."""

from __future__ import annotations

from typing import Any, cast

from .history import Event
from .lockers_harness import Worker, unexplained_overlaps


class FakeWorker:
    def __init__(self, granted: list[str], pauses: list[tuple[float, float]]) -> None:
        self.granted = granted
        self.pauses = pauses

    paused_between = Worker.paused_between


def ev(t: float, kind: str, grant: str) -> Event:
    return Event(t, cast(Any, kind), grant, 0, 0)


OVERLAP = [ev(0, "grant", "a-1"), ev(10, "grant", "b-1"), ev(11, "lost", "a-1")]


def test_an_overlap_with_a_paused_holder_is_excused() -> None:
    old_paused = FakeWorker(["a-1"], [(8.0, 10.5)])  # paused before the re-grant
    assert unexplained_overlaps(OVERLAP, cast(Any, [old_paused, FakeWorker(["b-1"], [])])) == []


def test_an_overlap_without_a_pause_is_not() -> None:
    paused_long_before = FakeWorker(["a-1"], [(1.0, 2.0)])  # outside the 5 s reach
    bad = unexplained_overlaps(OVERLAP, cast(Any, [paused_long_before, FakeWorker(["b-1"], [])]))
    assert len(bad) == 1 and "a-1" in bad[0] and "b-1" in bad[0]


def test_back_to_back_masterships_are_not_overlaps() -> None:
    events = [ev(0, "grant", "a-1"), ev(5, "lost", "a-1"), ev(5.1, "grant", "b-1")]
    workers = [FakeWorker(["a-1"], []), FakeWorker(["b-1"], [])]
    assert unexplained_overlaps(events, cast(Any, workers)) == []
