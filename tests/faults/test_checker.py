"""The checker and the protected resource, on histories whose verdict is known."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .checker import check, intervals, peak
from .history import Event, Recorder, load
from .resource import ProtectedResource, ResourceClient, Write


def ev(t: float, kind: str, grant: str, key: int = 0, token: int = 0) -> Event:
    return Event(t, kind, grant, key, token)  # type: ignore[arg-type]


def test_sequential_grants_have_no_overlap() -> None:
    events = [
        ev(0, "grant", "a", token=1),
        ev(1, "release", "a", token=1),
        ev(1, "grant", "b", token=2),  # granted the instant a let go: not an overlap
        ev(2, "lost", "b", token=2),
        ev(3, "grant", "c", token=3),
        ev(4, "killed", "c", token=3),
    ]
    v = check(events, permits=1)
    assert (v.grants, v.overlaps, v.key_overlaps, v.max_believers) == (3, 0, 0, 1)
    assert v.token_regressions == 0 and v.unended == []
    assert v.margins == [pytest.approx(1.0)]


def test_two_believers_of_one_permit_are_one_overlap_of_its_length() -> None:
    events = [
        ev(0, "grant", "a", token=1),
        ev(2, "grant", "b", token=2),
        ev(3, "lost", "a", token=1),  # a learnt of its loss 1 s after b got the lock
        ev(5, "release", "b", token=2),
    ]
    v = check(events, permits=1)
    assert (v.overlaps, v.key_overlaps, v.max_believers) == (1, 1, 2)
    assert v.overlap_seconds == pytest.approx(1.0)
    assert v.margins == [pytest.approx(-1.0)]


def test_semaphore_overlap_counts_believers_beyond_permits_and_per_key() -> None:
    events = [
        ev(0, "grant", "a", key=1, token=1),
        ev(0, "grant", "b", key=2, token=2),
        ev(1, "grant", "c", key=1, token=3),  # 3 believers of 2 permits, two on key 1
        ev(2, "release", "a", key=1, token=1),
        ev(3, "release", "b", key=2, token=2),
        ev(3, "release", "c", key=1, token=3),
    ]
    v = check(events, permits=2)
    assert (v.overlaps, v.key_overlaps, v.max_believers) == (1, 1, 3)
    assert v.overlap_seconds == pytest.approx(1.0)
    assert check(events[:2] + events[3:5], permits=2).overlaps == 0


def test_a_grant_never_ended_believes_to_the_end_of_the_run() -> None:
    events = [ev(0, "grant", "a", token=1), ev(1, "grant", "b", token=2)]
    v = check(events, permits=1, run_end=10)
    assert v.unended == ["a", "b"]
    assert v.overlap_seconds == pytest.approx(9.0)


def test_token_not_above_every_earlier_grant_of_its_key_is_a_regression() -> None:
    events = [
        ev(0, "grant", "a", key=1, token=5),
        ev(1, "release", "a", key=1, token=5),
        ev(1, "grant", "b", key=2, token=1),  # other key: no regression
        ev(2, "grant", "c", key=1, token=5),  # same token again
        ev(3, "release", "c", key=1, token=5),
        ev(4, "grant", "d", key=1, token=4),  # lower
    ]
    assert check(events, permits=2).token_regressions == 2


PAUSED = [
    ev(0, "grant", "old", token=1),
    ev(5, "grant", "new", token=2),  # re-granted while "old" was paused
    ev(8, "lost", "old", token=1),
    ev(9, "release", "new", token=2),
]


def _paused_run(fencing: bool) -> list[Write]:
    """Writes as a resource sees them: old writes, new writes, old writes once resumed."""
    resource = ProtectedResource(fencing=fencing)
    assert resource.write("old", 0, 1)
    assert resource.write("new", 0, 2)
    resource.write("old", 0, 1)  # the paused holder, resumed, not yet aware of its loss
    return resource.log


def test_fencing_resource_refuses_the_resumed_holder() -> None:
    writes = _paused_run(fencing=True)
    assert [w.accepted for w in writes] == [True, True, False]
    v = check(PAUSED, writes, permits=1)
    assert (v.stale_accepted, v.rejected, v.overlaps) == (0, 1, 1)


def test_unfenced_resource_accepts_the_stale_write_and_the_checker_counts_it() -> None:
    writes = _paused_run(fencing=False)
    assert all(w.accepted for w in writes)
    assert check(PAUSED, writes, permits=1).stale_accepted == 1


def test_equal_tokens_from_two_grants_get_through_and_are_counted() -> None:
    events = [ev(0, "grant", "a", token=7), ev(1, "grant", "b", token=7)]
    resource = ProtectedResource()
    resource.write("b", 0, 7)
    resource.write("a", 0, 7)  # a's token is not lower, so the resource cannot refuse it
    v = check(events, resource.log, permits=1, run_end=2)
    assert (v.stale_accepted, v.token_regressions) == (1, 1)


def test_write_from_an_unknown_grant_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown grant"):
        check([], [Write(0, "ghost", 0, 1, True)], permits=1)


def test_grant_id_reused_is_an_error() -> None:
    with pytest.raises(ValueError, match="granted twice"):
        intervals([ev(0, "grant", "a"), ev(1, "grant", "a")], 2)


@given(st.lists(st.tuples(st.floats(0.001, 5), st.floats(0, 5)), min_size=1, max_size=30))
def test_back_to_back_grants_never_overlap_and_one_extra_always_does(
    steps: list[tuple[float, float]],
) -> None:
    events, t = [], 0.0
    for n, (hold, gap) in enumerate(steps):
        events.append(ev(t, "grant", f"g{n}", token=n + 1))
        events.append(ev(t + hold, "release", f"g{n}", token=n + 1))
        t += hold + gap
    v = check(events, permits=1)
    assert (v.overlaps, v.key_overlaps, v.token_regressions, v.max_believers) == (0, 0, 0, 1)
    # One more holder inside the first grant's interval: exactly one more overlap.
    first_hold = steps[0][0]
    extra = [ev(first_hold / 2, "grant", "x", token=10**6), ev(first_hold, "lost", "x")]
    v = check(events + extra, permits=1)
    assert (v.overlaps, v.max_believers) == (1, 2)
    assert v.overlap_seconds == pytest.approx(first_hold / 2)


def _record_many(path: str, who: int, count: int) -> None:
    with Recorder(path) as rec:
        for i in range(count):
            rec.record("grant", f"p{who}-{i}", key=who, token=i, detail="x" * 200)


def test_history_lines_stay_whole_when_processes_append_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "history.jsonl")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(path, n, 300)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    events = load(path)
    assert len(events) == 1200
    assert {e.grant for e in events} == {f"p{n}-{i}" for n in range(4) for i in range(300)}


def _client_writes(address: str) -> None:
    client = ResourceClient(address)
    assert client.write("far", 3, 9)
    assert not client.write("far", 3, 8)
    client.close()


def test_resource_serves_other_processes(tmp_path: Path) -> None:
    resource = ProtectedResource()
    address = resource.serve(tmp_path / "resource.sock")
    try:
        p = multiprocessing.get_context("spawn").Process(target=_client_writes, args=(address,))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        assert [(w.grant, w.token, w.accepted) for w in resource.log] == [
            ("far", 9, True),
            ("far", 8, False),
        ]
    finally:
        resource.close()


def test_peak_counts_believers_from_an_instant_on() -> None:
    events = [
        ev(0, "grant", "a", key=1),
        ev(0, "grant", "b", key=2),
        ev(1, "grant", "c", key=3),
        ev(2, "lost", "c", key=3),  # c's slot was removed at 1.5; c learnt at 2
        ev(4, "release", "a", key=1),
        ev(5, "release", "b", key=2),
    ]
    spans = intervals(events, 5)
    assert (peak(spans), peak(spans, since=1.5), peak(spans, since=2), peak(spans, 4.5)) == (
        3,
        3,
        2,
        1,
    )


def test_a_cut_belief_stops_counting_at_the_cut_and_gives_no_margin() -> None:
    cut = {"old": 4.0}  # "old" was paused at 4 (before "new" was granted at 5)
    v = check(PAUSED, permits=1, cut=cut)
    assert (v.overlaps, v.key_overlaps, v.margins, v.unended) == (0, 0, [], [])
    late = check(PAUSED, permits=1, cut={"old": 6.0})  # paused after the re-grant
    assert (late.overlaps, late.overlap_seconds) == (1, pytest.approx(1.0))
    assert check(PAUSED, permits=1, cut={"other": 1.0}).overlaps == 1
