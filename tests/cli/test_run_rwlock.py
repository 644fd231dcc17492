"""`amqp-locks run NAME --shared / --exclusive`: the read-write lock from the command line."""

from __future__ import annotations

import json
from pathlib import Path

from amqp_locks_dev import devbroker

from .conftest import Cli, close_connections_of

ENV_LINE = 'echo "$AMQP_LOCKS_KIND $AMQP_LOCKS_MODE $AMQP_LOCKS_SLOT $AMQP_LOCKS_FENCING_TOKEN"'


def test_shared_holds_overlap_and_exclusive_waits(cli: Cli, name: str, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    hold = f"{ENV_LINE}; while [ ! -e {gate} ]; do sleep 0.05; done"
    r1 = cli.start("run", name, "--shared", "-c", hold)
    r2 = cli.start("run", name, "--shared", "-c", hold)
    lines = [r1.expect("rwlock"), r2.expect("rwlock")]  # both read at once
    kinds = [line.split() for line in lines]
    assert [k[:2] for k in kinds] == [["rwlock", "shared"]] * 2
    assert {k[2] for k in kinds} <= {str(i) for i in range(1, 65)} and kinds[0][2] != kinds[1][2]

    busy, mutex = cli.run_many(
        ["run", name, "--exclusive", "--nonblock", "-E", "42", "--", "echo", "wrote"],
        # The mutex NAME is another lock: not excluded by the read-write lock NAME.
        ["run", name, "--nonblock", "--", "echo", "mutex"],
    )
    assert busy.returncode == 42 and "wrote" not in busy.stdout
    assert (mutex.returncode, mutex.stdout) == (0, "mutex\n")

    writer = cli.start("run", name, "--exclusive", "-w", "30", "-c", ENV_LINE)
    gate.touch()
    assert r1.finish()[0] == 0 and r2.finish()[0] == 0
    rc, out, _ = writer.finish()
    assert rc == 0
    kind, mode, slot, token = out.split()
    assert (kind, mode, slot) == ("rwlock", "exclusive", "0")
    assert int(token) > max(int(k[3]) for k in kinds)

    status = cli.run("status", name, "--json")
    rows = {row["kind"]: row for row in json.loads(status.stdout)}
    assert rows["rwlock"]["readers"] == 64


def test_lost_write_hold_stops_the_command(cli: Cli, name: str, node: devbroker.NodeInfo) -> None:
    p = cli.start(
        "run", name, "--exclusive", "--lost-exit-code", "99", "-c", "echo ready; exec sleep 60"
    )
    p.expect("ready")
    assert close_connections_of(node, p.popen.pid) == 1
    rc, _, err = p.finish()
    assert rc == 99
    assert f"exclusive hold of {name!r} lost" in err


def test_bad_combinations_are_refused(cli: Cli, name: str) -> None:
    for extra in (["-n", "2"], ["--kind", "token"], ["--priority", "3"]):
        r = cli.run("run", name, "--shared", *extra, "--", "true")
        assert r.returncode == 64, r.stderr  # EX_USAGE
        assert "read-write lock" in r.stderr
    both = cli.run("run", name, "--shared", "--exclusive", "--", "true")
    assert both.returncode == 64 and "mutually exclusive" in both.stderr
