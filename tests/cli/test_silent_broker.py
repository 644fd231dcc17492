"""A broker that accepts TCP and never answers is "unavailable" (69), never "lock busy":
whatever `-w` and `-E` say, a wait that ends without a connection is not a conflict (the
cron recipe's `-E 0` would otherwise turn an outage into a silent success)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from .conftest import Cli


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A listening socket nobody accepts from: the kernel completes the TCP handshake
    (backlog), and nothing is ever said (no AMQP connection.start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"amqp://guest:guest@127.0.0.1:{s.getsockname()[1]}/"


def test_run_against_a_silent_broker_exits_69_whatever_wait_and_conflict_code_say(
    silent_url: str, name: str
) -> None:
    cli = Cli(silent_url)
    commands = (
        ["run", name, "-w", "2", "--", "true"],
        ["run", name, "-w", "2", "-E", "0", "--", "true"],
        ["run", name, "-w", "0", "-E", "0", "--", "true"],
        ["run", name, "--shared", "-w", "2", "-E", "0", "--", "true"],
        # -n checks the count before the wait: its connection is bounded by -w as well.
        ["run", name, "-n", "3", "-w", "2", "--", "true"],
        ["run", name, "--kind", "token", "-n", "2", "-w", "2", "-E", "0", "--", "true"],
    )
    results = cli.run_many(*commands)
    for args, r in zip(commands, results, strict=True):
        assert r.returncode == 69, (r.args, r.returncode, r.stderr)
        assert "not obtained" not in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        # Ended by the wait it was given, not by the 10 s connect timeout ("within the
        # connect timeout"): the error names the bound that ended it. (A wall-clock bound
        # on four interpreters started at once failed under CI's load: 8.5 s.)
        wait = args[args.index("-w") + 1]
        assert f"did not answer within {wait} s: no connection was made" in r.stderr, r.stderr


def test_admin_command_against_a_silent_broker_exits_69_not_75(silent_url: str, name: str) -> None:
    """An admin mutex wait cut without a connection is not "another administrator"."""
    r = Cli(silent_url).run("semaphore", "create", name, "2", "--admin-timeout", "2")
    assert r.returncode == 69, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr
