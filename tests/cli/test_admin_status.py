"""`amqp-locks semaphore|token|status|broker`: the real command against the test broker."""

from __future__ import annotations

import json
import re
import signal
import socket

from .conftest import Cli, child_env


def test_semaphore_admin_commands(cli: Cli, name: str) -> None:
    none, missing, bad = cli.run_many(
        ["semaphore", "max", name],
        ["semaphore", "holders", name],
        ["semaphore", "create", name, "0"],
    )
    assert none.stdout == "0\n", none.stderr
    assert missing.returncode == 65 and missing.stderr.count("\n") == 1
    assert bad.returncode == 64

    created = cli.run("semaphore", "create", name, "2")
    assert created.stdout == "2\n", (created.returncode, created.stderr)
    again, conflict = cli.run_many(
        ["semaphore", "create", name, "2"], ["semaphore", "create", name, "5"]
    )
    assert again.returncode == 0  # idempotent
    assert conflict.returncode == 65 and "already" in conflict.stderr
    added = cli.run("semaphore", "add", name, "2")
    assert added.stdout == "4\n", (added.returncode, added.stderr)

    holder = cli.start("run", name, "--kind", "semaphore", "-c", "echo ready; exec sleep 60")
    holder.expect("ready")
    held, waited = cli.run_many(
        ["semaphore", "holders", name, "--json"],
        ["semaphore", "wait", name, "1", "--timeout", "0.5"],
    )
    assert held.stdout.strip() == "[1]"
    assert (waited.returncode, waited.stdout) == (75, "still held: 1\n")

    removed = cli.run("semaphore", "remove", name, "1")
    assert removed.stdout.startswith("removed 1 slot(s) 4")

    holder.popen.send_signal(signal.SIGTERM)
    assert holder.finish()[0] == 128 + signal.SIGTERM
    assert cli.run("semaphore", "wait", name, "--timeout", "10").returncode == 0
    destroyed = cli.run("semaphore", "destroy", name)
    assert destroyed.stdout.startswith("removed 3 slot(s) 3,2,1")


def test_token_admin_commands(cli: Cli, name: str) -> None:
    missing, setup = cli.run_many(["token", "status", name], ["token", "setup", name + "x", "2"])
    assert missing.returncode == 65
    assert setup.stdout == "2\n", setup.stderr
    name = name + "x"
    added = cli.run("token", "add", name, "1")
    assert added.stdout == "3\n", (added.returncode, added.stderr)
    audit = cli.run("token", "audit", name, "--timeout", "0.2", "--json")
    assert audit.returncode == 0 and json.loads(audit.stdout)["seen"] == [1, 2, 3]
    assert cli.run("token", "remove", name, "2", "--timeout", "5").stdout.split() == ["1", "2"]
    st = json.loads(cli.run("token", "status", name, "--json").stdout)
    assert (st["permits"], st["ready"]) == (1, 1)
    assert cli.run("token", "destroy", name).returncode == 0
    assert cli.run("token", "status", name).returncode == 65


def test_status_json_matches_reality(cli: Cli, name: str) -> None:
    sem, tok, mtx, none = name + "s", name + "t", name + "m", name + "x"
    assert cli.run("token", "setup", tok, "2").returncode == 0
    holders = [
        cli.start("run", sem, "-n", "3", "--holder-id", "sem-1", "-c", "echo ready; exec sleep 60"),
        cli.start("run", tok, "--kind", "token", "-c", "echo ready; exec sleep 60"),
        cli.start("run", mtx, "--holder-id", "mtx-1", "-c", "echo ready; exec sleep 60"),
    ]
    for h in holders:
        h.expect("ready")
    waiter = cli.start("run", tok, "--kind", "token", "-n", "2", "-c", "echo ready; exec sleep 60")
    waiter.expect("ready")  # the second permit
    waiter2 = cli.start("run", tok, "--kind", "token", "--", "true")

    def tok_row() -> dict[str, object]:
        out = cli.run("status", sem, tok, mtx, none, "--json")
        assert out.returncode == 0, out.stderr
        rows = {r["name"]: r for r in json.loads(out.stdout)}
        records = {n: r.pop("records", None) for n, r in rows.items()}
        [srec] = records[sem]
        assert (srec["kind"], srec["number"], srec["holder_id"], srec["pid"]) == (
            "semaphore",
            1,
            "sem-1",
            holders[0].popen.pid,
        )
        assert srec["host"] == socket.gethostname() and srec["fencing_token"] >= 1
        [mrec] = records[mtx]
        assert (mrec["holder_id"], mrec["pid"]) == ("mtx-1", holders[2].popen.pid)
        assert records[none] is None  # nothing to ask about
        tok_ids = {r["holder_id"] for r in records[tok]}
        assert tok_ids <= {f"{socket.gethostname()}:{p.popen.pid}" for p in (holders[1], waiter)}
        assert rows[sem] == {
            "name": sem,
            "kind": "semaphore",
            "slots": 3,
            "held": 1,
            "holders": [1],
            "free": 2,
        }
        assert rows[mtx] == {"name": mtx, "kind": "mutex", "held": True}
        assert rows[none] == {"name": none, "kind": "absent", "held": False}
        return rows[tok]

    # Until the second waiter is a consumer, it may not be counted yet.
    for _ in range(50):
        row = tok_row()
        if row["waiting"] == 1:
            break
    assert row == {
        "name": tok,
        "kind": "token",
        "permits": 2,
        "ready": 0,
        "held": 2,
        "consumers": 3,
        "waiting": 1,
    }
    table = cli.run("status", sem, tok, mtx, env=child_env(COLUMNS="250"))
    assert table.returncode == 0 and "semaphore" in table.stdout and "token" in table.stdout
    assert "held by" in table.stdout
    assert f"slot 1: sem-1 (host {socket.gethostname()}, pid {holders[0].popen.pid}) since" in (
        table.stdout
    )
    assert f"mtx-1 (host {socket.gethostname()}, pid {holders[2].popen.pid})" in table.stdout
    out = cli.run("status", sem, "--json", "--holder-timeout", "0")
    assert out.returncode == 0, out.stderr
    bare = json.loads(out.stdout)
    assert "records" not in bare[0]  # not asked
    for h in [*holders, waiter]:
        h.popen.send_signal(signal.SIGTERM)
        h.finish()
    assert waiter2.finish()[0] == 0  # got a permit once the holders left


def test_status_needs_a_name(cli: Cli) -> None:
    r = cli.run("status")
    assert r.returncode == 64 and r.stderr.count("\n") == 1


def test_version_and_help(cli: Cli) -> None:
    assert cli.run("--version").stdout.startswith("amqp-locks, version")
    helped = cli.run("--help")
    assert helped.returncode == 0 and "Examples:" in helped.stdout
    assert cli.run("no-such-command").returncode == 64


def test_the_help_lists_every_exit_code() -> None:
    """The top-level help's exit codes are every code the commands use (issue 38: it
    left out 2, 70, 78 and 130), each as a word of its own."""
    from amqp_locks.cli import EPILOG
    from amqp_locks.cli.exitcodes import Exit

    codes = EPILOG.split("Exit codes:", 1)[1]
    words = set(re.findall(r"\d+", codes))
    missing = [f"{e.name} {e.value}" for e in Exit if e and str(e.value) not in words]
    assert not missing, f"not in `amqp-locks --help`: {missing}"


def test_the_command_starts_no_server(cli: Cli) -> None:
    """The private development node is the repository's tooling (scripts/broker), not a
    command of the installed package."""
    r = cli.run("broker", "start")
    assert r.returncode == 64 and "No such command 'broker'" in r.stderr
    assert "broker start" not in cli.run("--help").stdout


def test_status_prints_whole_fencing_tokens_at_80_columns(
    cli: Cli, amqp_url: str, name: str
) -> None:
    """Tokens are ~2**52 (16 digits): neither a pipe at COLUMNS=80 nor an 80-column
    terminal cuts one."""
    from rich.console import Console

    from amqp_locks import Broker, Mutex
    from amqp_locks.cli.status import _table, collect, show

    with Broker(amqp_url) as b, Mutex(b, name) as lease:
        token = str(lease.fencing_token)
        assert len(token) >= 16
        piped = cli.run("status", name, env=child_env(COLUMNS="80"))
        assert piped.returncode == 0 and token in piped.stdout, piped.stdout
        assert name in piped.stdout and "…" not in piped.stdout
        terminal = Console(width=80, force_terminal=True, record=True, color_system=None)
        show(terminal, _table(collect(b, name), b.url))
        text = terminal.export_text()
        assert token in text and name in text, text  # the terminal wraps; nothing is cut
