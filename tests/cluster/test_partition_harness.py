"""The partition harness (amqp_locks_dev.partition, issue 21 point 6) cuts for real.

Node 1 of a 3-node RabbitMQ 4.3.6 cluster runs in a network namespace this test creates; a
client beside it (a subprocess in the namespace, raw aiormq, not the library) holds a
connection to node 1 across the cut. With the link down and ``net_ticktime = 10``:

- a publish with confirms to a quorum queue led by node 1 gets **no** confirm for the whole
  cut (15 s): node 1 is on the minority side and cannot commit;
- node 2 sees node 1 go down (Erlang ``nodedown``) and ``cluster_status`` on node 2 stops
  listing it as running;
- after the heal the confirm arrives within a few seconds, on the same connection;
- after teardown no namespace, veth pair or blackhole route of the harness is left.

Run with ``-s`` to see the figures (start time, cut to detection, heal to confirm).
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import pytest

from amqp_locks_dev import partition

from .conftest import MakePartition, only_on_43

pytestmark = [
    pytest.mark.timeout(240),
    only_on_43("the harness's figures are RabbitMQ 4.3.6's (Khepri)"),
]

NET_TICKTIME = 10
#: How long the cut lasts while the confirm must not come (1.5 x net_ticktime).
CUT_WATCH = 15.0
#: How soon after the heal the confirm must come.
HEAL_BOUND = 10.0

#: The client beside node 1: declares a quorum queue on node 1 (so node 1 leads it),
#: publishes one message with confirms to check the path, prints "ready"; on a line from
#: stdin publishes again and prints "confirmed" when (if) the broker confirms it.
CLIENT = r"""
import asyncio, sys
import aiormq

async def main(url: str, queue: str) -> None:
    conn = await aiormq.connect(url)
    ch = await conn.channel(publisher_confirms=True)
    await ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    await ch.basic_publish(b"before", routing_key=queue)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await ch.basic_publish(b"during", routing_key=queue)
    print("confirmed", flush=True)
    await conn.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture(autouse=True)
def all_nodes_up() -> None:
    """Not the shared test cluster: this module makes its own (one cluster at a time)."""


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The client's stdout lines, as they come (EOF is "")."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_a_cut_stops_quorum_confirms_on_the_minority_side_until_the_heal(
    make_partition: MakePartition, name: str
) -> None:
    pc = make_partition(version="4.3", net_ticktime=NET_TICKTIME)
    print(f"\nharness: 3-node {pc.version} cluster up in {pc.started_in:.1f} s")
    assert set(pc.running_nodes(2)) == {n.node for n in pc.nodes}
    client = pc.run_in_namespace(
        [sys.executable, "-c", CLIENT, pc.node_url(1), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = _lines(client)
    assert lines.get(timeout=60) == "ready"

    seen_down: list[float] = []
    pc.watch_node_down(2, 1)  # before the cut: a CLI booted after it reads late under load
    watcher = threading.Thread(target=lambda: seen_down.append(pc.wait_node_down(2, 1)))
    watcher.start()
    cut_at = time.time()
    pc.cut()
    assert client.stdin is not None
    client.stdin.write("publish\n")
    client.stdin.flush()
    try:
        during: str | None = lines.get(timeout=CUT_WATCH)
    except queue.Empty:
        during = None  # no confirm (and no error) for the whole watch
    assert during is None, f"the minority side's client printed {during!r} during the cut"
    watcher.join(60)
    assert seen_down, "node 2 never saw node 1 go down"
    detected = seen_down[0] - cut_at
    print(f"cut -> node 2 sees node 1 down: {detected:.2f} s (net_ticktime {NET_TICKTIME})")
    assert 0.75 * NET_TICKTIME - 1 <= detected <= CUT_WATCH
    running = pc.running_nodes(2)
    assert pc.node(1).node not in running and pc.node(2).node in running

    healed_at = time.monotonic()
    pc.heal()
    assert lines.get(timeout=HEAL_BOUND) == "confirmed"
    print(f"heal -> confirm: {time.monotonic() - healed_at:.2f} s")
    assert client.wait(timeout=30) == 0

    net = pc.net
    pc.teardown()
    assert partition.leftovers(net) == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.ns not in listed
