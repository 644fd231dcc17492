"""scripts/broker (amqp_locks_dev.brokercmd): `stop` stops the epmd its node's `start`
booted, and never one that ran before the start or that serves a node. The epmd is a real
one of the host's Erlang on a port of the test's own; the node's start and stop are
stood in for (a start that boots the epmd, as a node does), since a real node registers
on its line's shared port, which the suite's other nodes use."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from amqp_locks_dev import brokercmd, epmd

from . import waiting
from .test_epmd import BINARY, _free_port, _register


class Node:
    """A stand-in for devbroker's commands: `start` boots the epmd on `port` when none
    runs there, as a booting node does; `stop` succeeds."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.mappers: list[subprocess.Popen[bytes]] = []
        self.calls: list[list[str]] = []
        self.status = 0

    def boot_epmd(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([BINARY, "-port", str(self.port), "-address", "127.0.0.1"])
        self.mappers.append(proc)
        waiting.wait_until(lambda: epmd.names(self.port) is not None, 10, "epmd to listen")
        return proc

    def __call__(self, argv: list[str]) -> int:
        self.calls.append(argv)
        if argv[0] == "start" and self.status == 0 and epmd.names(self.port) is None:
            self.boot_epmd()
        return self.status


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node(_free_port())
    try:
        yield n
    finally:
        for proc in n.mappers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _command(node: Node, base: Path) -> Callable[..., int]:
    def run(*args: str) -> int:
        return brokercmd.main([*args, "--base-dir", str(base)], run=node, ports=[node.port])

    return run


def test_stop_stops_the_epmd_its_start_booted(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AMQP_LOCKS_KEEP_EPMD", raising=False)
    broker = _command(node, tmp_path)
    assert broker("start") == 0
    assert (tmp_path / brokercmd.MARKER).read_text().split() == [str(node.port)]
    assert broker("url") == 0  # already running: nothing more noted
    assert (tmp_path / brokercmd.MARKER).read_text().split() == [str(node.port)]
    assert broker("stop") == 0
    assert node.mappers[0].wait(10) == 0
    assert epmd.names(node.port) is None
    assert not (tmp_path / brokercmd.MARKER).exists()
    assert [c[0] for c in node.calls] == ["start", "url", "stop"]


def test_an_epmd_that_ran_before_the_start_stays(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AMQP_LOCKS_KEEP_EPMD", raising=False)
    before = node.boot_epmd()
    broker = _command(node, tmp_path)
    assert broker("start") == 0
    assert not (tmp_path / brokercmd.MARKER).exists()
    assert broker("stop") == 0
    assert before.poll() is None and epmd.names(node.port) == []


def test_an_epmd_serving_another_node_stays(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AMQP_LOCKS_KEEP_EPMD", raising=False)
    broker = _command(node, tmp_path)
    assert broker("start") == 0
    with _register(node.port, "someone-else"):
        assert broker("stop") == 0
        assert node.mappers[0].poll() is None
        assert epmd.names(node.port) == ["someone-else"]
    assert not (tmp_path / brokercmd.MARKER).exists()  # the note goes with the stop


def test_a_calling_script_that_sweeps_keeps_it(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _command(node, tmp_path)
    assert broker("start") == 0
    monkeypatch.setenv("AMQP_LOCKS_KEEP_EPMD", "1")
    assert broker("stop") == 0
    assert node.mappers[0].poll() is None and epmd.names(node.port) == []
    assert not (tmp_path / brokercmd.MARKER).exists()


def test_a_failed_command_notes_and_stops_nothing(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AMQP_LOCKS_KEEP_EPMD", raising=False)
    broker = _command(node, tmp_path)
    node.status = 1
    assert broker("start") == 1
    assert not (tmp_path / brokercmd.MARKER).exists() and node.mappers == []
    node.status = 0
    assert broker("start") == 0
    node.status = 1
    assert broker("stop") == 1  # the node may still run: its epmd stays, and so does the note
    assert node.mappers[0].poll() is None
    assert (tmp_path / brokercmd.MARKER).exists()


def test_other_commands_pass_through(node: Node, tmp_path: Path) -> None:
    for args in (["status"], ["ctl", "--", "status"], ["stop", "--name", "bad name!"]):
        argv = [*args, "--base-dir", str(tmp_path)]
        assert brokercmd.main(argv, run=node, ports=[node.port]) == 0
    assert [c[0] for c in node.calls] == ["status", "ctl", "stop"]  # a bad name: devbroker's error
    assert node.mappers == [] and not list(tmp_path.iterdir())
