"""`amqp-locks elect`: master/standby with the real command and the real broker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from amqp_locks_dev import devbroker

from .conftest import Cli, child_env
from .test_run import _assert_gone

SCRIPT = 'echo "master $TAG $$ $AMQP_LOCKS_FENCING_TOKEN"; exec sleep 60'


def _elect(cli: Cli, name: str, tag: str, locker: list[str]):  # type: ignore[no-untyped-def]
    return cli.start(
        "elect",
        name,
        *locker,
        "--interval",
        "0.3",
        "--keep-alive",
        "0.2",
        "--grace",
        "2",
        "-c",
        SCRIPT,
        env=child_env(TAG=tag),
    )


@pytest.mark.parametrize("kind", ["amqp", "file"])
def test_standby_takes_over_when_master_is_killed(
    cli: Cli, name: str, tmp_path: Path, kind: str
) -> None:
    locker = ["--locker", kind] + (["--directory", str(tmp_path)] if kind == "file" else [])
    a = _elect(cli, name, "A", locker)
    _, _, a_child, a_token = a.expect("master A").split()
    b = _elect(cli, name, "B", locker)
    b.expect("standby", which="err")
    assert not [line for line in b.out if "master" in line]  # B's COMMAND did not run

    a.popen.kill()  # SIGKILL: no clean release
    a.finish()
    _assert_gone(int(a_child))  # A's COMMAND died with it
    _, _, b_child, b_token = b.expect("master B").split()
    if kind == "amqp":
        assert int(b_token) > int(a_token)

    b.popen.send_signal(signal.SIGTERM)
    rc, _, _ = b.finish()
    assert rc == 0
    _assert_gone(int(b_child))


def test_demoted_master_stops_command_and_stands_by(
    cli: Cli, name: str, node: devbroker.NodeInfo
) -> None:
    a = _elect(cli, name, "A", ["--locker", "amqp"])
    _, _, first_child, first_token = a.expect("master A").split()
    devbroker.rabbitmqctl(node, "delete_queue", name)  # the lock is taken away
    a.expect("lost mastership", which="err")
    a.expect("standby", which="err")
    _assert_gone(int(first_child))
    # Nobody else wants it: the same process becomes master again, with a new token.
    _, _, second_child, second_token = a.expect("master A").split()
    assert second_child != first_child and int(second_token) > int(first_token)
    a.popen.send_signal(signal.SIGTERM)
    assert a.finish()[0] == 0


def test_command_status_is_passed_through(cli: Cli, name: str) -> None:
    r = cli.run("elect", name, "--interval", "0.3", "--", "sh", "-c", "exit 5")
    assert r.returncode == 5, r.stderr
    bad = cli.run("elect", name, "--locker", "file", "--", "true")
    assert bad.returncode == 64 and "--directory" in bad.stderr
    cfg = cli.run("elect", name, "--config", os.devnull, "--", "true")
    assert cfg.returncode == 78 and cfg.stderr.count("\n") == 1
