"""Real (no mocks) tests of the private RabbitMQ node manager."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiormq
import pytest
from pamqp.commands import Basic
from pamqp.common import FieldValue

import amqp_locks_dev.devbroker as devbroker
from amqp_locks import Broker

from .spawn import run_script

pytestmark = pytest.mark.skipif(
    not (Path("/usr/lib/rabbitmq/bin/rabbitmqctl").exists() or shutil.which("rabbitmqctl"))
    and os.geteuid() != 0,
    reason="rabbitmq-server not installed and cannot install it without root",
)


def _unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"


@pytest.fixture
def node_dir(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A unique node name and directory; the node is always stopped afterwards."""
    name, base = _unique("t"), tmp_path / "node"
    yield name, base
    devbroker.stop(name, base)


async def _declare(url: str, queue: str, *, passive: bool = False, quorum: bool = False) -> int:
    """Declare a durable queue (or passively check one) and return its message count."""
    conn = await aiormq.connect(url)
    try:
        ch = await conn.channel()
        args: dict[str, FieldValue] = {"x-queue-type": "quorum"} if quorum else {}
        ok = await ch.queue_declare(queue, passive=passive, durable=True, arguments=args)
        return int(ok.message_count or 0)
    finally:
        await conn.close()


async def _publish_persistent(url: str, queue: str) -> None:
    conn = await aiormq.connect(url)
    try:
        ch = await conn.channel()
        await ch.basic_publish(
            b"token", routing_key=queue, properties=Basic.Properties(delivery_mode=2)
        )
    finally:
        await conn.close()


def test_lifecycle(node_dir: tuple[str, Path]) -> None:
    name, base = node_dir
    info = devbroker.start(name, base)
    assert info.url == f"amqp://guest:guest@127.0.0.1:{info.amqp_port}/%2F"
    assert (base / "node.json").exists()

    # Accepts AMQP: durable classic queue with a persistent message, and a quorum queue.
    asyncio.run(_declare(info.url, "dq"))
    asyncio.run(_publish_persistent(info.url, "dq"))
    asyncio.run(_declare(info.url, "qq", quorum=True))
    assert "dq" in devbroker.rabbitmqctl(info, "list_queues", "-q", "name")
    timeout = devbroker.rabbitmqctl(info, "eval", "application:get_env(rabbit, consumer_timeout).")
    assert str(devbroker.CONSUMER_TIMEOUT_MS) in timeout

    # Idempotent start and status.
    assert devbroker.start(name, base) == info
    assert devbroker.status(name, base) == info

    # Restart keeps ports and data.
    again = devbroker.restart(name, base)
    assert again.amqp_port == info.amqp_port and again.dist_port == info.dist_port
    assert asyncio.run(_declare(again.url, "dq", passive=True)) == 1
    asyncio.run(_declare(again.url, "qq", passive=True))

    # Stop, and stop again.
    assert devbroker.stop(name, base) is True
    assert devbroker.status(name, base) is None
    with pytest.raises((OSError, aiormq.exceptions.AMQPError)):
        asyncio.run(_declare(info.url, "dq", passive=True))
    assert devbroker.stop(name, base) is False


def test_stop_unknown_node_is_noop(tmp_path: Path) -> None:
    assert devbroker.stop(_unique("never"), tmp_path / "n") is False
    assert devbroker.status(_unique("never"), tmp_path / "n") is None


def test_invalid_name_rejected(tmp_path: Path) -> None:
    with pytest.raises(devbroker.DevBrokerError):
        devbroker.status("bad name@host", tmp_path)


def test_cli_script(tmp_path: Path) -> None:
    """scripts/broker prints only the URL, so `AMQP_URL=$(scripts/broker url)` works."""
    name = _unique("cli")
    env = {**os.environ, "AMQP_LOCKS_HOME": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_script("broker", *args, "--name", name, env=env)

    try:
        first = run("start")
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith("amqp://guest:guest@127.0.0.1:")
        assert first.stdout.count("\n") == 1
        assert run("url").stdout == first.stdout
        assert run("status").stdout == first.stdout
        assert (tmp_path / devbroker.home_subdir() / name / "node.json").exists()
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0, stopped.stderr
    gone = run("status")
    assert gone.returncode == 3
    assert gone.stdout.strip() == "not running"


def test_ctl_runs_the_nodes_own_rabbitmqctl(node: devbroker.NodeInfo, broker: Broker) -> None:
    """`scripts/broker ctl ARGS` reaches the node `scripts/broker` manages (its cookie, its
    RabbitMQ line), with rabbitmqctl's output and exit status."""
    queue = _unique("ctl")
    broker.round_trip()

    async def declare() -> None:
        session = await broker.core.session()
        await session.call(None, lambda ch: ch.queue_declare(queue, auto_delete=True))

    where = ["--name", node.name, "--base-dir", str(node.base_dir), "--version", node.version]
    try:
        broker.core.run(declare())
        listed = run_script("broker", "ctl", *where, "list_queues", "name", "-q")
        assert listed.returncode == 0, listed.stderr
        assert queue in listed.stdout.split()
        version = run_script("broker", "ctl", *where, "--", "status")
        assert version.returncode == 0 and "RabbitMQ" in version.stdout
        bad = run_script("broker", "ctl", *where, "no_such_command")
        assert bad.returncode != 0 and bad.stderr
    finally:
        devbroker.rabbitmqctl(node, "delete_queue", queue)


def test_ctl_on_a_node_that_is_not_running_exits_3(tmp_path: Path) -> None:
    r = run_script(
        "broker", "ctl", "--name", _unique("off"), "--base-dir", str(tmp_path), "list_queues"
    )
    assert r.returncode == 3 and "not running" in r.stderr
