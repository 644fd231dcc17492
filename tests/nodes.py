"""Names of the private RabbitMQ nodes the tests start, unique to this test run's home.

Erlang node names are global on a machine (epmd registers ``NAME@localhost`` once), so two
test runs with different ``$AMQP_LOCKS_TEST_HOME`` directories (two clones, two worktrees)
that both started ``amqplockstest`` would fail with ``duplicate_node_name``. Without the
variable the plain names are kept: runs with the default home share their nodes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def test_home() -> Path | None:
    """``$AMQP_LOCKS_TEST_HOME/<RabbitMQ line>``: each line's nodes in their own folder."""
    from amqp_locks_dev import devbroker

    home = os.environ.get("AMQP_LOCKS_TEST_HOME")
    return Path(home) / devbroker.default_version() if home else None


def node_name(base: str) -> str:
    """`base`, or `base-<hash of the test home>` when ``$AMQP_LOCKS_TEST_HOME`` is set."""
    home = test_home()
    if home is None:
        return base
    digest = hashlib.sha256(str(home.expanduser().resolve()).encode()).hexdigest()[:6]
    return f"{base}-{digest}"
