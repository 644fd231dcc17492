"""scripts/broker (amqp_locks_dev.brokercmd): `stop` stops the epmd its node's `start`
booted, and never one that ran before the start or that serves a node. The epmd is a real
one of the host's Erlang on a port of the test's own; the node's start and stop are
stood in for (a start that boots the epmd, as a node does), since a real node registers
on its line's shared port, which the suite's other nodes use."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from amqp_locks_dev import brokercmd, epmd

from . import waiting
from .test_epmd import BINARY, _free_port, _register


class Node:
    """A stand-in for devbroker's commands: `start` boots the epmd on `port` when none
    runs there, as a booting node does; `stop` succeeds."""

    def __init__(self, port: int, base: Path) -> None:
        self.port = port
        self.base = base
        self.marker = base / brokercmd.MARKER
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

    def broker(self, *args: str) -> int:
        """``scripts/broker ARGS --base-dir BASE`` with this stand-in for devbroker."""
        return brokercmd.main([*args, "--base-dir", str(self.base)], run=self, ports=[self.port])


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    monkeypatch.delenv("AMQP_LOCKS_KEEP_EPMD", raising=False)
    n = Node(_free_port(), tmp_path)
    try:
        yield n
    finally:
        for proc in n.mappers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_stop_stops_the_epmd_its_start_booted(node: Node) -> None:
    assert node.broker("start") == 0
    assert node.marker.read_text().split() == [str(node.port)]
    assert node.broker("url") == 0  # already running: nothing more noted
    assert node.marker.read_text().split() == [str(node.port)]
    assert node.broker("stop") == 0
    assert node.mappers[0].wait(10) == 0
    assert epmd.names(node.port) is None
    assert not node.marker.exists()
    assert [c[0] for c in node.calls] == ["start", "url", "stop"]


def test_an_epmd_that_ran_before_the_start_stays(node: Node) -> None:
    before = node.boot_epmd()
    assert node.broker("start") == 0
    assert not node.marker.exists()
    assert node.broker("stop") == 0
    assert before.poll() is None and epmd.names(node.port) == []


def test_an_epmd_serving_another_node_stays(node: Node) -> None:
    assert node.broker("start") == 0
    with _register(node.port, "someone-else"):
        assert node.broker("stop") == 0
        assert node.mappers[0].poll() is None
        assert epmd.names(node.port) == ["someone-else"]
    assert not node.marker.exists()  # the note goes with the stop


def test_a_calling_script_that_sweeps_keeps_it(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    assert node.broker("start") == 0
    monkeypatch.setenv("AMQP_LOCKS_KEEP_EPMD", "1")
    assert node.broker("stop") == 0
    assert node.mappers[0].poll() is None and epmd.names(node.port) == []
    assert not node.marker.exists()


def test_a_failed_command_notes_and_stops_nothing(node: Node) -> None:
    node.status = 1
    assert node.broker("start") == 1
    assert not node.marker.exists() and node.mappers == []
    node.status = 0
    assert node.broker("start") == 0
    node.status = 1
    assert node.broker("stop") == 1  # the node may still run: its epmd stays, and so does the note
    assert node.mappers[0].poll() is None
    assert node.marker.exists()


def test_other_commands_pass_through(node: Node) -> None:
    for args in (["status"], ["ctl", "--", "status"], ["stop", "--name", "bad name!"]):
        assert node.broker(*args) == 0
    assert [c[0] for c in node.calls] == ["status", "ctl", "stop"]  # a bad name: devbroker's error
    assert node.mappers == [] and not list(node.base.iterdir())
