"""Issue 22, point 5: what a test run started is stopped at its end, and only that.

Real RabbitMQ nodes in temporary directories: one started while a run's ledger is set
(``$AMQP_LOCKS_SERVER_LEDGER``, as scripts/test sets it), one that ran before the run and
was only found by it. ``amqp_locks_dev.servers.stop`` must stop the first, not the second.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import amqp_locks_dev.devbroker as devbroker
from amqp_locks_dev import servers
from amqp_locks_dev.localserver import LEDGER_ENV, STARTED, note, read_ledger

pytestmark = pytest.mark.skipif(
    not (Path("/usr/lib/rabbitmq/bin/rabbitmqctl").exists() or shutil.which("rabbitmqctl"))
    and os.geteuid() != 0,
    reason="rabbitmq-server not installed and cannot install it without root",
)


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv(LEDGER_ENV, str(path))
    return path


def test_the_first_sighting_of_a_server_decides(ledger: Path) -> None:
    note({"base_dir": "/a", "how": "found"}, "base_dir")
    note({"base_dir": "/a", "how": "started"}, "base_dir")  # a restart later in the run
    note({"base_dir": "/b", "how": "started"}, "base_dir")
    assert [(e["base_dir"], e["how"]) for e in read_ledger(ledger)] == [
        ("/a", "found"),
        ("/b", "started"),
    ]


def test_no_ledger_no_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    note({"base_dir": "/a", "how": "started"}, "base_dir")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[tuple[str, Path], tuple[str, Path]]]:
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    ours = (f"ledger-ours-{tag}", tmp_path / "ours")
    before = (f"ledger-pre-{tag}", tmp_path / "pre")
    outer = os.environ.get(LEDGER_ENV)
    if outer:
        # The test hides its nodes from the run around it (the ledger it sets is its
        # own); the run's ledger names them too, so a run stopped mid-test, whose
        # teardown below never runs, still stops them (an interrupted rehearsal left
        # the "pre" node running).
        for _, base in (ours, before):
            entry = {"server": devbroker.__name__, "base_dir": str(base), "how": STARTED}
            note(entry, "base_dir", Path(outer))
    yield ours, before
    for name, base in (ours, before):
        devbroker.stop(name, base)


def test_stop_stops_what_the_run_started_and_leaves_what_ran_before(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    two_nodes: tuple[tuple[str, Path], tuple[str, Path]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    (ours, ours_dir), (pre, pre_dir) = two_nodes
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    devbroker.start(pre, pre_dir)  # running before the run began
    ledger = tmp_path / "run.jsonl"
    servers.begin(ledger)
    monkeypatch.setenv(LEDGER_ENV, str(ledger))  # what scripts/test exports
    devbroker.start(pre, pre_dir)  # the run finds it (idempotent start)
    devbroker.start(ours, ours_dir)  # the run starts this one
    devbroker.restart(ours, ours_dir)  # a restart is still the run's own
    hows = {Path(e["base_dir"]).name: e["how"] for e in read_ledger(ledger) if "base_dir" in e}
    assert hows == {"pre": "found", "ours": "started"}, json.dumps(read_ledger(ledger))

    assert servers.stop(ledger) == 0
    assert devbroker.status(ours, ours_dir) is None, "the run's own node is still running"
    assert devbroker.status(pre, pre_dir) is not None, "a node that ran before was stopped"
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("== servers: stopped 1: RabbitMQ node ledger-ours-")
    assert out[1] == "== servers: 1 started by this run, none left running"
    assert out[2].startswith("== servers: left 1 running that ran before this run:")

    servers.show(ledger)  # --keep-servers' listing: nothing of the run's is left
    assert "kept 0 this run started" in capsys.readouterr().out


def test_a_run_removes_only_the_namespaces_its_harnesses_made(tmp_path: Path) -> None:
    """Two runs side by side on one machine (CI's lanes, a developer's run beside CI): a
    run's stop removes the namespaces its own harnesses noted, never another run's made
    while it ran (a helper's 5-node mesh lost its namespaces mid-test that way)."""
    import subprocess

    from amqp_locks_dev.localserver import STARTED

    ledger = tmp_path / "run.jsonl"
    servers.begin(ledger)
    ours, theirs = f"alp-t{secrets.token_hex(3)}", f"alp-t{secrets.token_hex(3)}"
    try:
        for ns in (ours, theirs):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        note({"netns": ours, "how": STARTED}, "netns", ledger)
        assert servers.stop(ledger, brief=True) == 0
        left = servers.namespaces()
        assert ours not in left and theirs in left
    finally:
        for ns in (ours, theirs):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
