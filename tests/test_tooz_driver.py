"""The tooz driver against the real broker: what tooz's own suite (scripts/test) does not
check — members and leaders of a killed process vanish, fencing tokens rise, read-write
locks exclude and give writers priority, a killed reader frees the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

tooz_coordination = pytest.importorskip("tooz.coordination")

from amqp_locks.tooz_driver import broker_urls, encode_id  # noqa: E402


def _tooz_url(amqp_url: str, scheme: str = "amqp") -> str:
    return scheme + amqp_url[amqp_url.index("://") :]


@pytest.fixture
def tooz_url(amqp_url: str) -> str:
    return _tooz_url(amqp_url)


@pytest.fixture
def coordinator(tooz_url: str) -> Iterator[Any]:
    coord = tooz_coordination.get_coordinator(tooz_url, f"m-{uuid.uuid4().hex[:8]}".encode())
    coord.start()
    yield coord
    coord.stop()


def _child(tooz_url: str, body: str) -> subprocess.Popen[str]:
    """A separate process running a coordinator; prints READY when `body` has run."""
    code = (
        textwrap.dedent(
            """
        import sys, time, tooz.coordination as c
        coord = c.get_coordinator(sys.argv[1], sys.argv[2].encode())
        coord.start()
        """
        )
        + textwrap.dedent(body)
        + "\nprint('READY', flush=True)\ntime.sleep(600)\n"
    )
    member = f"child-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, tooz_url, member],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.member = member.encode()  # type: ignore[attr-defined]
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "READY", f"child failed: {line!r}"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


def test_urls() -> None:
    split = urllib.parse.urlsplit
    assert broker_urls(split("rabbit://u:p@h1:5672,u:p@h2:5673/vh")) == [
        "amqp://u:p@h1:5672/vh",
        "amqp://u:p@h2:5673/vh",
    ]
    assert broker_urls(split("amqps://u:p@h/?heartbeat=5&cafile=/ca.pem")) == [
        "amqps://u:p@h/?cafile=/ca.pem"
    ]
    assert broker_urls(split("amqp://h")) == ["amqp://h/"]
    assert encode_id(b"abc-1") == "abc-1"
    assert encode_id(b"a.b") == "+" + b"a.b".hex()
    assert encode_id(b"x" * 200).startswith("#")


def test_rabbit_scheme(amqp_url: str) -> None:
    coord = tooz_coordination.get_coordinator(_tooz_url(amqp_url, "rabbit"), b"r1")
    coord.start()
    try:
        group = uuid.uuid4().hex.encode()
        coord.create_group(group).get()
        coord.join_group(group, {"k": 1}).get()
        assert coord.get_members_with_capabilities(group).get() == {b"r1": {"k": 1}}
    finally:
        coord.stop()


def test_killed_member_vanishes(tooz_url: str, coordinator: Any) -> None:
    group = uuid.uuid4().hex.encode()
    coordinator.create_group(group).get()
    child = _child(tooz_url, f"coord.join_group({group!r}, {{'role': 'worker'}}).get()")
    member = child.member  # type: ignore[attr-defined]
    try:
        assert coordinator.get_members(group).get() == {member}
        events: list[Any] = []
        coordinator.watch_leave_group(group, events.append)
        coordinator.run_watchers()
    finally:
        _kill(child)
    _eventually(lambda: member not in coordinator.get_members(group).get(), timeout=5.0)
    coordinator.run_watchers()
    assert [(type(e).__name__, e.member_id) for e in events] == [("MemberLeftGroup", member)]
    # The dead member's record is gone, so the group can be deleted.
    coordinator.delete_group(group).get()


def test_killed_leader_is_replaced(tooz_url: str, coordinator: Any) -> None:
    group = uuid.uuid4().hex.encode()
    coordinator.create_group(group).get()
    child = _child(
        tooz_url,
        f"""
        coord.watch_elected_as_leader({group!r}, lambda event: None)
        coord.run_watchers()
        """,
    )
    member = child.member  # type: ignore[attr-defined]
    elected: list[Any] = []
    coordinator.watch_elected_as_leader(group, elected.append)
    try:
        assert coordinator.get_leader(group).get() == member
        coordinator.run_watchers()
        assert elected == []  # the child leads
    finally:
        _kill(child)

    def took_over() -> bool:
        coordinator.run_watchers()
        return bool(elected)

    _eventually(took_over, timeout=5.0)
    assert coordinator.get_leader(group).get() == coordinator._member_id
    lease = coordinator.get_leader_lease(group)
    assert lease is not None and lease.fencing_token >= 2


def test_stand_down_clears_leader(coordinator: Any) -> None:
    group = uuid.uuid4().hex.encode()
    coordinator.create_group(group).get()
    coordinator.watch_elected_as_leader(group, lambda event: None)
    coordinator.run_watchers()
    assert coordinator.get_leader(group).get() == coordinator._member_id
    assert coordinator.stand_down_group_leader(group) is True
    assert coordinator.get_leader(group).get() is None
    assert coordinator.stand_down_group_leader(group) is False


def test_fencing_tokens_rise(tooz_url: str, coordinator: Any) -> None:
    other = tooz_coordination.get_coordinator(tooz_url, b"fence-2")
    other.start()
    try:
        name = uuid.uuid4().hex.encode()
        tokens = []
        for coord in (coordinator, other, coordinator, other):
            lock = coord.get_lock(name)
            assert lock.acquire(blocking=5)
            assert lock.is_still_owner()
            tokens.append(lock.fencing_token)
            assert lock.release()
            assert not lock.is_still_owner()
        assert tokens == sorted(tokens) and len(set(tokens)) == 4, tokens
    finally:
        other.stop()


def test_read_write_lock(tooz_url: str, coordinator: Any) -> None:
    other = tooz_coordination.get_coordinator(tooz_url, b"rw-2")
    other.start()
    try:
        name = uuid.uuid4().hex.encode()
        r1, r2 = coordinator.get_lock(name), other.get_lock(name)
        writer = other.get_lock(name)
        assert r1.acquire(shared=True) and r2.acquire(shared=True)
        assert not writer.acquire(blocking=False)
        assert not writer.acquire(blocking=0.2)
        got: list[bool] = []
        waiting = threading.Thread(target=lambda: got.append(writer.acquire(blocking=10)))
        waiting.start()
        time.sleep(0.3)
        # A writer is waiting: no new reader gets in (no writer starvation).
        late = coordinator.get_lock(name)
        assert not late.acquire(shared=True, blocking=False)
        assert r1.release()
        time.sleep(0.2)
        assert got == []
        assert r2.release()
        waiting.join(10)
        assert got == [True]
        assert writer.fencing_token > r2.fencing_token > 0
        assert not late.acquire(shared=True, blocking=False)
        assert writer.release()
        # tooz's release has no wait: past its 2 s bound (a loaded machine) the reader
        # tokens can still be on their way back, and a non-blocking acquire would see none.
        assert late.acquire(shared=True, blocking=5)
        assert late.release()
    finally:
        other.stop()


def _killed_child_frees_the_lock(tooz_url: str, coordinator: Any, acquire_args: str) -> None:
    """A child process takes the lock with ``acquire(acquire_args)`` and is killed: the
    lock is busy while it lives and free for this coordinator once it is gone."""
    name = uuid.uuid4().hex.encode()
    child = _child(tooz_url, f"assert coord.get_lock({name!r}).acquire({acquire_args})")
    lock = coordinator.get_lock(name)
    try:
        assert not lock.acquire(blocking=False)
    finally:
        _kill(child)
    assert lock.acquire(blocking=5)
    assert lock.release()


def test_killed_reader_frees_the_lock(tooz_url: str, coordinator: Any) -> None:
    _killed_child_frees_the_lock(tooz_url, coordinator, "shared=True")


def test_killed_holder_frees_the_lock(tooz_url: str, coordinator: Any) -> None:
    _killed_child_frees_the_lock(tooz_url, coordinator, "")
