"""The one benchmark runner: named scenarios against private servers on loopback.

    python -m benchmarks.run            # scenario `report` (~20 min): every measurement of
                                        # docs/benchmarks.md into benchmarks/results/latest.json,
                                        # then the report (docs/benchmarks.md, docs/img/)
    python -m benchmarks.run --quick    # smoke run (<3 min) into benchmarks/results/quick/
    python -m benchmarks.run --render-only benchmarks/results/latest.json
    python -m benchmarks.run --rabbitmq 4.0   # on a private RabbitMQ 4.0 node:
                                        # benchmarks/results/latest-4.0.json and
                                        # benchmarks/results/rabbitmq-4.0/benchmarks.md
    python -m benchmarks.run celery-overhead [--calls 200]  # docs/celery.md
    python -m benchmarks.run cluster [--rabbitmq 4.3]        # docs/cluster.md (3-node cluster)
    python -m benchmarks.run cluster-failover [--trials 3]   # 3-node cluster: node loss
    python -m benchmarks.run profile-acquire [-n 1000]       # docs/benchmarks.md's profiles
    python -m benchmarks.run profile-handoff [-n 200] [--settle 0.05]

The report's node (``amqplocksbench-<checkout hash>``, separate from the tests'
``amqplockstest``) is started by the run and stopped at the end unless it was already
running; ``--url`` uses another broker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import amqp_locks
from amqp_locks import Broker
from amqp_locks_dev import devbroker, devdb
from benchmarks import compare, contention, failover, floors, handoff, latency, report, scale
from benchmarks.latency import Budget
from benchmarks.peers import servers as peer_servers
from benchmarks.peers.kinds import KINDS, available
from benchmarks.stats import (
    beam_pid,
    forkserver_cpu,
    own_cpu,
    process_cpu,
    summarize_reps,
    system_busy,
)

ROOT = Path(__file__).resolve().parent.parent
#: The report's private node, one per checkout: Erlang node names are machine-wide, and two
#: checkouts benchmarking at once on one machine stopped each other's node.
NODE = f"amqplocksbench-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:6]}"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _log_cycles(cells: dict[str, Any]) -> None:
    for label, s in cells.items():
        acq, rel = s["acquire"]["p50_ms"], s["release"]["p50_ms"]
        _log(f"  {label}: acquire p50={acq:.2f} ms release p50={rel:.2f} ms")


# --------------------------------------------------------------------------- config


def _config(quick: bool) -> dict[str, Any]:
    """Sample counts and time caps: full stays near 20 min on 2 cores (the comparison with
    the peers is most of it), quick under 3 min: every lock and measurement once, with few
    samples (it checks the harness); tuned failover settings only, SQLite for the databases."""

    def q(smoke: Any, full: Any) -> Any:
        return smoke if quick else full

    hl = handoff.HeadlinePlan(q(2, 3), q(4, 34), q(1, 3), 0.05, fair_seconds=q(1.0, 10.0))
    uc = q(
        Budget(reps=2, max_samples=30, seconds=0.75), Budget(reps=5, max_samples=200, seconds=1.5)
    )
    return {
        "loopback": q((300, 2), (2000, 5)),
        "broker_rtt": q((200, 2), (1000, 5)),
        "raw_floors": q((100, 2), (500, 5)),
        "headline": hl,
        "primitives": q((20, 2), (100, 3)),
        "uncontended": uc,
        "capacities": q([1, 10, 100], [1, 10, 100, 1000]),
        # A worst-case acquire at C=1000 takes about a second: fewer, longer repetitions.
        "sweep": lambda c, slot: q(
            Budget(reps=2, max_samples=15, seconds=0.4, warmup=1),
            Budget(reps=5, max_samples=200, seconds=1.5, warmup=2)
            if slot < 1000
            else Budget(reps=3, max_samples=8, seconds=6.0, warmup=1),
        ),
        "contention": contention.Plan(q(8, 16), 4, q(1.5, 10.0), 0.0, q(5.0, 15.0)),
        "contention_runs": q(1, 2),
        "handoff": handoff.Plan(q(2, 3), q(6, 25), q(2, 3), 0.05, q(2, 8)),
        # A failover with ActiveMQ's defaults takes 5-20 s: 3 samples; tuned ones ~1 s: 10.
        "failover_samples": q({"tuned": 2}, {"tuned": 10, "default": 3}),
        "db_servers": not quick,
        "compare": compare.Plan(
            waiters=q((2,), (2, 8, 32)),
            handoff_samples=q(3, 25),
            handoff_hold=q((0.01, 0.03), (0.01, 0.11)),
            handoff_seconds=q(10.0, 20.0),
            processes=q(3, 16),
            slot_counts=(1, 4),
            seconds=q(0.3, 4.0),
            crash_groups=q({"tuned": 1}, {"default": 3, "tuned": 5}),
            crash_settle=q((0.1, 0.4), (0.2, 1.2)),
        ),
        "compare_uncontended": q(
            Budget(reps=1, max_samples=10, seconds=0.3, warmup=2),
            Budget(reps=3, max_samples=200, seconds=1.0),
        ),
        "scale_sizes": q([1, 100], [1, 10, 100, 1000, 10000]),
        "scale_budget": q(
            Budget(reps=1, max_samples=10, seconds=0.3, warmup=2),
            Budget(reps=3, max_samples=40, seconds=1.0, warmup=3),
        ),
        "scale_extras": q({"connections": 3, "fenced": 3}, {"connections": 50, "fenced": 100}),
    }


# ---------------------------------------------------------------------- environment


def _proc_info(path: str, key: str) -> str | None:
    """The value of the first ``key:`` line of a /proc file (None if absent)."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return None


def _cpu_model() -> str:
    return _proc_info("/proc/cpuinfo", "model name") or platform.processor() or "unknown"


def _ram_gib() -> float:
    total = _proc_info("/proc/meminfo", "MemTotal:")
    return round(int(total.split()[0]) / 1024 / 1024, 1) if total else float("nan")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
        return out.stdout.strip()
    except OSError:
        return ""


def _server_properties(url: str) -> dict[str, str]:
    """RabbitMQ's own account of itself, from the connection handshake."""
    with Broker(url) as broker:
        core = broker._core
        session = core.run(core.session())
        props = session.conn.server_properties if session.conn is not None else {}

    def text(key: str) -> str:
        value = props.get(key, "")
        return value.decode() if isinstance(value, bytes) else str(value)

    return {"product": text("product"), "version": text("version"), "platform": text("platform")}


def _environment(url: str, command: str) -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "kernel": f"{platform.system()} {platform.release()}",
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "aiormq": _version("aiormq"),
        "pamqp": _version("pamqp"),
        "amqp_locks": _version("amqp-locks"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--", "src")),
        "amqp_locks_path": str(Path(amqp_locks.__file__).resolve().parent),
        "amqp_locks_from_repo": Path(amqp_locks.__file__).resolve().parent
        == ROOT / "src" / "amqp_locks",
        "rabbitmq": _server_properties(url),
    }


# ----------------------------------------------------------------------------- run


def measure(
    url: str, pid_file: Path | None, quick: bool, command: str, node: devbroker.NodeInfo | None
) -> dict[str, Any]:
    cfg = _config(quick)
    broker_pid = beam_pid(pid_file)
    results: dict[str, Any] = {"quick": quick, "environment": _environment(url, command)}
    started = time.monotonic()
    busy0, own0, beam0 = system_busy(), own_cpu(), process_cpu(broker_pid)

    _log("floors: loopback TCP and broker round trips")
    loop = summarize_reps(floors.loopback_rtt(*cfg["loopback"]))
    rtt = summarize_reps(floors.broker_rtt(url, *cfg["broker_rtt"]))
    results["floors"] = {"loopback_tcp": loop, "broker_round_trip": rtt}
    rtt_ms = rtt["p50_ms"]
    _log(f"  loopback p50={loop['p50_ms']:.3f} ms, broker p50={rtt_ms:.3f} ms")
    _log("floors: raw aiormq (basic.get, reject -> deliver, exclusive declare / delete)")
    for key, raw in floors.raw_floors(url, *cfg["raw_floors"]).items():
        s = summarize_reps(raw["reps"])
        s["label"] = floors.RAW[key]
        if "misses" in raw:
            s["misses"] = raw["misses"]
        results["floors"][key] = s
        _log(f"  {key}: p50={s['p50_ms']:.3f} ms p99={s['p99_ms']:.3f} ms")

    _log("primitive steps of an acquire")
    results["primitives"] = floors.primitives(url, *cfg["primitives"], rtt_ms)
    for label, s in results["primitives"].items():
        _log(f"  {label}: p50={s['p50_ms']:.3f} ms")

    _log("uncontended acquire/release (semaphore C=1, mutex)")
    pids = {"client": os.getpid(), "broker": broker_pid}
    results["uncontended"] = latency.uncontended(url, cfg["uncontended"], rtt_ms, pids)
    _log_cycles(results["uncontended"])

    _log("acquire latency vs number of slots (all but one held)")
    results["search_holders"] = latency.HOLDERS_KIND
    results["search"] = latency.search_sweep(
        url, cfg["capacities"], cfg["sweep"], broker_pid, rtt_ms, _log
    )

    plan: contention.Plan = cfg["contention"]
    runs = []
    for i in range(cfg["contention_runs"]):
        _log(f"contention run {i + 1}/{cfg['contention_runs']}: {plan}")
        runs.append(contention.run_once(url, plan, broker_pid))
    results["contention"] = contention.summarize(runs, plan)
    c = results["contention"]
    for err in c["worker_errors"]:
        _log(f"  WORKER ERROR: {err}")
    for msg, n in c["worker_warnings"].items():
        _log(f"  library warning x{n}: {msg}")
    _log(
        f"  {c['acquisitions_per_s']:.0f} acquisitions/s, handoff p50="
        f"{c['handoff']['p50_ms']:.2f} ms p99={c['handoff']['p99_ms']:.2f} ms"
    )

    _log("token semaphore: uncontended acquire/release (classic and quorum token queue)")
    results["uncontended_tokens"] = handoff.uncontended_tokens(
        url, cfg["uncontended"], rtt_ms, pids
    )
    _log_cycles(results["uncontended_tokens"])
    hplan: handoff.Plan = cfg["handoff"]
    _log("handoff release -> blocked waiter in another process (one permit)")
    results["handoff_plan"] = dataclasses.asdict(hplan)
    results["handoff"] = handoff.handoff(url, hplan, rtt_ms, _log)
    _log("crash: kill -9 of the holder -> blocked waiter acquires")
    results["crash"] = handoff.crash(url, hplan, _log)
    hl: handoff.HeadlinePlan = cfg["headline"]
    results["headline_plan"] = dataclasses.asdict(hl)
    _log("handoff with the releaser asking again at once (one permit, two processes)")
    results["reask"] = handoff.reask(url, hl, _log)
    _log(
        f"fairness loop: {hl.fair_processes} processes, acquire -> hold "
        f"{hl.fair_hold * 1000:.0f} ms -> release, {hl.fair_seconds:g} s per primitive"
    )
    results["fairness"] = contention.fairness(url, hl, _log)

    results["failover"] = _failover(url, cfg)

    results["peers"] = _peers(url, cfg, rtt_ms)
    _log("scale: acquire latency and broker memory vs distinct live locks")
    t0 = time.monotonic()
    results["scale"] = scale.live_locks(
        url, node, broker_pid, cfg["scale_sizes"], cfg["scale_budget"], cfg["scale_extras"], _log
    )
    results["scale"]["wall_s"] = round(time.monotonic() - t0, 1)
    results["targets"] = report.target_rows(results)
    for row in results["targets"]:
        verdict = {True: "met", False: "NOT met", None: "-"}[row["met"]]
        _log(f"  target {row['label']}: ratio {row['ratio']} ({row['target']}) {verdict}")
    results["problems"] = problems(results)

    wall = time.monotonic() - started
    ours = (own_cpu() - own0) + (process_cpu(broker_pid) - beam0) + forkserver_cpu()
    env = results["environment"]
    env["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    env["duration_s"] = round(wall, 1)
    # Cores kept busy by other work on the machine meanwhile (not this run, not the broker).
    env["other_load_cores"] = round(max(0.0, (system_busy() - busy0) - ours) / wall, 2)
    env["own_load_cores"] = round(ours / wall, 2)
    return results


def _failover(url: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Locker failover with tuned (and in full runs ActiveMQ's default) settings, on a
    shared file, SQLite and (full runs) private PostgreSQL and MariaDB servers."""
    tmp = Path(tempfile.mkdtemp(prefix="amqp-locks-bench-"))
    dbs: dict[str, str] = {}
    started: list[tuple[str, Path]] = []
    notes: list[str] = []
    groups: dict[str, list[failover.Spec]] = {}
    busy0, own0, fs0, t0 = system_busy(), own_cpu(), forkserver_cpu(), time.monotonic()
    try:
        if cfg["db_servers"]:
            for kind, label in (("postgresql", "PostgreSQL"), ("mariadb", "MariaDB")):
                base = devdb.db_fixture_base() / kind
                try:
                    _log(f"starting private {kind} server")
                    info = devdb.start(kind, name="bench", base_dir=base)
                    started.append((kind, base))
                    dbs[label] = info.url
                except Exception as exc:  # no server binaries: say so, measure the rest
                    notes.append(f"{label} not measured: {exc}")
                    _log(f"  {label} not measured: {exc}")
        else:
            notes.append("smoke run: no PostgreSQL/MariaDB servers, no default-settings failover")
        groups = {
            group: failover.specs(
                failover.TUNED if group == "tuned" else failover.DEFAULT,
                group,
                str(tmp / "files"),
                str(tmp),
                dbs,
                url,
            )
            for group in cfg["failover_samples"]
        }
        _log(f"failover per locker ({', '.join(groups)} settings), all concurrently")
        measured = failover.measure(groups, cfg["failover_samples"], _log)
    finally:
        # AmqpLocker's mutex leaves its fence queue (and nothing else) on the broker.
        names = {sp.name for g in groups.values() for sp in g if sp.kind == "amqp"}
        with contextlib.suppress(Exception), Broker(url) as broker:
            latency._delete_queues(broker, [q for n in names for q in (n, f"{n}-fence")])
        for kind, base in started:
            with contextlib.suppress(Exception):
                devdb.stop(kind, name="bench", base_dir=base)
            shutil.rmtree(base.parent, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - t0
    return {
        "groups": measured["groups"],
        "wall_s": measured["wall_s"],
        "settings": {"tuned": failover.TUNED, "default": failover.DEFAULT},
        "databases": sorted(dbs),
        "notes": notes,
        # Cores kept busy meanwhile by everything (this phase's processes included).
        "busy_cores": round((system_busy() - busy0) / wall, 2),
        "own_cores": round((own_cpu() - own0 + forkserver_cpu() - fs0) / wall, 2),
    }


def _peers(url: str, cfg: dict[str, Any], rtt_ms: float) -> dict[str, Any]:
    """Ours beside the peer libraries, each against its own private server."""
    plan: compare.Plan = cfg["compare"]
    tmp = Path(tempfile.mkdtemp(prefix="amqp-locks-bench-peers-"))
    needed = {k.server for k in KINDS.values() if k.server and k.server != "amqp"}
    out: dict[str, Any] = {"plan": dataclasses.asdict(plan)}
    _log(f"peers: starting private {', '.join(sorted(needed))} servers on loopback")
    try:
        with peer_servers.running(needed, _log) as srv:
            targets = {**srv.urls, "amqp": url, "files": str(tmp / "files")}
            kinds = available(targets)
            out.update(
                servers=srv.versions,
                server_settings=srv.settings,
                missing_servers=srv.missing,
                kinds=kinds,
                libraries={k: _version(KINDS[k].library) for k in kinds},
            )
            budget = cfg["compare_uncontended"]
            lockers = lambda: _lockers(url, srv.urls.get("postgresql"), tmp)  # noqa: E731
            phases: list[tuple[str, Callable[[], Any]]] = [
                ("uncontended", lambda: compare.uncontended(kinds, targets, budget, rtt_ms, _log)),
                ("lockers", lambda: compare.uncontended_lockers(lockers(), budget, rtt_ms, _log)),
                ("handoff", lambda: compare.handoff(kinds, targets, plan, rtt_ms, _log)),
                ("throughput", lambda: compare.throughput(kinds, targets, plan, _log)),
                ("crash", lambda: compare.crash(kinds, targets, plan, _log)),
            ]
            for label, run in phases:
                _log(f"peers: {label}")
                t0 = time.monotonic()
                out[label] = run()
                out.setdefault("wall_s", {})[label] = round(time.monotonic() - t0, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _lockers(url: str, pg_url: str | None, tmp: Path) -> dict[str, Any]:
    """Our lockers, made here and measured uncontended (``start()`` / ``stop()``)."""
    from amqp_locks.lockers import AmqpLocker, DatabaseLocker, LeaseDatabaseLocker, SharedFileLocker

    name = latency.unique_name("uc-locker")
    out: dict[str, Any] = {
        "SharedFileLocker": SharedFileLocker(str(tmp / "locker"), "lock"),
        "DatabaseLocker / SQLite": DatabaseLocker(f"sqlite:///{tmp / 'db.sqlite'}", name),
        "LeaseDatabaseLocker / SQLite": LeaseDatabaseLocker(
            f"sqlite:///{tmp / 'lease.sqlite'}", name
        ),
    }
    if pg_url:
        out["DatabaseLocker / PostgreSQL"] = DatabaseLocker(pg_url, name)
        out["LeaseDatabaseLocker / PostgreSQL"] = LeaseDatabaseLocker(pg_url, name)
    broker = Broker(url, connection_name="amqp-locks bench AmqpLocker")
    locker = AmqpLocker(broker, name)
    close = locker.close

    def close_both() -> None:
        close()
        broker.close()
        with Broker(url) as b:
            latency._delete_queues(b, [name, f"{name}-fence", f"{name}-mutex-sentinels"])

    locker.close = close_both  # type: ignore[method-assign]
    out["AmqpLocker"] = locker
    return out


def problems(results: dict[str, Any]) -> list[str]:
    """What broke: a peer adapter or measurement that failed, a server that did not start,
    two holders of one lock at once. A smoke run fails on any of these."""
    out: list[str] = []
    peers = results.get("peers", {})
    for kind, why in peers.get("missing_servers", {}).items():
        out.append(f"server {kind} did not start: {why.splitlines()[0][:200]}")
    for phase in ("uncontended", "lockers"):
        for kind, s in peers.get(phase, {}).items():
            if "error" in s:
                out.append(f"{phase} {kind}: {s['error']}")
    for kind, cells in peers.get("handoff", {}).items():
        for n, s in cells.items():
            if "error" in s:
                out.append(f"handoff {kind} waiters={n}: {s['error']}")
            elif s.get("overlaps"):
                out.append(f"handoff {kind} waiters={n}: {s['overlaps']} overlapping grants")
    for slots, cells in peers.get("throughput", {}).items():
        for kind, s in cells.items():
            if "error" in s:
                out.append(f"throughput {kind} slots={slots}: {s['error']}")
            elif s["max_concurrent"] > int(slots):
                out.append(f"throughput {kind} slots={slots}: {s['max_concurrent']} held at once")
    for kind, groups in peers.get("crash", {}).get("rows", {}).items():
        for group, s in groups.items():
            for e in ([s["error"]] if "error" in s else []) + s.get("errors", []):
                out.append(f"crash {kind} {group}: {e}")
    for kind, s in results.get("fairness", {}).items():
        for e in s.get("errors", []):
            out.append(f"fairness {kind}: {e}")
    if not results.get("scale", {}).get("rows"):
        out.append("scale: nothing measured")
    return out


def _rel(path: Path) -> str:
    """``path`` relative to the repository when inside it (for the report)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _line(results: dict[str, Any]) -> str:
    """The RabbitMQ line ("3.10", "4.0") a results file was measured on."""
    env = results.get("environment", {})
    if env.get("rabbitmq_line"):
        return str(env["rabbitmq_line"])
    version = env.get("rabbitmq", {}).get("version", "")
    return ".".join(version.split(".")[:2]) or devbroker.HOST_VERSION


def _default_paths(quick: bool, line: str) -> tuple[Path, Path, Path]:
    """Results, report and plots of a run on RabbitMQ ``line``. The host's line (3.10)
    owns docs/benchmarks.md; another line's full report goes under benchmarks/results/."""
    results = ROOT / "benchmarks" / "results"
    host = line == devbroker.HOST_VERSION
    if quick:
        base = results / "quick"
        if host:
            return (base / "results.json", base / "benchmarks.md", base / "img")
        return (base / f"results-{line}.json", base / f"benchmarks-{line}.md", base / f"img-{line}")
    if host:
        return (results / "latest.json", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "img")
    sub = results / f"rabbitmq-{line}"
    return (results / f"latest-{line}.json", sub / "benchmarks.md", sub / "img")


def _paths(args: argparse.Namespace, line: str) -> tuple[Path, Path, Path]:
    defaults = _default_paths(args.quick, line)
    return (args.json or defaults[0], args.doc or defaults[1], args.img_dir or defaults[2])


def _also(args: argparse.Namespace, line: str, own: Path) -> list[dict[str, Any]]:
    """Results of the other RabbitMQ lines whose floors/targets table the report shows too:
    ``--also`` files, else the other lines' default results files that exist."""
    if args.also is not None:
        paths = [p for p in args.also if p.name != "none"]
    else:
        paths = [
            _default_paths(args.quick, other)[0] for other in devbroker.VERSIONS if other != line
        ]
        paths = [p for p in paths if p.exists()]
    out = []
    for p in paths:
        if p.resolve() == own.resolve():
            continue
        r = json.loads(p.read_text())
        r["json_path"] = _rel(p)
        out.append(r)
    return out


def _with_broker(
    args: argparse.Namespace,
    body: Callable[[str, Path | None, devbroker.NodeInfo | None], None],
) -> None:
    """Run ``body(url, pid_file, node)`` against ``--url`` or our private node (stopped after)."""
    if args.url:
        body(args.url, None, None)
        return
    line = args.rabbitmq
    was_running = devbroker.status(name=args.node, version=line) is not None
    _log(
        f"{'using running' if was_running else 'starting'} private RabbitMQ {line} node "
        f"{args.node!r}"
    )
    info = devbroker.start(name=args.node, version=line)
    try:
        body(info.url, info.pid_file, info)
    finally:
        if not was_running:
            _log(f"stopping private node {args.node!r}")
            devbroker.stop(name=args.node, version=line)


def render(
    results: dict[str, Any], doc: Path, img_dir: Path, also: list[dict[str, Any]] | None = None
) -> None:
    """The report pipeline: the plots (``plots.py``) into ``img_dir``, then the template
    filled from ``report.context`` into ``doc``; ``also``: other RabbitMQ lines' results."""
    # Not at the top: every worker process imports this module (matplotlib costs each ~1 s).
    from benchmarks import plots

    doc.parent.mkdir(parents=True, exist_ok=True)
    plots.render(results, also or [], img_dir)
    img_rel = Path(os.path.relpath(img_dir, doc.parent)).as_posix()
    ctx = report.context(results, also or [], img_rel)
    doc.write_text(report.environment().get_template("benchmarks.md.j2").render(ctx))


def _report(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Every measurement of docs/benchmarks.md, then the report (or only the report)."""
    if args.render_only:
        results = json.loads(args.render_only.read_text())
        line = _line(results)
        # A smoke run's results render into quick/, never over docs/benchmarks.md.
        args.quick = args.quick or bool(results.get("quick"))
        _, doc_path, img_dir = _paths(args, line)
        render(results, doc_path, img_dir, _also(args, line, args.render_only))
        _log(f"rendered {doc_path} and plots in {img_dir}")
        return 0
    json_path, doc_path, img_dir = _paths(args, args.rabbitmq)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "benchmarks.run", *given])
    if os.environ.get("PYTHONPATH"):  # e.g. measuring a snapshot of the library
        command = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} {command}"
    failed: list[str] = []

    def body(url: str, pid_file: Path | None, node: devbroker.NodeInfo | None) -> None:
        results = measure(url, pid_file, args.quick, command, node)
        # The line asked for; with --url, the one the broker reports.
        results["environment"]["rabbitmq_line"] = args.rabbitmq if node else _line(results)
        results["json_path"] = _rel(json_path)
        _write_json(json_path, results)
        render(results, doc_path, img_dir, _also(args, args.rabbitmq, json_path))
        _log(f"wrote {doc_path} and plots in {img_dir}")
        failed.extend(results["problems"])

    _with_broker(args, body)
    for p in failed:
        _log(f"PROBLEM: {p}")
    return 1 if failed else 0


def _write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)
    _log(f"wrote {path}")


def _celery_overhead(args: argparse.Namespace, _: Any) -> int:
    """An empty Celery task's round trip without a lock, with ``Singleton`` and with
    celery-once (docs/celery.md); its own private node and Redis."""
    from benchmarks import celery_overhead

    result = celery_overhead.run(args.calls or 200, args.warmup, args.node)
    _write_json(args.json or RESULTS / "celery-overhead.json", result)
    print(celery_overhead.table(result))
    return 0


def _cluster(args: argparse.Namespace, _: Any) -> int:
    """Cluster mode's cost beside one node (docs/cluster.md): a private single node, then
    a private 3-node cluster of ``--rabbitmq`` (default 4.3)."""
    from benchmarks import cluster

    version = args.rabbitmq_given or "4.3"
    samples, reps = (12, 1) if args.quick else (100, 3)
    results = cluster.run(version, samples, reps, _log)
    _write_json(args.json or RESULTS / f"cluster-{version}.json", results)
    print(cluster.table(results))
    return 0


def _cluster_failover(args: argparse.Namespace, _: Any) -> int:
    """Node failure in a private 3-node cluster: how fast each primitive recovers."""
    from benchmarks import cluster

    print(cluster.failover_table(args.trials))
    return 0


def _profile(which: str) -> Callable[[argparse.Namespace, Any], int]:
    def run(args: argparse.Namespace, _: Any) -> int:
        from benchmarks import profile

        def body(url: str, *_: Any) -> None:
            if which == "acquire":
                for what, p50 in profile.acquire(url, args.n or 1000).items():
                    print(f"{p50:7.3f} ms p50  {what}")
                return
            for label, stages in profile.handoff(url, args.n or 200, args.settle).items():
                print(label)
                for what, p50 in stages.items():
                    if p50 is not None:
                        print(f"  {p50:7.3f} ms p50  {what}")

        _with_broker(args, body)
        return 0

    run.__doc__ = {
        "acquire": "Where an uncontended token acquire's time goes (five ways).",
        "handoff": "Where a token handoff's time goes: stamped at every stage, beside raw aiormq.",
    }[which]
    return run


RESULTS = ROOT / "benchmarks" / "results"
SCENARIOS: dict[str, Callable[[argparse.Namespace, list[str] | None], int]] = {
    "report": _report,
    "celery-overhead": _celery_overhead,
    "cluster": _cluster,
    "cluster-failover": _cluster_failover,
    "profile-acquire": _profile("acquire"),
    "profile-handoff": _profile("handoff"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("scenario", nargs="?", default="report", choices=SCENARIOS, help="default: report")
    add("--quick", action="store_true", help="smoke run (< 3 min; cluster: few samples)")
    add("--url", help="benchmark this broker instead of a private node")
    add("--node", default=NODE, help="private node name (default: %(default)s)")
    add("--json", type=Path, help="results file")
    add("--doc", type=Path, help="markdown report")
    add("--img-dir", type=Path, help="directory for the PNG plots")
    add("--render-only", type=Path, metavar="JSON", help="re-render docs from a results file")
    add(
        "--rabbitmq",
        choices=devbroker.VERSIONS,
        help="RabbitMQ line of the private node (default: $AMQP_LOCKS_RABBITMQ, else 3.10; "
        "cluster: 4.3); for the report a line other than 3.10 writes latest-LINE.json and "
        "its report under benchmarks/results/rabbitmq-LINE/",
    )
    add(
        "--also",
        type=Path,
        action="append",
        metavar="JSON",
        help="also show the floors/targets table of this results file (another RabbitMQ "
        "line); default: the other lines' results files that exist; `--also none`: none",
    )
    add("--calls", type=int, help="celery-overhead: measured calls per variant (200)")
    add("--warmup", type=int, default=20, help="celery-overhead: unmeasured calls per variant")
    add("--trials", type=int, default=3, help="cluster-failover: trials per primitive")
    add("-n", type=int, help="profile-*: samples (acquire 1000, handoff 200)")
    add("--settle", type=float, default=0.05, help="profile-handoff: the waiter's head start")
    args = parser.parse_args(argv)
    args.rabbitmq_given = args.rabbitmq
    args.rabbitmq = devbroker.check_version(args.rabbitmq or devbroker.default_version())
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every server we started stops.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # aiormq warns when a channel close is cut short by a connection close; harmless here.
    logging.getLogger("aiormq.channel").setLevel(logging.ERROR)
    return SCENARIOS[args.scenario](args, argv)


if __name__ == "__main__":
    sys.exit(main())
