"""``scripts/broker``: the private node's commands, and the epmd its ``start`` booted.

A node boots its line's Erlang port mapper when none runs (:mod:`amqp_locks_dev.epmd`),
and that epmd outlives the node: ``scripts/broker start`` then ``stop`` left one running
where scripts/demo, scripts/test and scripts/matrix stop theirs. ``start``, ``url`` and
``restart`` note in the node's directory the epmd ports that were not running before them
and are after; ``stop`` stops those once the node is down and no node is registered with
them (a user's other node, a system RabbitMQ keep theirs). An epmd that ran before the
start is never noted, so never stopped. Every other command is
:func:`amqp_locks_dev.devbroker.main`'s, unchanged.

``AMQP_LOCKS_KEEP_EPMD=1`` makes ``stop`` leave the epmd alone (the note is still
cleared): scripts/test, scripts/demo and scripts/matrix set it and sweep once their own
nodes are all down. In a test run another lane's node may be booting against that epmd
while this one stops: stopping it then would fail that node's registration.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import devbroker, epmd

#: The file in the node's directory naming the epmd ports its start booted.
MARKER = "epmd-booted-by-start"
_STARTS = ("start", "url", "restart")


def _node_dir(options: Sequence[str]) -> Path | None:
    """The node directory the options name (as devbroker resolves it), or None when they
    do not parse (devbroker then reports the error)."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--name", default=devbroker.DEFAULT_NAME)
    parser.add_argument("--base-dir", type=Path, default=None)
    parser.add_argument("--version", default=None)
    try:
        args, _ = parser.parse_known_args(options)
        return devbroker.node_dir(args.name, args.base_dir, version=args.version)
    except (argparse.ArgumentError, devbroker.DevBrokerError, SystemExit, ValueError):
        return None


def _noted(marker: Path) -> set[int]:
    try:
        return {int(port) for port in marker.read_text().split()}
    except (OSError, ValueError):
        return set()


def main(
    argv: Sequence[str] | None = None,
    run: Callable[[list[str]], int] = devbroker.main,
    ports: Sequence[int] = epmd.PORTS,
) -> int:
    """Run devbroker's command `argv`; around a start note the epmd it booted, after a
    stop stop that epmd if unused. `run` and `ports` are for tests."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    where = _node_dir(argv[1:]) if command in (*_STARTS, "stop") else None
    if where is None:
        return run(argv)
    marker = where / MARKER
    before = set() if command == "stop" else set(epmd.running(ports))
    status = run(argv)
    if status != 0:
        return status
    if command == "stop":
        noted = _noted(marker)
        marker.unlink(missing_ok=True)
        if os.environ.get("AMQP_LOCKS_KEEP_EPMD") == "1":
            return status
        stopped = epmd.sweep(ports=[port for port in ports if port in noted])
        if stopped:
            ports_ = ", ".join(map(str, stopped))
            print(f"stopped the epmd it booted on port {ports_}", file=sys.stderr)
        return status
    booted = set(epmd.running(ports)) - before
    if booted and where.is_dir():
        marker.write_text(" ".join(str(port) for port in sorted(booted | _noted(marker))) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
