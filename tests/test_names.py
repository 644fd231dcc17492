"""Name validation (pure logic): lengths, reserved suffixes, no collisions between locks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from amqp_locks import ConfigurationError, InvalidName
from amqp_locks.names import (
    MAX_QUEUE_NAME_BYTES,
    MAX_SLOT_DIGITS,
    check_slot_number,
    fence_queue,
    holder_queue,
    sentinel_queue,
    slot_queue,
    token_queue,
    validate_name,
    wakeup_queue,
)


def test_queue_names_follow_the_seed() -> None:
    assert slot_queue("images", 3) == "images-3-A"
    assert holder_queue("images", 3) == "images-3-B"
    assert fence_queue("images") == "images-fence"
    assert token_queue("db") == "db.semaphore"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "images-1-A",
        "images-12-B",
        "x-fence",
        "x-sem-waiters",
        "x-mutex-sentinels",
        "x-sem-wakeups",
        "x-mutex-watch",
        "db.semaphore",
        "amq.foo",
        "a\nb",
        "a\x00",
    ],
)
def test_refuses_names_that_could_collide_or_are_invalid(bad: str) -> None:
    with pytest.raises(InvalidName):
        validate_name(bad)


def test_refuses_non_str() -> None:
    with pytest.raises(InvalidName, match="must be a str"):
        validate_name(3)  # type: ignore[arg-type]


def test_length_limit_counts_utf8_bytes_once_suffixed() -> None:
    budget = MAX_QUEUE_NAME_BYTES - len("-mutex-sentinels")  # the longest suffix
    assert validate_name("x" * budget)
    with pytest.raises(InvalidName, match="bytes"):
        validate_name("x" * (budget + 1))
    # a 3-byte character counts three times
    with pytest.raises(InvalidName):
        validate_name("€" * (budget // 3 + 1))
    longest = slot_queue("x" * budget, 10**MAX_SLOT_DIGITS - 1)
    assert len(longest.encode()) <= MAX_QUEUE_NAME_BYTES


@pytest.mark.parametrize("k", [0, -1, 10**MAX_SLOT_DIGITS, True, 1.0])
def test_slot_numbers_are_checked(k: object) -> None:
    with pytest.raises(ConfigurationError):
        check_slot_number(k)  # type: ignore[arg-type]


def test_wakeup_and_sentinel_queues_fit_and_differ_by_kind() -> None:
    # The budget keeps room for 0.1's longest suffix, "-mutex-sentinels".
    budget = MAX_QUEUE_NAME_BYTES - len("-mutex-sentinels")
    longest = "n" * budget
    assert validate_name(longest)
    assert sentinel_queue(longest, "mutex") == longest + "-mutex-watch"
    assert wakeup_queue(longest, "mutex") == longest + "-mutex-wakeups"
    assert len(wakeup_queue(longest, "mutex").encode()) < MAX_QUEUE_NAME_BYTES
    assert wakeup_queue("a", "mutex") != wakeup_queue("a", "sem")
    assert sentinel_queue("a", "mutex") != sentinel_queue("a", "sem")


names = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=40)


def _queues(name: str) -> set[str]:
    qs = {name, fence_queue(name), token_queue(name)}
    qs |= {wakeup_queue(name, "sem"), wakeup_queue(name, "mutex")}
    qs |= {sentinel_queue(name, "sem"), sentinel_queue(name, "mutex")}
    for k in (1, 2, 10, 99):
        qs |= {slot_queue(name, k), holder_queue(name, k)}
    return qs


@given(names, names)
def test_two_valid_names_never_share_a_queue(a: str, b: str) -> None:
    try:
        validate_name(a)
        validate_name(b)
    except InvalidName:
        return
    if a != b:
        assert not (_queues(a) & _queues(b)), (a, b)
