"""Any name works through the CLI (issue 36 case 7): `run NAME -- true` with names users
build from data (the library's share of the 1,000 names is tests/test_any_name.py),
`status NAME` shows the user's name and its holder, and a name outside the rule exits 64
with one line (before 0.3: exit 70, "this is a bug", from pamqp's bare ValueError)."""

from __future__ import annotations

import json

from amqp_locks.names import MAX_NAME_CHARS, queue_base

from .conftest import Cli, child_env


def test_run_and_status_with_names_built_from_data(cli: Cli, name: str) -> None:
    names = [
        f"order={name}",
        f"café {name}",
        f"job({name})|tenant*a",
        f"日本語/{name}:%#🙂",
        (f"{name}é🔒" * MAX_NAME_CHARS)[:MAX_NAME_CHARS],
    ]
    for n in names:
        r = cli.run("run", n, "--", "true")
        assert r.returncode == 0, (n, r.stderr)
    r = cli.run("run", names[1], "--kind", "token", "-n", "2", "--", "true")
    assert r.returncode == 0, r.stderr
    held = cli.start("run", names[3], "--holder-id", "h-1", "-c", "echo ready; exec sleep 60")
    held.expect("ready")
    out = cli.run("status", names[3], "--json")
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    assert (row["name"], row["kind"]) == (names[3], "mutex")
    [record] = row["records"]
    assert (record["holder_id"], record["pid"]) == ("h-1", held.popen.pid)
    table = cli.run("status", names[3], env=child_env(COLUMNS="250"))
    assert names[3] in table.stdout and queue_base(names[3]) not in table.stdout
    held.kill()


def test_names_outside_the_rule_exit_64_with_one_line(cli: Cli, name: str) -> None:
    for bad in ("amq.x", f"{name}.mutex", "x" * (MAX_NAME_CHARS + 1), "a\x7fb"):
        r = cli.run("run", bad, "--", "true")
        assert r.returncode == 64, (bad, r.stderr)
        assert r.stderr.count("\n") == 1, r.stderr
