"""The `amqp-locks` command (being written; see issue 5)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point placeholder until the command lands: says so and exits 69."""
    print("amqp-locks: the command-line tool is not available yet", file=sys.stderr)
    return 69
