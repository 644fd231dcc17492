"""Token semaphore, use case 1: limit how many processes write to a database at once.

Six worker processes want to write; a token semaphore of two permits lets two of them in
at a time. Each writer takes the fencing token of its permit to the database, which keeps
the highest token per (lock name, permit id) and refuses writes that carry a lower one.
The database here is SQLite (a file in a temporary directory); the check is one UPSERT.

Run with `scripts/demo tokens_db_writers` (it starts a private RabbitMQ node on loopback
unless AMQP_URL is set). See docs/tokens.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3
import sys
import tempfile
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

from rich.console import Console

from amqp_locks import Broker, TokenSemaphore

NAME = "example-db-writers"
PERMITS = 2
WORKERS = 6
ROWS_PER_WRITER = 3
console = Console()
# Closing a Broker right after a release can make aiormq warn that a channel close was
# cancelled; it is harmless (closing the connection returns everything) and only noise here.
logging.getLogger("aiormq").setLevel(logging.ERROR)

SCHEMA = """
CREATE TABLE IF NOT EXISTS fence (
    lock TEXT NOT NULL, permit INTEGER NOT NULL, token INTEGER NOT NULL,
    PRIMARY KEY (lock, permit));
CREATE TABLE IF NOT EXISTS rows (writer INTEGER, permit INTEGER, token INTEGER, n INTEGER);
"""

# The fencing check: raise the stored token of (lock, permit) unless ours is lower. No row
# changed means a newer holder of this permit has written already: we are fenced off.
FENCE_SQL = """
INSERT INTO fence (lock, permit, token) VALUES (?, ?, ?)
ON CONFLICT (lock, permit) DO UPDATE SET token = excluded.token
WHERE excluded.token >= fence.token
"""


def fenced_write(db: sqlite3.Connection, permit: int, token: int, writer: int, n: int) -> bool:
    """One transaction: the fencing check, then the write. False if refused."""
    with db:  # commits, or rolls back on an exception
        db.execute("BEGIN IMMEDIATE")
        if db.execute(FENCE_SQL, (NAME, permit, token)).rowcount == 0:
            db.rollback()
            return False
        db.execute("INSERT INTO rows VALUES (?, ?, ?, ?)", (writer, permit, token, n))
    return True


def worker(
    i: int,
    db_path: str,
    events: multiprocessing.Queue,  # type: ignore[type-arg]
    writing: Synchronized,  # type: ignore[type-arg]
    peak: Synchronized,  # type: ignore[type-arg]
) -> None:
    db = sqlite3.connect(db_path, timeout=10, isolation_level=None)
    with Broker() as broker:
        sem = TokenSemaphore(broker, NAME)
        lease = sem.acquire(timeout=30)
        assert lease is not None, "no permit within 30 s"
        with lease:
            with writing.get_lock():
                writing.value += 1
                now = writing.value
                peak.value = max(peak.value, now)
            events.put(("grant", i, lease.number, lease.fencing_token, now, time.monotonic()))
            refused = 0
            for n in range(ROWS_PER_WRITER):
                if not fenced_write(db, lease.number, lease.fencing_token, i, n):
                    refused += 1
                time.sleep(0.15)  # the rest of the work done while holding the permit
            with writing.get_lock():
                writing.value -= 1
                now = writing.value
            events.put(("release", i, lease.number, refused, now, time.monotonic()))
    db.close()


def main() -> int:
    ctx = multiprocessing.get_context("spawn")
    with Broker() as broker, tempfile.TemporaryDirectory() as tmp:
        console.print(f"broker: [bold]{broker.url}[/bold]")
        sem = TokenSemaphore(broker, NAME)
        sem.destroy()  # leftovers of an interrupted run
        sem.setup(PERMITS)
        st = sem.status()
        console.print(f"token semaphore {NAME!r}: {st.permits} permits, {st.ready} ready")

        db_path = str(Path(tmp) / "app.db")
        db = sqlite3.connect(db_path, isolation_level=None)
        db.executescript(SCHEMA)

        events = ctx.Queue()
        writing = ctx.Value("i", 0)
        peak = ctx.Value("i", 0)
        procs = [
            ctx.Process(target=worker, args=(i, db_path, events, writing, peak))
            for i in range(WORKERS)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        for _ in range(2 * WORKERS):
            kind, i, permit, extra, now, at = events.get(timeout=60)
            if kind == "grant":
                console.print(
                    f"[green]{at - start:6.3f}s  writer {i} got permit {permit}, "
                    f"fencing token {extra}  (writers now {now})[/green]"
                )
            else:
                refused = f", {extra} writes refused" if extra else ""
                console.print(
                    f"[dim]{at - start:6.3f}s  writer {i} released permit {permit}"
                    f"{refused}  (writers now {now})[/dim]"
                )
        for p in procs:
            p.join(30)

        console.print("\n[bold]what the database checked[/bold] (highest token per permit):")
        for permit, token in db.execute(
            "SELECT permit, token FROM fence WHERE lock = ? ORDER BY permit", (NAME,)
        ):
            tokens = [
                t
                for (t,) in db.execute(
                    "SELECT DISTINCT token FROM rows WHERE permit = ? ORDER BY token", (permit,)
                )
            ]
            console.print(f"  ({NAME!r}, permit {permit}): tokens written {tokens}, keeps {token}")

        # A writer that lost its permit long ago (paused, partitioned) wakes up and writes
        # with its old token: the database refuses it.
        old_permit, old_token = db.execute(
            "SELECT permit, MIN(token) FROM rows GROUP BY permit "
            "ORDER BY MAX(token) - MIN(token) DESC LIMIT 1"
        ).fetchone()
        stale_ok = fenced_write(db, old_permit, old_token, -1, 0)
        console.print(
            f"  a stale writer with permit {old_permit}, token {old_token}: "
            + ("[red]accepted (wrong!)[/red]" if stale_ok else "[yellow]refused[/yellow]")
        )
        rows = db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]
        db.close()
        sem.destroy()

    ok = (
        peak.value <= PERMITS
        and not stale_ok
        and rows == WORKERS * ROWS_PER_WRITER
        and all(p.exitcode == 0 for p in procs)
    )
    console.print(
        f"[bold]{WORKERS} writers, {PERMITS} permits: at most {peak.value} wrote at once; "
        f"{rows} rows written.[/bold]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
