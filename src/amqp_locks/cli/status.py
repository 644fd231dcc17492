"""`amqp-locks status NAME...`: what each named lock is and who holds it.

Read-only and without the administration mutex (one passive declare or probe per queue),
so it can be polled (`--watch`) without disturbing admins or holders. AMQP cannot list
queues, so the names must be given.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..status import lock_status
from ..transport.broker import Broker
from .common import get_globals, lock_name


def collect(b: Broker, name: str) -> list[dict[str, Any]]:
    """Every kind of lock named `name` that exists (a name may be several), in the JSON
    shape of `--json` (per kind: slots/holders/free, permits/ready/consumers/waiting)."""
    found: list[dict[str, Any]] = []
    for st in lock_status(b, name):
        if st.kind == "semaphore":
            found.append(
                {
                    "name": name,
                    "kind": "semaphore",
                    "slots": st.capacity,
                    "held": st.held,
                    "holders": list(st.holders),
                    "free": st.free,
                }
            )
        elif st.kind == "token":
            found.append(
                {
                    "name": name,
                    "kind": "token",
                    "permits": st.capacity,
                    "ready": st.free,
                    "held": st.held,
                    "consumers": st.consumers,
                    "waiting": st.waiting,
                }
            )
        elif st.kind == "rwlock":
            found.append(
                {
                    "name": name,
                    "kind": "rwlock",
                    "readers": st.capacity,
                    "held": st.held,
                    "free": st.free,
                    "consumers": st.consumers,
                    "writers_waiting": st.waiting,
                }
            )
        else:  # a mutex, or the admin mutex of the semaphore NAME (busy admin), or absent
            found.append({"name": name, "kind": st.kind, "held": bool(st.held)})
    return found


def _table(rows: list[dict[str, Any]], url: str) -> Any:
    from rich.table import Table

    table = Table(title=f"amqp-locks status ({url})", title_justify="left")
    for col in ("name", "kind", "capacity", "held", "free/ready", "holders", "waiting"):
        table.add_column(col)
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
        table.add_row(r["name"], kind, *cells)
    return table


@click.command(
    epilog="""\b
Examples:
  amqp-locks status deploys gpu reindex
  amqp-locks status deploys --json | jq '.[0].holders'
  amqp-locks status deploys --watch --interval 1"""
)
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--json", "as_json", is_flag=True, help="A JSON list, one object per lock.")
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="--watch refresh period.",
)
def status(names: tuple[str, ...], as_json: bool, watch: bool, interval: float) -> None:
    """Show semaphores (slots, held slots), token semaphores (permits, ready, held,
    consumers, waiters) and mutexes named NAME.

    Kinds: semaphore, token, rwlock (reader tokens out of R; all R while a writer
    holds), mutex (queue NAME, also the admin mutex of a semaphore NAME
    while an admin command runs), absent.
    """
    checked = [lock_name(n) for n in names]
    g = get_globals()
    broker = g.broker("status")
    try:

        def snapshot() -> list[dict[str, Any]]:
            return [row for n in checked for row in collect(broker, n)]

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
            console.print(_table(snapshot(), broker.url))
            return
        from rich.live import Live

        with Live(_table(snapshot(), broker.url), console=console, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(_table(snapshot(), broker.url), refresh=True)
            except KeyboardInterrupt:
                pass
    finally:
        broker.close()
