"""`amqp-locks status NAME...`: what each named lock is and who holds it.

Read-only and without the administration mutex (one passive declare or probe per queue,
then one query the holders answer themselves: amqp_locks/holders.py), so it can be polled
(`--watch`) without disturbing admins or holders. AMQP cannot list queues, so the names
must be given.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import click

from ..holders import HOLDER_TIMEOUT, HolderRecord
from ..status import LockStatus
from ..transport.broker import Broker
from .common import get_globals, lock_name, read_status, seconds_option


def since_text(since: datetime | None, now: datetime | None = None) -> str:
    """A holder's start in local time: ``12:00:01`` today, ``2025-01-31 12:00:01`` before."""
    if since is None:
        return "?"
    local = since.astimezone()
    today = (now or datetime.now().astimezone()).date()
    return local.strftime("%H:%M:%S" if local.date() == today else "%Y-%m-%d %H:%M:%S")


def holder_text(rec: HolderRecord, *, number: bool = True) -> str:
    """``slot 2: worker-7 (host a, pid 123) since 12:00:01, token 4503599644147719``; an
    unknown holder is said to be one, never guessed."""
    label = ""
    if number and rec.kind != "mutex":
        what = "slot" if rec.kind == "semaphore" else "permit"
        label = f"{what} {rec.number if rec.number is not None else '?'}: "
    if not rec.known:
        return f"{label}unknown holder (did not answer)"
    return f"{label}{rec.describe()} since {since_text(rec.since)}, token {rec.fencing_token}"


#: Wider than any table `status` makes (it is only as wide as its cells).
WIDE = 1000


def show(console: Any, table: Any) -> None:
    """Print `table` at its natural width, even past the terminal's or a pipe's 80
    columns: a cell cut to fit ("45035996…") would hide a lock name or a fencing token
    (~2**52, 16 digits), which are what `status` is read for; a terminal narrower than
    the table wraps its lines instead."""
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(WIDE), table).maximum
    console.width = max(console.width, natural)
    console.print(table, crop=False)


def collect(b: Broker, name: str, timeout: float = HOLDER_TIMEOUT) -> list[dict[str, Any]]:
    """Every kind of lock named `name` that exists (a name may be several), in the JSON
    shape of `--json` (per kind: slots/holders/free, permits/ready/consumers/waiting, and
    `records`: who holds it, unless `timeout` is 0)."""
    found: list[dict[str, Any]] = []
    for st in read_status(b, name, records=timeout > 0, holder_timeout=timeout):
        row = _row(name, st)
        if st.kind != "absent" and timeout > 0:
            row["records"] = [r.as_dict() for r in st.records]
            if st.records_note:
                row["records_note"] = st.records_note
        found.append(row)
    return found


#: The JSON fields of each kind with a count, and the LockStatus attribute behind each.
_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "semaphore": (
        ("slots", "capacity"),
        ("held", "held"),
        ("holders", "holders"),
        ("free", "free"),
    ),
    "token": (
        ("permits", "capacity"),
        ("ready", "free"),
        ("held", "held"),
        ("consumers", "consumers"),
        ("waiting", "waiting"),
    ),
    "rwlock": (
        ("readers", "capacity"),
        ("held", "held"),
        ("free", "free"),
        ("consumers", "consumers"),
        ("writers_waiting", "waiting"),
    ),
}


def _row(name: str, st: LockStatus) -> dict[str, Any]:
    fields = _FIELDS.get(st.kind)
    if fields is None:
        # a mutex, or the admin mutex of the semaphore NAME (busy admin), or absent
        return {"name": name, "kind": st.kind, "held": bool(st.held)}
    row: dict[str, Any] = {"name": name, "kind": st.kind}
    for key, attr in fields:
        value = getattr(st, attr)
        row[key] = list(value) if key == "holders" else value
    return row


def _table(rows: list[dict[str, Any]], url: str, fold: bool = False) -> Any:
    """The status table; `fold`: a cell too wide for its column wraps on, cut nowhere
    (`--watch` redraws within the terminal's width)."""
    from rich.table import Table

    table = Table(title=f"amqp-locks status ({url})", title_justify="left")
    with_records = any("records" in r for r in rows)
    cols = ["name", "kind", "capacity", "held", "free/ready", "holders", "waiting"]
    for col in cols + (["held by"] if with_records else []):
        table.add_column(col, overflow="fold" if fold else "ellipsis")
    for r in rows:
        kind = r["kind"]
        if kind == "semaphore":
            cells = [
                str(r["slots"]),
                str(r["held"]),
                str(r["free"]),
                ",".join(map(str, r["holders"])) or "-",
                "-",
            ]
        elif kind == "token":
            cells = [
                str(r["permits"]),
                str(r["held"]),
                str(r["ready"]),
                f"{r['consumers']} consumer(s)",
                str(r["waiting"]),
            ]
        elif kind == "rwlock":
            cells = [
                str(r["readers"]),
                str(r["held"]),
                str(r["free"]),
                f"{r['consumers']} consumer(s)",
                f"{r['writers_waiting']} writer(s)",
            ]
        elif kind == "mutex":
            cells = ["1", "1" if r["held"] else "0", "0" if r["held"] else "1", "-", "-"]
        else:
            cells = ["-", "-", "-", "-", "-"]
        if with_records:
            records = [HolderRecord.from_dict(r["name"], d) for d in r.get("records", ())]
            lines = [holder_text(rec) for rec in records]
            if r.get("records_note") and not all(rec.known for rec in records):
                lines.append(f"({r['records_note']})")
            cells.append("\n".join(lines) or "-")
        table.add_row(r["name"], kind, *cells)
    return table


@click.command(
    epilog="""\b
Examples:
  amqp-locks status deploys gpu reindex
  amqp-locks status deploys --json | jq '.[0].records'
  amqp-locks status deploys --watch --interval 1"""
)
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@seconds_option(
    "--holder-timeout",
    default=HOLDER_TIMEOUT,
    help="How long to wait for holders to say who they are (0: do not ask).",
)
@click.option("--json", "as_json", is_flag=True, help="A JSON list, one object per lock.")
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@seconds_option("--interval", default=2.0, minimum=0.1, help="--watch refresh period.")
def status(
    names: tuple[str, ...], holder_timeout: float, as_json: bool, watch: bool, interval: float
) -> None:
    """Show semaphores (slots, held slots), token semaphores (permits, ready, held,
    consumers, waiters) and mutexes named NAME, and who holds them (holder id, host, pid,
    since, fencing token; "unknown" for a holder that does not answer: frozen, cut off,
    or an older amqp-locks).

    Kinds: semaphore, token, rwlock (reader tokens out of R; all R while a writer
    holds), mutex (queue NAME, also the admin mutex of a semaphore NAME
    while an admin command runs), absent.
    """
    checked = [lock_name(n, admin=True) for n in names]
    g = get_globals()
    broker = g.broker("status")
    try:

        def snapshot() -> list[dict[str, Any]]:
            return [row for n in checked for row in collect(broker, n, holder_timeout)]

        if as_json and not watch:
            click.echo(json.dumps(snapshot(), indent=2))
            return
        if as_json:
            while True:
                click.echo(json.dumps(snapshot()), nl=True)
                time.sleep(interval)
        from rich.console import Console

        console = Console()
        if not watch:
            show(console, _table(snapshot(), broker.url))
            return
        from rich.live import Live

        with Live(
            _table(snapshot(), broker.url, fold=True), console=console, auto_refresh=False
        ) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(_table(snapshot(), broker.url, fold=True), refresh=True)
            except KeyboardInterrupt:
                pass
    finally:
        broker.close()
