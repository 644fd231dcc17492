"""What a name given to `amqp-locks run` leaves on the broker, as its help and docs/cli.md
say: a mutex and a read-write lock nothing lasting (wake-up queues and the rwlock's
queues expire), `-n` a semaphore's slot queues, `--kind token -n` a token semaphore's
queue, ledger and fence; `semaphore destroy` / `token destroy --purge-fence` remove them."""

from __future__ import annotations

import json

from amqp_locks_dev import devbroker

from .conftest import Cli


def lasting(node: devbroker.NodeInfo, prefix: str) -> set[str]:
    """The queues of `prefix` that never expire by themselves (no x-expires)."""
    out = devbroker.rabbitmqctl(
        node, "list_queues", "name", "arguments", "--formatter", "json", "-q"
    )
    return {
        q["name"]
        for q in json.loads(out)  # arguments: [[key, type, value], ...]
        if q["name"].startswith(prefix) and "x-expires" not in {a[0] for a in q["arguments"]}
    }


def test_what_run_leaves_and_how_to_remove_it(
    cli: Cli, node: devbroker.NodeInfo, name: str
) -> None:
    runs = cli.run_many(
        ["run", name + "m", "--", "true"],
        ["run", name + "r", "--shared", "--", "true"],
        ["run", name + "s", "-n", "2", "--", "true"],
        ["run", name + "t", "--kind", "token", "-n", "2", "--", "true"],
    )
    assert [r.returncode for r in runs] == [0, 0, 0, 0], [r.stderr for r in runs]
    assert lasting(node, name) == {
        f"{name}s-1-A",
        f"{name}s-2-A",
        f"{name}t.semaphore",
        f"{name}t.semaphore-ledger",
        f"{name}t-fence",
    }
    removed = cli.run_many(
        ["semaphore", "destroy", name + "s"],
        ["token", "destroy", name + "t", "--purge-fence"],
    )
    assert [r.returncode for r in removed] == [0, 0], [r.stderr for r in removed]
    assert lasting(node, name) == set()
