"""Stop what a test run started, and only that: ``scripts/test``'s clean-up.

A run sets ``$AMQP_LOCKS_SERVER_LEDGER`` to a fresh file; every private server launched
or found running by any process of the run notes itself there once, by its directory
(:func:`amqp_locks_dev.localserver.note`): RabbitMQ nodes of every line, cluster and
partition-harness nodes, PostgreSQL, MariaDB. At the end, the servers the run *started*
are stopped (in parallel: a RabbitMQ node's clean stop takes seconds); those it *found*
running were there before it and are left as they were. Network namespaces named
``alp-*`` that the run's partition and mesh harnesses noted as made are removed with
whatever runs in them (never another run's, made while this one ran). With ``--epmd``, the
Erlang port mappers our nodes booted (:mod:`amqp_locks_dev.epmd`) go too, once no node is
registered with them; those running at ``begin`` stay.

    python -m amqp_locks_dev.servers begin LEDGER   # note the namespaces that exist now
    python -m amqp_locks_dev.servers stop LEDGER    # stop what the run started
    python -m amqp_locks_dev.servers stop --brief --epmd LEDGER  # and the epmds: the run's end
    python -m amqp_locks_dev.servers stop --brief --servers-only LEDGER  # its servers only
    python -m amqp_locks_dev.servers list LEDGER    # what the run started, still running
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import epmd
from .localserver import FOUND, STARTED, LocalServer, note, read_ledger, signal_and_wait

#: The partition and mesh harnesses' network namespaces (amqp_locks_dev.partition.PREFIX).
NETNS_PREFIX = "alp-"


@dataclass(frozen=True)
class Entry:
    """One server of the ledger: its lifecycle, its directory, whether the run started it."""

    server: LocalServer[Any]
    base_dir: Path
    started: bool

    def describe(self) -> str:
        state = self.server.read_state(self.base_dir)
        return self.server.describe(state[0]) if state else str(self.base_dir)

    def running(self) -> bool:
        state = self.server.read_state(self.base_dir)
        return state is not None and self.server.is_ours(*state)


def _server(ledger_id: str) -> LocalServer[Any]:
    module, _, kind = ledger_id.partition(":")
    if not module.startswith("amqp_locks_dev."):
        raise ValueError(f"not a server of this repository: {ledger_id!r}")
    factory = importlib.import_module(module).ledger_server
    server: LocalServer[Any] = factory(kind or None)
    return server


def servers(ledger: Path) -> list[Entry]:
    """The ledger's servers (one per directory, the first sighting deciding)."""
    out = []
    for raw in read_ledger(ledger):
        if "server" in raw:
            with contextlib.suppress(ValueError, ImportError, AttributeError, RuntimeError):
                server = _server(raw["server"])
                out.append(Entry(server, Path(raw["base_dir"]), raw["how"] == STARTED))
    return out


def namespaces() -> list[str]:
    """The partition harness's network namespaces that exist now (none without ``ip``)."""
    if shutil.which("ip") is None:
        return []
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = (line.split()[0] for line in proc.stdout.splitlines() if line.strip())
    return sorted(n for n in names if n.startswith(NETNS_PREFIX))


def begin(ledger: Path) -> None:
    """Start a run's ledger: note the namespaces and epmds that exist now (they stay)."""
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.touch()
    for ns in namespaces():
        note({"netns": ns, "how": FOUND}, "netns", ledger)
    for port in epmd.running():
        note({"epmd": port, "how": FOUND}, "epmd", ledger)


def _stop(entry: Entry) -> tuple[Entry, str | None]:
    try:
        entry.server.stop(entry.base_dir)
    except Exception as exc:  # one server's failure must not keep the others running
        return entry, f"{type(exc).__name__}: {exc}"
    return entry, None


def _made(ledger: Path) -> set[str]:
    """The namespaces this run's harnesses noted as made (never another run's: two runs
    side by side on one machine each remove only their own)."""
    return {
        raw["netns"] for raw in read_ledger(ledger) if "netns" in raw and raw.get("how") == STARTED
    }


def _remove_namespace(ns: str) -> str | None:
    """Kill what runs in `ns` (processes only our harness put there) and delete it."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    for pid in (int(p) for p in pids.stdout.split() if p.isdigit()):
        signal_and_wait(pid, signal.SIGKILL, 5.0)
    proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, check=False)
    return None if proc.returncode == 0 else proc.stderr.strip()


def stop(ledger: Path, brief: bool = False, servers_only: bool = False, epmds: bool = False) -> int:
    """Stop every server the run started that still runs, and the namespaces it made
    (unless `servers_only`: other steps of the run, side by side, may use namespaces made
    since it began), and with `epmds` the port mappers no node uses that were not running
    at `begin` (the run's last stop: no node of it boots any more); print what was stopped
    and (unless `brief`: between two steps of a run) what is left running. Exit status 1
    if anything the run started could not be stopped."""
    entries = servers(ledger)
    started = [e for e in entries if e.started and e.running()]
    kept = [e for e in entries if not e.started and e.running()]
    failures: list[str] = []
    if started:
        with ThreadPoolExecutor(max_workers=min(8, len(started))) as pool:
            for entry, error in pool.map(_stop, started):
                if error is not None:
                    failures.append(f"{entry.describe()}: {error}")
    made = [] if servers_only else [ns for ns in namespaces() if ns in _made(ledger)]
    if made:
        # The harness's own sweep knows its links and routes too, when it is there.
        with contextlib.suppress(ImportError, AttributeError, RuntimeError, OSError):
            importlib.import_module("amqp_locks_dev.mesh").sweep_stale()
        for ns in namespaces():
            if ns in made:
                error = _remove_namespace(ns)
                if error:
                    failures.append(f"network namespace {ns}: {error}")
    what = [e.describe() for e in started] + [f"network namespace {ns}" for ns in made]
    if epmds and not servers_only:
        found = [raw["epmd"] for raw in read_ledger(ledger) if "epmd" in raw]
        what += [f"the epmd on port {port}" for port in epmd.sweep(keep=found)]
    if what:
        print(f"== servers: stopped {len(what)}: {'; '.join(what)}")
    for failure in failures:
        print(f"== servers: could not stop {failure}", file=sys.stderr)
    if brief:
        return 1 if failures else 0
    ours = [e for e in entries if e.started]
    still = [e.describe() for e in ours if e.running()]
    print(
        f"== servers: {len(ours)} started by this run, "
        + (f"{len(still)} still running: {'; '.join(still)}" if still else "none left running")
    )
    if kept:
        print(
            f"== servers: left {len(kept)} running that ran before this run: "
            + "; ".join(e.describe() for e in kept)
        )
    return 1 if failures else 0


def show(ledger: Path) -> int:
    """What the run started that still runs, and how to stop it."""
    running = [e for e in servers(ledger) if e.started and e.running()]
    made = [ns for ns in namespaces() if ns in _made(ledger)]
    count = len(running) + len(made)
    print(f"== servers: kept {count} this run started (--keep-servers):")
    for entry in running:
        print(f"   {entry.describe()}")
    for ns in made:
        print(f"   network namespace {ns}")
    print(f"== servers: stop them with: scripts/servers stop {ledger}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/servers", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["begin", "stop", "list"])
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--brief", action="store_true", help="stop: say only what was stopped")
    parser.add_argument(
        "--epmd",
        action="store_true",
        help="stop: also the epmds the run's nodes started, once none is registered there",
    )
    parser.add_argument(
        "--servers-only",
        action="store_true",
        help="stop: leave network namespaces (steps running side by side may use them)",
    )
    args = parser.parse_args(argv)
    if args.command == "begin":
        begin(args.ledger)
        return 0
    if args.command == "stop":
        return stop(args.ledger, args.brief, args.servers_only, args.epmd)
    return show(args.ledger)


if __name__ == "__main__":
    sys.exit(main())
