"""devdb.start after devdb.kill waits for PostgreSQL's crash recovery.

Found by the locker random-fault run (tests/faults/test_lockers_soak.py): start() after a
kill gave up with "the database system is not yet accepting connections" because only
"starting up" and "shutting down" counted as not ready yet.
"""

from __future__ import annotations

import pytest

from amqp_locks_dev.devdb import _pg_not_ready_yet


@pytest.mark.parametrize(
    "stderr",
    [
        "FATAL:  the database system is starting up",
        "FATAL:  the database system is shutting down",
        "FATAL:  the database system is not yet accepting connections\n"
        "DETAIL:  Consistent recovery state has not been yet reached.",
        "FATAL:  the database system is in recovery mode",
    ],
)
def test_recovery_and_startup_answers_mean_try_again(stderr: str) -> None:
    assert _pg_not_ready_yet(f'psql: error: connection to server on socket "/x" failed: {stderr}')


def test_real_errors_are_not_mistaken_for_startup() -> None:
    assert not _pg_not_ready_yet("ERROR:  permission denied to create database")
    assert not _pg_not_ready_yet('FATAL:  password authentication failed for user "amqplocks"')
