"""Per-entity lock names (issue 30): what N distinct names cost, and what they leave behind.

Most applications lock per entity, ``Mutex(broker, f"order-{id}")``: every name is used a
few times and then never again. This measures, against whatever version of the library is
importable (``PYTHONPATH=...`` picks another), N distinct names each acquired once and
released (fencing on, the default) by P processes with one ``Broker`` each:

- names/s over the whole run, first-use acquire p50/p95 (every name is new), warm p50
  (the same process re-acquiring a name it used just before, interleaved with the first
  uses so that both see the same load), every acquire's outcome (granted,
  timed out, raised: ``acquire(timeout=...)``);
- whether the node answered ``rabbitmqctl status`` throughout (polled on a thread with a
  timeout: the worst answer time and every failure), with a guard: when status stops
  answering the run is stopped and the node we started is killed by its PID;
- the broker's state (queue count, the beam's open fds from /proc, Erlang memory and
  process count) at the start, right after the last release (every client closed), then
  every 10 s until 2 minutes later or until back within 5 % of the start;
- memory per held name (K names held at once, the delta divided by K);
- Redis beside it: the same names with redis-py's ``Lock`` on a private redis-server.

``python -m benchmarks.names --help`` (or ``python -m benchmarks.run names``); results
in ``benchmarks/results/names-<line>.json`` and a markdown table (stdout and ``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .stats import percentile

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_NODE = "amqplocksnames"
#: The Erlang expression one ``rabbitmqctl eval`` answers the broker's state with: queue
#: count (every vhost), Erlang memory and processes, and RabbitMQ's own file-handle account
#: (3.x's file_handle_cache, used and limit; -1 where it is gone, 4.x). On 3.10.8 a quorum
#: queue reserves 3 of those handles without an open fd: /proc's fd count does not see it.
STATE_EXPR = (
    "{try rabbit_amqqueue:count() catch _:_ -> length(rabbit_amqqueue:list()) end,"
    " erlang:memory(total), erlang:system_info(process_count),"
    " try [U, L] = [V || {_, V} <- file_handle_cache:info([total_used, total_limit])], {U, L}"
    " catch _:_ -> {-1, -1} end}."
)
#: Closeness to the start state that ends the watch after the last release: relative,
#: and an absolute slack per figure (a queue count of 0 has no 5 %).
SETTLE_REL = 0.05
SETTLE_SLACK = {"queues": 2, "fds": 10, "handles": 10, "memory": 0, "processes": 20}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ pure logic (tested)


def summarize_ms(samples: Sequence[float]) -> dict[str, Any]:
    """Count, p50, p95, p99 and max in ms of durations in seconds (None when empty)."""
    if not samples:
        return {"n": 0, "p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}

    def ms(q: float) -> float:
        return round(1000 * percentile(samples, q), 2)

    return {
        "n": len(samples),
        "p50_ms": ms(50),
        "p95_ms": ms(95),
        "p99_ms": ms(99),
        "max_ms": round(1000 * max(samples), 2),
    }


def split(names: Sequence[str], parts: int) -> list[list[str]]:
    """``names`` dealt round-robin into ``parts`` shares (every process gets new names
    from the first to the last moment of the run)."""
    parts = max(1, min(parts, len(names)))  # never an empty share
    return [list(names[i::parts]) for i in range(parts)]


def parse_state(text: str) -> dict[str, int | None]:
    """``rabbitmqctl eval`` of :data:`STATE_EXPR`:
    ``{Queues, MemoryBytes, Processes, {HandlesUsed, HandlesLimit}}`` (-1: none)."""
    nums = [int(x) for x in re.findall(r"-?\d+", text)]
    if len(nums) != 5:
        raise ValueError(f"unexpected answer to the state expression: {text.strip()[:200]!r}")
    keys = ("queues", "memory", "processes", "handles", "handles_limit")
    return {k: (None if v < 0 else v) for k, v in zip(keys, nums, strict=True)}


def settled(start: dict[str, Any], now: dict[str, Any], rel: float = SETTLE_REL) -> bool:
    """Whether every figure of ``now`` is back within ``rel`` of ``start`` (plus its slack
    from :data:`SETTLE_SLACK`); a figure missing on either side is not judged."""
    for key, slack in SETTLE_SLACK.items():
        a, b = start.get(key), now.get(key)
        if isinstance(a, int) and isinstance(b, int) and b > a + max(rel * a, slack):
            return False
    return True


def per_item(before: dict[str, Any], after: dict[str, Any], count: int) -> dict[str, Any]:
    """What each of ``count`` items added between two states: queues, fds, bytes,
    Erlang processes (None where a side is missing)."""
    out: dict[str, Any] = {}
    for key in ("queues", "fds", "handles", "memory", "processes"):
        a, b = before.get(key), after.get(key)
        ok = isinstance(a, int) and isinstance(b, int) and count > 0
        out[key] = round((b - a) / count, 3) if ok else None  # type: ignore[operator]
    return out


def summarize_workers(reports: Sequence[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One phase's worker reports (see :func:`_worker`) as the results' figures."""
    first = [x for r in reports for x in r.get("first", [])]
    warm = [x for r in reports for x in r.get("warm", [])]
    release = [x for r in reports for x in r.get("release", [])]
    errors: Counter[str] = Counter()
    for r in reports:
        errors.update(r.get("errors", {}))
    done = sum(r.get("done", 0) for r in reports)
    granted = sum(r.get("granted", 0) for r in reports)
    return {
        "names_done": done,
        "granted": granted,
        "timeouts": sum(r.get("timeouts", 0) for r in reports),
        "failures": sum(r.get("failures", 0) for r in reports),
        "errors": dict(errors.most_common(10)),
        "wall_s": round(wall, 2),
        "names_per_s": round(done / wall, 1) if wall > 0 else None,
        "first_use": summarize_ms(first),
        "warm": summarize_ms(warm),
        "release": summarize_ms(release),
    }


def _fmt(x: Any, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        x = f"{x:,.1f}" if abs(x) < 1e4 else f"{x:,.0f}"
    elif isinstance(x, int):
        x = f"{x:,}"
    return f"{x}{unit}"


def table(results: dict[str, Any]) -> str:
    """The markdown summary of a results file."""
    plan, env = results["plan"], results["environment"]
    amqp, redis = results.get("amqp", {}), results.get("redis", {})
    states = results.get("states", {})
    start = states.get("start", {})
    after = states.get("after_release", {})
    last = (states.get("watch") or [after])[-1] if after else {}
    status = results.get("status_poll", {})
    mib = 2**20

    def mem(s: dict[str, Any]) -> str:
        return _fmt(s["memory"] / mib, " MiB") if isinstance(s.get("memory"), int) else "n/a"

    stall = results.get("stalled")
    lines = [
        f"Names benchmark: {plan['names']:,} names by {plan['procs']} processes on "
        f"{env.get('broker', 'n/a')} (library "
        f"{env.get('amqp_locks_src_commit') or env.get('amqp_locks_git', 'n/a')}, "
        f"{env.get('date', '')})",
        "",
        "| figure | amqp-locks | Redis (redis-py Lock) |",
        "|:---|---:|---:|",
        f"| names done / asked | {_fmt(amqp.get('names_done'))} / {plan['names']:,} | "
        f"{_fmt(redis.get('names_done'))} / {plan['names']:,} |",
        f"| names/s | {_fmt(amqp.get('names_per_s'))} | {_fmt(redis.get('names_per_s'))} |",
        f"| first-use acquire p50 / p95 | {_fmt(amqp.get('first_use', {}).get('p50_ms'))} / "
        f"{_fmt(amqp.get('first_use', {}).get('p95_ms'), ' ms')} | "
        f"{_fmt(redis.get('first_use', {}).get('p50_ms'))} / "
        f"{_fmt(redis.get('first_use', {}).get('p95_ms'), ' ms')} |",
        f"| warm acquire p50 | {_fmt(amqp.get('warm', {}).get('p50_ms'), ' ms')} | "
        f"{_fmt(redis.get('warm', {}).get('p50_ms'), ' ms')} |",
        f"| timeouts / failures | {_fmt(amqp.get('timeouts'))} / {_fmt(amqp.get('failures'))}"
        f" | {_fmt(redis.get('timeouts'))} / {_fmt(redis.get('failures'))} |",
        f"| queues (keys) start -> after -> end of watch | {_fmt(start.get('queues'))} -> "
        f"{_fmt(after.get('queues'))} -> {_fmt(last.get('queues'))} | "
        f"{_fmt(redis.get('keys_before'))} -> {_fmt(redis.get('keys_after'))} |",
        f"| beam open fds start -> after -> end (limit) | {_fmt(start.get('fds'))} -> "
        f"{_fmt(after.get('fds'))} -> {_fmt(last.get('fds'))} "
        f"({_fmt(results.get('node_limits', {}).get('open_files'))}) | |",
        f"| RabbitMQ file handles (file_handle_cache) start -> after -> end (limit) | "
        f"{_fmt(start.get('handles'))} -> {_fmt(after.get('handles'))} -> "
        f"{_fmt(last.get('handles'))} ({_fmt(start.get('handles_limit'))}) | |",
        f"| Erlang memory start -> after -> end | {mem(start)} -> {mem(after)} -> {mem(last)} | |",
        f"| Erlang processes start -> after -> end | {_fmt(start.get('processes'))} -> "
        f"{_fmt(after.get('processes'))} -> {_fmt(last.get('processes'))} | |",
        f"| `rabbitmqctl status`: polls, worst answer, failures | "
        f"{_fmt(status.get('polls'))}, {_fmt(status.get('worst_s'), ' s')}, "
        f"{_fmt(status.get('failures'))} | |",
    ]
    if last is not after and after:
        lines.append(
            f"| watch after the last release | {last.get('t_s', 'n/a')} s, "
            f"{'back within 5 % of start' if results.get('settled') else 'not back'}"
            " | |"
        )
    held = results.get("hold", {})
    if held.get("per_name"):
        p = held["per_name"]
        lines.append(
            f"| per held name ({held['held']:,} held) | {_fmt(p['memory'] and p['memory'] / 1024)}"
            f" KiB, {_fmt(p['queues'])} queues, {_fmt(p['fds'])} fds, "
            f"{_fmt(p['handles'])} file handles, "
            f"{_fmt(p['processes'])} processes | |"
        )
        if held.get("released"):
            r = held["released"]
            lines.append(
                f"| left per name after the held ones' release | "
                f"{_fmt(r['queues'])} queues, {_fmt(r['fds'])} fds, "
                f"{_fmt(r['handles'])} file handles | |"
            )
    if plan.get("cluster"):
        lines += ["", "Cluster: queues counted once; fds, memory and processes summed over nodes."]
    if stall:
        lines += ["", f"STALLED: {stall}"]
    if results.get("note"):
        lines += ["", f"Note: {results['note']}"]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------- workers


@dataclass
class Plan:
    names: int = 2000
    procs: int = 8
    timeout: float = 30.0
    warm: int = 100
    hold: int = 1000
    watch_s: float = 120.0
    watch_every: float = 10.0
    status_every: float = 5.0
    status_timeout: float = 30.0
    #: Consecutive failed status polls that stop the run.
    stall_after: int = 2
    prefix: str = "order"
    redis: bool = True
    cluster: bool = False
    nofile: int | None = None
    #: rabbitmq.conf lines added to the private node's (e.g. a smaller Raft WAL).
    broker_conf: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _what(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()[:200]


class _Client:
    """One lock library's acquire/release of a name, on one connection."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        if kind == "amqp":
            from amqp_locks import Broker

            self.broker = Broker(url, connection_name=f"amqp-locks bench names {os.getpid()}")
            self.broker.connect()
        else:
            import redis

            self.redis = redis.Redis.from_url(url)
            self.redis.ping()

    def acquire(self, name: str, timeout: float) -> Any:
        if self.kind == "amqp":
            from amqp_locks import Mutex

            return Mutex(self.broker, name).acquire(timeout=timeout)
        lock = self.redis.lock(name)
        return lock if lock.acquire(blocking_timeout=timeout) else None

    def close(self) -> None:
        if self.kind == "amqp":
            self.broker.close()
        else:
            self.redis.close()


def _worker(
    kind: str,
    url: str,
    names: list[str],
    plan: Plan,
    mode: str,
    conn: Any,
    go: Any,
    stop: Any,
    progress: Any,
) -> None:
    """``mode`` "cycle": acquire and release each name, and ``plan.warm`` times meanwhile
    one used just before (warm); "hold": acquire all, report, release on "release"."""
    import faulthandler
    import logging

    # Where a worker that the guard kills was stuck: its stack on stderr (SIGUSR1 first).
    faulthandler.register(signal.SIGUSR1, all_threads=False)
    logging.getLogger().setLevel(logging.ERROR)
    for noisy in ("aiormq", "amqp_locks"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    rep: dict[str, Any] = {
        "first": [],
        "warm": [],
        "release": [],
        "done": 0,
        "granted": 0,
        "timeouts": 0,
        "failures": 0,
        "errors": Counter(),
    }
    try:
        client = _Client(kind, url)
    except Exception as exc:
        rep["errors"][f"connect: {_what(exc)}"] += 1
        conn.send(("report", {**rep, "failures": 1, "errors": dict(rep["errors"])}))
        return
    conn.send(("ready",))
    go.wait()
    held: list[Any] = []
    granted: list[str] = []

    def one(name: str, into: str, keep: bool) -> None:
        t0 = time.perf_counter()
        try:
            lease = client.acquire(name, plan.timeout)
        except Exception as exc:
            rep["failures"] += 1
            rep["errors"][_what(exc)] += 1
            return
        t1 = time.perf_counter()
        if lease is None:
            rep["timeouts"] += 1
            return
        rep[into].append(t1 - t0)
        if into == "first":
            rep["granted"] += 1
            granted.append(name)
        if keep:
            held.append(lease)
            return
        try:
            lease.release()
            rep["release"].append(time.perf_counter() - t1)
        except Exception as exc:
            rep["failures"] += 1
            rep["errors"][f"release: {_what(exc)}"] += 1

    # Warm samples are interleaved with the first uses, so both see the same broker load:
    # every `spacing`-th name, the name used two before is taken again (still known to
    # the broker: its helper queues expire a minute after their last use).
    spacing = max(1, len(names) // plan.warm) if plan.warm and mode == "cycle" else 0
    try:
        for i, name in enumerate(names):
            if stop.is_set():
                break
            one(name, "first", mode == "hold")
            rep["done"] += 1
            progress.value = rep["done"]
            if spacing and i % spacing == spacing - 1 and len(granted) >= 2:
                one(granted[-2], "warm", False)
            if len(rep["first"]) >= PART:  # a worker killed later keeps what it sent
                conn.send(("part", _part(rep)))
        if mode != "cycle":
            conn.send(("held", len(held)))
            conn.recv()  # "release"
            for lease in held:
                with contextlib.suppress(Exception):
                    lease.release()
    finally:
        with contextlib.suppress(Exception):
            client.close()
        conn.send(("report", _part(rep)))


#: Names between a worker's "part" messages (its samples so far, and its counts).
PART = 50
_SAMPLES = ("first", "warm", "release")


def _part(rep: dict[str, Any]) -> dict[str, Any]:
    """A worker's samples since its last part (then cleared) and its counts so far."""
    out = {
        k: (list(v) if k in _SAMPLES else dict(v) if k == "errors" else v) for k, v in rep.items()
    }
    for k in _SAMPLES:
        rep[k].clear()
    return out


def merge(into: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """A worker's parts added up: samples appended, counts (cumulative) replaced."""
    for k, v in part.items():
        if k in _SAMPLES:
            into.setdefault(k, []).extend(v)
        else:
            into[k] = v
    return into


class _Crew:
    """P worker processes of one phase; ``stop`` ends their loops at the next name."""

    def __init__(self, kind: str, url: str, names: list[str], plan: Plan, mode: str) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["amqp_locks", "redis"])
        self.go, self.stop = ctx.Event(), ctx.Event()
        self.procs: list[tuple[Any, Any, Any]] = []
        for share in split(names, plan.procs):
            parent, child = ctx.Pipe()
            progress = ctx.Value("i", 0, lock=False)
            args = (kind, url, share, plan, mode, child, self.go, self.stop, progress)
            p = ctx.Process(target=_worker, args=args, daemon=True)
            p.start()
            self.procs.append((p, parent, progress))
        self.reports: list[dict[str, Any] | None] = [None] * len(self.procs)
        self.parts: list[dict[str, Any]] = [{} for _ in self.procs]

    def _take(self, i: int, msg: Any) -> bool:
        """Handle worker ``i``'s message; False for a part (not an answer)."""
        if msg[0] in ("part", "report"):
            merge(self.parts[i], msg[1])
        if msg[0] == "report":
            self.reports[i] = self.parts[i]
        return bool(msg[0] != "part")

    def expect(self, what: str, timeout: float, stalled: Callable[[], bool]) -> list[Any]:
        """Each worker's next message (its report if it sends that instead), waiting
        up to ``timeout`` s; stops early when ``stalled()``."""
        # A worker that reported sends nothing more: its report answers every question.
        out: list[Any] = [r if r is None else ("report", r) for r in self.reports]
        deadline = time.monotonic() + timeout
        while any(x is None for x in out) and time.monotonic() < deadline and not stalled():
            for i, (p, pipe, _) in enumerate(self.procs):
                if out[i] is None and pipe.poll(0.05):
                    msg = pipe.recv()
                    if self._take(i, msg):
                        out[i] = msg
                elif out[i] is None and not p.is_alive() and not pipe.poll(0):
                    out[i] = ("died", p.exitcode)
        return out

    def progress(self) -> int:
        return sum(v.value for _, _, v in self.procs)

    def finish(self, grace: float) -> list[dict[str, Any]]:
        """Stop the loops, collect the reports (``grace`` s), kill the stragglers."""
        self.stop.set()
        self.expect("report", grace, lambda: False)
        for i, (p, pipe, progress) in enumerate(self.procs):
            with contextlib.suppress(EOFError, OSError):
                while self.reports[i] is None and pipe.poll(0):
                    self._take(i, pipe.recv())
            p.join(1)
            if p.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGUSR1)  # its stack, to stderr
                p.join(1)
                p.kill()
                p.join(5)
            if self.reports[i] is None:  # killed mid-call: its parts and its progress
                errors = dict(self.parts[i].get("errors", {}))
                errors["worker killed (no report)"] = 1
                self.reports[i] = {**self.parts[i], "done": progress.value, "errors": errors}
        return [r for r in self.reports if r is not None]


# -------------------------------------------------------------------- broker state


@dataclass
class _Node:
    """One node we measure: how to run rabbitmqctl on it, its beam's PID."""

    info: Any  # devbroker.NodeInfo
    pid: int | None

    def ctl(self, *args: str, timeout: float = 30.0) -> str:
        from amqp_locks_dev import devbroker

        return devbroker.rabbitmqctl(self.info, *args, timeout=timeout)

    def fds(self) -> int | None:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except (OSError, TypeError):
            return None

    def limits(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/limits").read_text().splitlines():
                if line.startswith(("Max open files", "Max processes")):
                    parts = line.split()
                    key = "open_files" if "files" in line else "os_processes"
                    soft, hard = parts[-3], parts[-2]
                    out[key] = int(soft) if soft.isdigit() else soft
                    out[f"{key}_hard"] = int(hard) if hard.isdigit() else hard
        return out

    def state(self) -> dict[str, Any]:
        st: dict[str, Any] = {"fds": self.fds()}
        t0 = time.monotonic()
        try:
            st.update(parse_state(self.ctl("eval", STATE_EXPR)))
        except Exception as exc:
            st["error"] = _what(exc)
        st["eval_s"] = round(time.monotonic() - t0, 2)
        return st


#: The node's 12 largest processes by memory: (registered name or initial call, bytes).
_TOP_PROCESSES = (
    "F = fun(P) -> case erlang:process_info(P, [registered_name, memory]) of"
    " [{registered_name, R}, {memory, M}] ->"
    " [{case R of [] -> proc_lib:translate_initial_call(P); _ -> R end, M}];"
    " _ -> [] end end,"
    " lists:sublist(lists:reverse(lists:keysort(2,"
    " lists:append([F(P) || P <- erlang:processes()]))), 12)."
)


def _breakdown(node: _Node) -> str:
    """``rabbit_vm:memory()`` of one node and its largest processes, as the node prints
    them (or the error)."""
    try:
        vm = node.ctl("eval", "rabbit_vm:memory().", timeout=60.0).strip()
        top = node.ctl("eval", _TOP_PROCESSES, timeout=60.0).strip()
    except Exception as exc:
        return f"error: {_what(exc)}"
    return f"{vm}\nlargest processes: {top}"


def _state(nodes: list[_Node], t0: float | None = None) -> dict[str, Any]:
    """The cluster's state: queues from the first node that answers (the count is
    cluster-wide), fds, memory and processes summed over nodes (each node's kept too)."""
    each = [n.state() for n in nodes]
    out: dict[str, Any] = {"at": dt.datetime.now(dt.UTC).strftime("%H:%M:%S")}
    if t0 is not None:
        out["t_s"] = round(time.monotonic() - t0, 1)
    out["queues"] = next((s["queues"] for s in each if "queues" in s), None)
    out["handles_limit"] = each[0].get("handles_limit")
    for key in ("fds", "handles", "memory", "processes"):
        vals = [s.get(key) for s in each]
        out[key] = sum(vals) if all(isinstance(v, int) for v in vals) else None
    errors = [s["error"] for s in each if "error" in s]
    if errors:
        out["errors"] = errors
    if len(nodes) > 1:
        out["nodes"] = each
    return out


class _StatusPoll(threading.Thread):
    """``rabbitmqctl status`` on every node every ``every`` s with a timeout: answer
    times, failures; ``stalled`` once ``stall_after`` polls in a row failed."""

    def __init__(self, nodes: list[_Node], plan: Plan) -> None:
        super().__init__(daemon=True)
        self.nodes, self.plan = nodes, plan
        self.done, self.stalled = threading.Event(), threading.Event()
        self.times: list[float] = []
        self.failed: list[dict[str, Any]] = []
        self.worst = 0.0
        self.stalled_at: str | None = None

    def run(self) -> None:
        in_a_row = 0
        while not self.done.wait(self.plan.status_every):
            bad = False
            for n in self.nodes:
                t0 = time.monotonic()
                try:
                    n.ctl("status", timeout=self.plan.status_timeout)
                except Exception as exc:
                    bad = True
                    self.failed.append(
                        {"at": time.strftime("%H:%M:%S"), "node": n.info.node, "error": _what(exc)}
                    )
                took = time.monotonic() - t0
                self.times.append(took)
                self.worst = max(self.worst, took)
            in_a_row = in_a_row + 1 if bad else 0
            if in_a_row >= self.plan.stall_after and not self.stalled.is_set():
                self.stalled_at = time.strftime("%H:%M:%S")
                self.stalled.set()

    def summary(self) -> dict[str, Any]:
        if not self.nodes:  # --url: no node of ours to ask
            return {"polls": None, "worst_s": None, "failures": None}
        return {
            "every_s": self.plan.status_every,
            "timeout_s": self.plan.status_timeout,
            "polls": len(self.times),
            "worst_s": round(self.worst, 2),
            "p50_s": round(percentile(self.times, 50), 2) if self.times else None,
            "failures": len(self.failed),
            "failed": self.failed[:20],
            "stalled_at": self.stalled_at,
        }


# ---------------------------------------------------------------------------- phases


def _phase(
    kind: str,
    url: str,
    names: list[str],
    plan: Plan,
    stalled: Callable[[], bool],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every name of ``names`` acquired and released once by ``plan.procs`` processes."""
    crew = _Crew(kind, url, names, plan, "cycle")
    try:
        crew.expect("ready", 120, stalled)
        t0 = time.monotonic()
        crew.go.set()
        last_log = t0
        while not stalled():
            if all(r is not None for r in crew.expect("report", 1.0, stalled)):
                break
            if time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                log(f"  {kind}: {crew.progress():,} of {len(names):,} names")
        wall = time.monotonic() - t0
        stopped = stalled()
        reports = crew.finish(plan.timeout + 5)
    finally:
        crew.stop.set()
        crew.go.set()
    out = summarize_workers(reports, wall)
    out["stopped_by_guard"] = stopped
    return out


def _hold(
    url: str,
    nodes: list[_Node],
    plan: Plan,
    stalled: Callable[[], bool],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """K fresh names held at once (``plan.procs`` processes): state before, while held,
    and after their release; the difference per name."""
    k = plan.hold
    names = [f"{plan.prefix}-held-{i}" for i in range(k)]
    before = _state(nodes)
    crew = _Crew("amqp", url, names, plan, "hold")
    out: dict[str, Any] = {"asked": k, "before": before}
    try:
        crew.expect("ready", 120, stalled)
        crew.go.set()
        msgs = crew.expect("held", max(600.0, k * plan.timeout / plan.procs), stalled)
        out["held"] = sum(m[1] for m in msgs if m and m[0] == "held")
        out["while_held"] = _state(nodes)
        out["per_name"] = per_item(before, out["while_held"], out["held"])
        for _, pipe, _ in crew.procs:
            with contextlib.suppress(OSError):
                pipe.send(("release",))
        reports = crew.finish(120)
    finally:
        crew.stop.set()
        crew.go.set()
    out["after_release"] = _state(nodes)
    out["released"] = per_item(before, out["after_release"], out.get("held", 0))
    out["workers"] = summarize_workers(reports, 0.0)
    log(f"  held {out['held']:,}: per name {out['per_name']}")
    return out


def _redis(names: list[str], plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    from .peers import servers

    with servers.running({"redis"}, log) as srv:
        if "redis" not in srv.urls:
            return {"error": srv.missing.get("redis", "redis did not start")}
        import redis

        client = redis.Redis.from_url(srv.urls["redis"])
        before = int(client.dbsize())
        out = _phase("redis", srv.urls["redis"], names, plan, lambda: False, log)
        out["keys_before"], out["keys_after"] = before, int(client.dbsize())
        out["version"] = srv.versions.get("Redis")
        out["used_memory_after"] = int(client.info("memory")["used_memory"])
        client.close()
    return out


# ----------------------------------------------------------------------------- run


def _library() -> dict[str, Any]:
    import amqp_locks

    here = Path(amqp_locks.__file__).resolve().parent
    repo = here.parent.parent
    git = ["git", "-C", str(repo)]

    def out(*args: str) -> str:
        return subprocess.run(
            [*git, *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    return {
        "amqp_locks_path": str(here),
        "amqp_locks_git": out("rev-parse", "--short", "HEAD"),
        # The last commit that changed the library itself (HEAD may only add benchmarks).
        "amqp_locks_src_commit": out("log", "-1", "--format=%h", "--", str(here)),
        "amqp_locks_dirty": bool(out("status", "--porcelain", "--", str(here))),
    }


@contextlib.contextmanager
def _nofile(limit: int | None) -> Any:
    """The soft open-files limit the node we start inherits (``--nofile``)."""
    if limit is None:
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def run(
    plan: Plan, line: str, url: str | None, log: Callable[[str], None] = _log
) -> dict[str, Any]:
    """Start the private node(s) (unless ``url``), measure, stop them; the results."""
    from amqp_locks_dev import devbroker, devcluster

    results: dict[str, Any] = {"plan": asdict(plan)}
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        # Other work on the machine shares the CPUs with clients and broker: say how much.
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        **_library(),
    }
    results["environment"] = env
    base = Path(tempfile.mkdtemp(prefix="amqp-locks-names-"))
    nodes: list[_Node] = []
    stop_nodes: Callable[[], Any] | None = None
    try:
        if url is None:
            with _nofile(plan.nofile):
                if plan.cluster:
                    log(f"starting a private 3-node {line} cluster {DEFAULT_NODE}")
                    cl = devcluster.start(DEFAULT_NODE, 3, base_dir=base, version=line)
                    url, infos = cl.url, list(cl.nodes)
                    stop_nodes = lambda: devcluster.stop(  # noqa: E731
                        DEFAULT_NODE, base_dir=base, version=line
                    )
                else:
                    log(f"starting private RabbitMQ {line} node {DEFAULT_NODE}")
                    if plan.broker_conf:
                        (base / "node").mkdir(parents=True)
                        conf = "".join(f"{c}\n" for c in plan.broker_conf)
                        (base / "node" / devbroker.EXTRA_CONFIG).write_text(conf)
                    info = devbroker.start(DEFAULT_NODE, base_dir=base / "node", version=line)
                    url, infos = info.url, [info]
                    stop_nodes = lambda: devbroker.stop(  # noqa: E731
                        DEFAULT_NODE, base / "node", version=line
                    )
            for info in infos:
                pid = None
                with contextlib.suppress(OSError, ValueError):
                    pid = int(info.pid_file.read_text().strip())
                nodes.append(_Node(info, pid))
            results["node_limits"] = nodes[0].limits()
            results["node_pids"] = [n.pid for n in nodes]
            log(f"  node limits: {results['node_limits']}")
        else:
            plan.prefix = f"{plan.prefix}-{uuid.uuid4().hex[:6]}"  # new names on a used broker
        env["broker"] = _broker_version(url, line, plan.cluster)
        results.update(_measure(plan, url, nodes, log))
        env["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        if any(n.pid for n in nodes) and results.get("stalled"):
            from amqp_locks_dev.localserver import signal_and_wait

            for n in nodes:  # a node that stopped answering: by its PID, no graceful stop
                if n.pid:
                    log(f"killing node {n.info.node} (PID {n.pid}): it stopped answering")
                    signal_and_wait(n.pid, signal.SIGKILL, 10.0, tree=False)
        if stop_nodes is not None:
            log("stopping the private node(s)")
            with contextlib.suppress(Exception):
                stop_nodes()
        shutil.rmtree(base, ignore_errors=True)
    return results


def _broker_version(url: str, line: str, cluster: bool) -> str:
    import asyncio

    import aiormq

    async def props() -> str:
        conn = await aiormq.connect(url.split(",")[0])
        try:
            v = conn.server_properties.get("version", b"")
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            await conn.close()

    try:
        version = asyncio.run(props())
    except Exception as exc:
        version = f"? ({_what(exc)})"
    return f"RabbitMQ {version}" + (" (3-node cluster)" if cluster else " (one node)")


def _prepare_fences(url: str, plan: Plan, log: Callable[[str], None]) -> int | None:
    """The fixed set of shared fence shards, made before the start state is read, so that
    the start already holds what no number of names adds to (a library with per-name
    fences has no ``prepare_fences``: None)."""
    import amqp_locks

    prepare = getattr(amqp_locks, "prepare_fences", None)
    if prepare is None:
        return None
    with amqp_locks.Broker(url) as b:
        made = len(prepare(b))
    log(f"  fence shards prepared ({made} made now)")
    return made


def _measure(
    plan: Plan, url: str, nodes: list[_Node], log: Callable[[str], None]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = [f"{plan.prefix}-{i}" for i in range(plan.names)]
    poll = _StatusPoll(nodes, plan)
    states: dict[str, Any] = {}
    out["states"] = states
    out["fences_prepared"] = _prepare_fences(url, plan, log)
    if nodes:
        states["start"] = _state(nodes)
        log(f"  start: {states['start']}")
        # Where the memory is before the run, to set beside the end's (below).
        out["memory_breakdown_start"] = [_breakdown(n) for n in nodes]
        poll.start()
    stalled = poll.stalled.is_set
    try:
        log(f"amqp-locks: {plan.names:,} names, {plan.procs} processes")
        out["amqp"] = _phase("amqp", url, names, plan, stalled, log)
        log(f"  {_brief(out['amqp'])}")
        if stalled():
            out["stalled"] = (
                f"`rabbitmqctl status` failed {plan.stall_after} times in a row from "
                f"{poll.stalled_at}; run stopped after {out['amqp']['names_done']:,} names"
            )
            log(f"  STALLED: {out['stalled']}")
        if nodes:
            states["after_release"] = _state(nodes)
            log(f"  after the last release: {states['after_release']}")
        if nodes and not stalled():
            t0, watch = time.monotonic(), list[dict[str, Any]]()
            states["watch"] = watch
            while time.monotonic() - t0 < plan.watch_s and not stalled():
                if settled(states["start"], watch[-1] if watch else states["after_release"]):
                    break
                time.sleep(plan.watch_every)
                watch.append(_state(nodes, t0))
                log(f"  +{watch[-1]['t_s']} s: {watch[-1]}")
            last = watch[-1] if watch else states["after_release"]
            out["settled"] = settled(states["start"], last)
            # Where the memory is at the end of the watch (rabbit_vm's categories, bytes):
            # what did not come back, if anything.
            out["memory_breakdown"] = [_breakdown(n) for n in nodes]
            if plan.hold and not stalled():
                log(f"holding {plan.hold:,} names at once")
                out["hold"] = _hold(url, nodes, plan, stalled, log)
        if plan.redis:
            log(f"Redis: {plan.names:,} names, {plan.procs} processes")
            out["redis"] = _redis(names, plan, log)
            log(f"  {_brief(out['redis'])}")
    finally:
        poll.done.set()
        if poll.is_alive():
            poll.join(plan.status_timeout + 5)
    out["status_poll"] = poll.summary()
    if stalled() and "stalled" not in out:
        out["stalled"] = f"`rabbitmqctl status` stopped answering from {poll.stalled_at}"
    return out


def _brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    f = r["first_use"]
    return (
        f"{r['names_done']:,} names in {r['wall_s']} s ({r['names_per_s']}/s), first use "
        f"p50 {f['p50_ms']} ms p95 {f['p95_ms']} ms, warm p50 {r['warm']['p50_ms']} ms, "
        f"{r['timeouts']} timeouts, {r['failures']} failures {r['errors'] or ''}"
    )


def default_out(line: str, cluster: bool, url: str | None) -> Path:
    tag = "url" if url else f"{line}{'-cluster' if cluster else ''}"
    return RESULTS / f"names-{tag}.json"


def write(results: dict[str, Any], out: Path) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    md = table(results)
    out.with_suffix(".md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    from amqp_locks_dev import devbroker

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.names",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--names", type=int, default=2000, help="distinct names (%(default)s)")
    add("--procs", type=int, default=8, help="processes, one Broker each (%(default)s)")
    add(
        "--rabbitmq",
        choices=devbroker.VERSIONS,
        help="private node's line (default: $AMQP_LOCKS_RABBITMQ, else 3.10; --cluster: 4.3)",
    )
    add("--cluster", action="store_true", help="a private 3-node cluster (4.3 unless given)")
    add("--url", help="an existing broker (no broker state, no status polls)")
    add("--hold", type=int, default=1000, help="names held at once for memory per name")
    add("--timeout", type=float, default=30.0, help="acquire(timeout=) in s (%(default)s)")
    add("--warm", type=int, default=100, help="re-acquired names per process (%(default)s)")
    add("--watch", type=float, default=120.0, help="s to watch the state after the release")
    add("--status-every", type=float, default=5.0, help="s between status polls")
    add("--nofile", type=int, help="the node's open-files limit (soft; e.g. 1024 as via su)")
    add(
        "--broker-conf",
        action="append",
        default=[],
        metavar="LINE",
        help="a rabbitmq.conf line for the private node (one node; repeatable), e.g. "
        "'raft.wal_max_size_bytes = 16777216'",
    )
    add("--no-redis", action="store_true", help="skip the Redis comparison")
    add("--out", type=Path, help="results JSON (default benchmarks/results/names-LINE.json)")
    add("--quick", action="store_true", help="smoke run: 200 names, 2 procs, hold 100")
    add("--render", type=Path, metavar="JSON", help="only re-write JSON's markdown table")
    args = parser.parse_args(argv)
    if args.render:
        print(write(json.loads(args.render.read_text()), args.render))
        return 0
    line = args.rabbitmq or ("4.3" if args.cluster else devbroker.default_version())
    plan = Plan(
        names=args.names,
        procs=args.procs,
        timeout=args.timeout,
        warm=args.warm,
        hold=args.hold,
        watch_s=args.watch,
        status_every=args.status_every,
        redis=not args.no_redis,
        cluster=args.cluster,
        nofile=args.nofile,
        broker_conf=args.broker_conf,
    )
    if args.quick:
        plan.names, plan.procs, plan.hold, plan.warm, plan.watch_s = 200, 2, 100, 20, 20.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(plan, line, args.url)
    argv_ = sys.argv[1:] if argv is None else argv
    results["environment"]["command"] = shlex.join(["python", "-m", "benchmarks.names", *argv_])
    if os.environ.get("PYTHONPATH"):
        results["environment"]["pythonpath"] = os.environ["PYTHONPATH"]
    out = args.out or default_out(line, args.cluster, args.url)
    md = write(results, out)
    print(md)
    _log(f"wrote {out} and {out.with_suffix('.md')}")
    return 1 if results.get("stalled") else 0


if __name__ == "__main__":
    sys.exit(main())
