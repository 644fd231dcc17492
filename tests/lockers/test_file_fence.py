"""SharedFileLocker's fencing tokens keep rising when the lock file is deleted or replaced.

Found by tests/faults/test_lockers_faults.py (AMQ-4705, the lock file deleted under the
master): the counter lived only in the lock file, so the next master got token 1 again —
a fencing resource would have refused the new master and accepted the old one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from amqp_locks.lockers import SharedFileLocker


@pytest.mark.parametrize("tamper", ["delete", "replace"])
def test_tokens_rise_across_a_deleted_or_replaced_lock_file(tmp_path: Path, tamper: str) -> None:
    locker = SharedFileLocker(tmp_path, lock_acquire_sleep_interval=0.05)
    tokens = []
    for _ in range(3):
        locker.start()
        tokens.append(locker.fencing_token)
        locker.stop()
    if tamper == "delete":
        os.unlink(tmp_path / "lock")
    else:
        other = tmp_path / "other"
        other.write_text("0 someone-else\n")
        os.replace(other, tmp_path / "lock")
    locker.start()
    tokens.append(locker.fencing_token)
    locker.stop()
    assert tokens == sorted(set(tokens)) and tokens[-1] == tokens[-2] + 1
    assert (tmp_path / "lock.fence").read_text().split() == [str(tokens[-1])]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp


def test_a_lock_file_ahead_of_the_fence_file_still_counts(tmp_path: Path) -> None:
    """A lock directory from before the fence file existed: its counter is carried on."""
    (tmp_path / "lock").write_text("41 old-holder\n")
    locker = SharedFileLocker(tmp_path)
    locker.start()
    assert locker.fencing_token == 42
    locker.stop()
