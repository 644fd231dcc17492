"""The one benchmark runner: ``python -m benchmarks.run [SCENARIO]`` against private
servers on loopback (scenarios, options and outputs: benchmarks/README.md).

``report`` (the default; ``scripts/bench``) measures every figure of docs/benchmarks.md
into a results JSON, then renders the report from it; ``--render-only JSON`` only renders.
``targets`` measures only what the floor/target ratios need, ``--runs`` times, and prints
each target's range over the runs (docs/benchmarks.md, "Issue 37's targets over three runs").
The others feed docs/celery.md (``celery-overhead``), docs/observability.md
(``otel-overhead``), docs/cluster.md (``cluster``, ``election``) and
docs/benchmarks.md's profiles (``profile-acquire``, ``profile-handoff``); ``names`` runs
benchmarks/names.py (per-entity lock names, issue 30) with its defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import amqp_locks
from amqp_locks_dev import devbroker, epmd
from benchmarks import compare, contention, failover, floors, handoff, latency, report, scale
from benchmarks.stats import Budget, brief, own_cpu, process_cpu, summarize_reps, system_busy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: The report's private node, one per checkout: Erlang node names are machine-wide, and two
#: checkouts benchmarking at once on one machine stopped each other's node.
NODE = f"amqplocksbench-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:6]}"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _config(quick: bool) -> dict[str, Any]:
    """Sample counts and time caps: full stays near 20 min on 2 cores (the comparison with
    the peers is most of it), quick under 3 min: every lock and measurement once, with few
    samples (it checks the harness); tuned failover settings only, SQLite for the databases."""

    def q(smoke: Any, full: Any) -> Any:
        return smoke if quick else full

    return {
        "loopback": q((300, 2), (2000, 5)),
        "broker_rtt": q((200, 2), (1000, 5)),
        "raw_floors": q((100, 2), (500, 5)),
        "primitives": q((20, 2), (100, 3)),
        "uncontended": q(Budget(2, 30, 0.75), Budget(5, 200, 1.5)),
        "capacities": q([1, 10, 100], [1, 10, 100, 1000]),
        # A worst-case acquire at C=1000 takes about a second: fewer, longer repetitions.
        "sweep": lambda c, slot: q(
            Budget(2, 15, 0.4, warmup=1),
            Budget(5, 200, 1.5, warmup=2) if slot < 1000 else Budget(3, 8, 6.0, warmup=1),
        ),
        "contention": contention.Plan(q(8, 16), 4, q(1.5, 10.0), 0.0, q(5.0, 15.0)),
        "contention_runs": q(1, 2),
        "handoff": handoff.Plan(
            *q((2, 6, 2), (3, 25, 3)), 0.05, q(2, 8), *q((2, 4, 1), (3, 34, 3)), q(1.0, 10.0)
        ),
        # A failover with ActiveMQ's defaults takes 5-20 s: 3 samples; tuned ones ~1 s: 10.
        "failover_samples": q({"tuned": 2}, {"tuned": 10, "default": 3}),
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
        "compare_uncontended": q(Budget(1, 10, 0.3, warmup=2), Budget(3, 200, 1.0)),
        "scale_sizes": q([1, 100], [1, 10, 100, 1000, 10000]),
        "scale_budget": q(Budget(1, 10, 0.3, warmup=2), Budget(3, 40, 1.0, warmup=3)),
        "scale_extras": q({"connections": 3, "fenced": 3}, {"connections": 50, "fenced": 100}),
    }


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def _environment(url: str, command: str) -> dict[str, Any]:
    def proc(path: str, key: str) -> str:
        lines = Path(path).read_text().splitlines()
        return next((x.split(":", 1)[1].strip() for x in lines if x.startswith(key)), "")

    async def server_properties() -> dict[str, Any]:  # RabbitMQ's own account of itself
        async with floors.connections(url, 1, "environment") as (conn,):
            return dict(conn.server_properties)

    props = asyncio.run(server_properties())
    text = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in props.items()}
    here = Path(amqp_locks.__file__).resolve().parent
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "nproc": os.cpu_count(),
        "cpu_model": proc("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "ram_gib": round(int(proc("/proc/meminfo", "MemTotal:").split()[0]) / 1024 / 1024, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "aiormq": compare.version("aiormq"),
        "pamqp": compare.version("pamqp"),
        "amqp_locks": compare.version("amqp-locks"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--", "src")),
        "amqp_locks_path": str(here),
        "amqp_locks_from_repo": here == ROOT / "src" / "amqp_locks",
        "rabbitmq": {k: text.get(k, "") for k in ("product", "version", "platform")},
    }


def measure(
    url: str, pid_file: Path | None, quick: bool, command: str, node: Any
) -> dict[str, Any]:
    cfg, broker_pid = _config(quick), None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        broker_pid = int(pid_file.read_text().strip())  # type: ignore[union-attr]
    pids, ours = {"client": os.getpid(), "broker": broker_pid}, {"amqp": url}
    results: dict[str, Any] = {"quick": quick, "environment": _environment(url, command)}
    started, busy0 = time.monotonic(), system_busy()
    own0, beam0 = own_cpu(), process_cpu(broker_pid)

    def figures(key: str) -> None:
        for label, s in results[key].items():
            if isinstance(s, dict) and (line := brief(s)):
                _log(f"  {label}: {line}")

    _log("floors: loopback TCP, broker round trip, raw aiormq; the steps of an acquire")
    results["floors"] = {
        "loopback_tcp": summarize_reps(floors.loopback_rtt(*cfg["loopback"])),
        "broker_round_trip": summarize_reps(floors.broker_rtt(url, *cfg["broker_rtt"])),
        **floors.raw_floors(url, *cfg["raw_floors"]),
    }
    results["primitives"] = floors.primitives(url, *cfg["primitives"])
    _log("uncontended acquire/release (semaphore C=1, mutex, token semaphores)")
    kinds = ["semaphore", "mutex", "token", "token_nofence", "token_quorum"]
    uc = compare.uncontended(kinds, ours, cfg["uncontended"], pids)
    results["uncontended"] = {"semaphore_c1": uc.pop("semaphore"), "mutex": uc.pop("mutex")}
    results["uncontended_tokens"] = uc
    _log("acquire latency vs number of slots (all but one held)")
    results["search"] = latency.search_sweep(url, cfg["capacities"], cfg["sweep"], broker_pid, _log)
    plan, hplan = cfg["contention"], cfg["handoff"]
    _log(f"contention: {plan}, {cfg['contention_runs']} run(s)")
    runs = [contention.run_once(url, plan, broker_pid) for _ in range(cfg["contention_runs"])]
    results["contention"] = contention.summarize(runs, plan)
    results["handoff_plan"] = dataclasses.asdict(hplan)
    for key in ("floors", "primitives", "uncontended", "uncontended_tokens", "contention"):
        figures(key)
    for key in ("handoff", "crash", "reask", "fairness"):  # of our one-permit locks
        _log(f"{key}: one permit, between processes")
        results[key] = getattr(handoff, key)(url, hplan)
        figures(key)
    results["failover"] = failover.run(url, cfg["failover_samples"], not quick, _log)
    results["peers"] = compare.run(url, cfg["compare"], cfg["compare_uncontended"], _log)
    _log("scale: acquire latency and broker memory vs distinct live locks")
    t0, sizes, budget = time.monotonic(), cfg["scale_sizes"], cfg["scale_budget"]
    extras = cfg["scale_extras"]
    results["scale"] = scale.live_locks(url, node, broker_pid, sizes, budget, extras, _log)
    results["scale"]["wall_s"] = round(time.monotonic() - t0, 1)
    for row in report.target_rows(results):
        verdict = {True: "met", False: "NOT met", None: "-"}[row["met"]]
        _log(f"  target {row['label']}: ratio {row['ratio']} ({row['target']}) {verdict}")
    results["problems"] = problems(results)
    wall = time.monotonic() - started
    ours_cpu = (own_cpu() - own0) + (process_cpu(broker_pid) - beam0)
    env = results["environment"]
    env["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    env["duration_s"] = round(wall, 1)
    # Cores kept busy by other work on the machine meanwhile (not this run, not the broker).
    env["other_load_cores"] = round(max(0.0, (system_busy() - busy0) - ours_cpu) / wall, 2)
    env["own_load_cores"] = round(ours_cpu / wall, 2)
    return results


def problems(results: dict[str, Any]) -> list[str]:
    """What broke, anywhere in the results: a measurement or peer adapter that failed (its
    ``error`` or ``errors``), a server that did not start, two holders of one lock at once.
    A smoke run fails on any of these."""
    missing = results.get("peers", {}).get("missing_servers", {}).items()
    out = [f"server {k} did not start: {why.splitlines()[0][:200]}" for k, why in missing]

    def walk(x: Any, where: str) -> None:
        for v in x if isinstance(x, list) else ():
            walk(v, where)
        if not isinstance(x, dict):
            return
        where = f"{where} {x.get('locker', '')}".strip()
        errors = [x["error"]] if isinstance(x.get("error"), str) else []
        out.extend(f"{where}: {e}" for e in errors + list(x.get("errors") or []))
        if x.get("overlaps"):
            out.append(f"{where}: {x['overlaps']} overlapping grants")
        if x.get("max_concurrent", 0) > x.get("slots", 1):
            out.append(f"{where}: {x['max_concurrent']} held at once")
        for k, v in x.items():
            walk(v, f"{where} {k}".strip())

    walk(results, "")
    return out + ([] if results.get("scale", {}).get("rows") else ["scale: nothing measured"])


def _rel(path: Path) -> str:
    """``path`` relative to the repository when inside it (for the report)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _line(results: dict[str, Any]) -> str:
    """The RabbitMQ line ("3.10", "4.0") a results file was measured on."""
    env = results.get("environment", {})
    version = ".".join(env.get("rabbitmq", {}).get("version", "").split(".")[:2])
    return str(env.get("rabbitmq_line") or version or devbroker.HOST_VERSION)


def _default_paths(quick: bool, line: str) -> tuple[Path, Path, Path]:
    """Results, report and plots of a run on RabbitMQ ``line``. The host's line (3.10)
    owns docs/benchmarks.md; another line's full report goes under benchmarks/results/."""
    host = line == devbroker.HOST_VERSION
    if quick:
        q, sfx = RESULTS / "quick", "" if host else f"-{line}"
        return q / f"results{sfx}.json", q / f"benchmarks{sfx}.md", q / f"img{sfx}"
    if host:
        return RESULTS / "latest.json", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "img"
    sub = RESULTS / f"rabbitmq-{line}"
    return RESULTS / f"latest-{line}.json", sub / "benchmarks.md", sub / "img"


def _also(args: argparse.Namespace, line: str, own: Path) -> list[dict[str, Any]]:
    """Results of the other RabbitMQ lines whose floors/targets table the report shows too:
    ``--also`` files, else the other lines' default results files that exist."""
    others = [v for v in devbroker.VERSIONS if v != line]
    paths = args.also or [_default_paths(args.quick, v)[0] for v in others]
    out = []
    for p in paths:
        if p.name != "none" and p.exists() and p.resolve() != own.resolve():
            out.append({**json.loads(p.read_text()), "json_path": _rel(p)})
    return out


def render(
    results: dict[str, Any], doc: Path, img_dir: Path, also: list[dict[str, Any]] | None = None
) -> None:
    """The report pipeline: the plots (``plots.py``) into ``img_dir``, then the template
    filled from ``report.context`` into ``doc``; ``also``: other RabbitMQ lines' results."""
    # Not at the top: every worker process imports this module (matplotlib costs each ~1 s).
    from benchmarks import plots

    doc.parent.mkdir(parents=True, exist_ok=True)
    plots.render(results, also or [], img_dir)
    ctx = report.context(results, also or [], Path(os.path.relpath(img_dir, doc.parent)).as_posix())
    doc.write_text(report.environment().get_template("benchmarks.md.j2").render(ctx))


def _write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)
    _log(f"wrote {path}")


def _with_broker(args: argparse.Namespace, body: Callable[[str, Any], None]) -> None:
    """Run ``body(url, node)`` against ``--url`` (node None) or our private node of
    ``--rabbitmq`` (stopped after unless it was running)."""
    if args.url:
        return body(args.url, None)
    name, line = args.node, args.rabbitmq
    was_running = devbroker.status(name=name, version=line) is not None
    _log(f"{'using running' if was_running else 'starting'} private RabbitMQ {line} node {name!r}")
    mappers = epmd.running()  # our node may boot its line's epmd: that one goes too
    info = devbroker.start(name=name, version=line)
    try:
        body(info.url, info)
    finally:
        if not was_running:
            _log(f"stopping private node {name!r}")
            devbroker.stop(name=name, version=line)
            if name == NODE:
                # Its name follows the checkout's path, so every clone made a new data
                # folder in the cache that nothing removed (twenty after a day of CI).
                shutil.rmtree(devbroker.node_dir(name, version=line), ignore_errors=True)
            for port in epmd.sweep(keep=mappers):
                _log(f"stopped the epmd our node started on port {port}")


def _report(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Every measurement of docs/benchmarks.md, then the report (or only the report)."""
    if args.render_only:
        results = json.loads(args.render_only.read_text())
        line = _line(results)
        # A smoke run's results render into quick/, never over docs/benchmarks.md.
        args.quick = args.quick or bool(results.get("quick"))
        _, doc, img_dir = _default_paths(args.quick, line)
        doc, img_dir = args.doc or doc, args.img_dir or img_dir
        render(results, doc, img_dir, _also(args, line, args.render_only))
        _log(f"rendered {doc} and plots in {img_dir}")
        return 0
    json_path, doc, img_dir = _default_paths(args.quick, args.rabbitmq)
    json_path, doc, img_dir = args.json or json_path, args.doc or doc, args.img_dir or img_dir
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "benchmarks.run", *argv])
    if os.environ.get("PYTHONPATH"):  # e.g. measuring a snapshot of the library
        command = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} {command}"
    failed: list[str] = []

    def body(url: str, node: Any) -> None:
        results = measure(url, node and node.pid_file, args.quick, command, node)
        # The line asked for; with --url, the one the broker reports.
        results["environment"]["rabbitmq_line"] = args.rabbitmq if node else _line(results)
        results["json_path"] = _rel(json_path)
        _write_json(json_path, results)
        render(results, doc, img_dir, _also(args, args.rabbitmq, json_path))
        _log(f"wrote {doc} and plots in {img_dir}")
        failed.extend(results["problems"])

    _with_broker(args, body)
    for p in failed:
        _log(f"PROBLEM: {p}")
    return 1 if failed else 0


def _scenario(args: argparse.Namespace, _: Any) -> int:
    """The scenarios besides the report, each quoted in its doc (see the module docstring)."""
    if args.scenario == "celery-overhead":  # on the private node, with a private Redis
        from benchmarks import celery_overhead

        def celery(url: str, _: Any) -> None:
            result = celery_overhead.run(
                url, args.rabbitmq, args.calls or 200, args.warmup, args.burst
            )
            _write_json(args.json or RESULTS / "celery-overhead.json", result)
            print(celery_overhead.table(result))
            print()
            print(celery_overhead.enqueue_table(result))

        _with_broker(args, celery)
        return 0
    if args.scenario == "otel-overhead":  # on the private node (benchmarks/otel_overhead.py)
        from benchmarks import otel_overhead

        def otel(url: str, _: Any) -> None:
            blocks = 3 if args.quick else (args.calls or 30)
            result = otel_overhead.run(url, args.rabbitmq, blocks)
            _write_json(args.json or RESULTS / "otel-overhead.json", result)
            print(otel_overhead.table(result))

        _with_broker(args, otel)
        return 0
    if args.scenario == "names":  # its own private node(s) and Redis (benchmarks/names.py)
        from benchmarks import names

        forward = ["--quick"] if args.quick else []
        forward += ["--url", args.url] if args.url else []
        forward += ["--rabbitmq", args.rabbitmq_given] if args.rabbitmq_given else []
        forward += ["--out", str(args.json)] if args.json else []
        return names.main(forward)
    if args.scenario == "targets":  # issue 37's floor table, its spread over --runs runs
        from benchmarks import targets

        cfg = _config(args.quick)

        def measure_targets(url: str, node: Any) -> None:
            pid = None
            with contextlib.suppress(OSError, ValueError, AttributeError):
                pid = int(node.pid_file.read_text().strip())
            env = _environment(url, shlex.join(["python", "-m", "benchmarks.run", *sys.argv[1:]]))
            runs = []
            for i in range(args.runs):
                _log(f"run {i + 1} of {args.runs}")
                runs.append(targets.measure_once(url, cfg, pid, _log))
            env["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            line = args.rabbitmq if node else env["rabbitmq"]["version"]
            out = {"environment": env, "runs": runs, "rows": targets.rows(runs)}
            _write_json(args.json or RESULTS / f"targets-{line}.json", out)
            print(targets.table(runs))

        _with_broker(args, measure_targets)
        return 0
    if args.scenario == "election":  # private nodes of --rabbitmq (default 4.3)
        from benchmarks import leader_election

        version = args.rabbitmq_given or "4.3"
        results = leader_election.run(version, args.runs, _log)
        _write_json(args.json or RESULTS / f"election-{version}.json", results)
        print(f"no leader for {results['min']}-{results['max']} s ({args.runs} trials)")
        print(f"load average at the end: {results['load'][0]:.2f}")
        return 0
    if args.scenario == "cluster":  # private nodes of --rabbitmq (default 4.3)
        from benchmarks import cluster

        version = args.rabbitmq_given or "4.3"
        results = cluster.run(version, *((12, 1) if args.quick else (100, 3)), _log)
        _write_json(args.json or RESULTS / f"cluster-{version}.json", results)
        print(cluster.table(results))
        print()
        print(cluster.target_table(results))
        return 0
    from benchmarks import profile

    def body(url: str, _: Any) -> None:
        if args.scenario == "profile-acquire":
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


SCENARIOS = (
    "report",
    "targets",
    "celery-overhead",
    "otel-overhead",
    "cluster",
    "election",
    "names",
    "profile-acquire",
    "profile-handoff",
)


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
    lines = "default: $AMQP_LOCKS_RABBITMQ, else 3.10; cluster: 4.3"
    add("--rabbitmq", choices=devbroker.VERSIONS, help=f"private node's line ({lines})")
    also = "another line's results file whose floors/targets table to show too (or none)"
    add("--also", type=Path, action="append", metavar="JSON", help=also)
    add(
        "--calls",
        type=int,
        help="celery-overhead: measured calls per variant (200); "
        "otel-overhead: blocks of 100 cycles per variant (30)",
    )
    add("--warmup", type=int, default=20, help="celery-overhead: unmeasured calls per variant")
    add("--burst", type=int, default=300, help="celery-overhead: calls per enqueue burst")
    add("-n", type=int, help="profile-*: samples (acquire 1000, handoff 200)")
    add("--settle", type=float, default=0.05, help="profile-handoff: the waiter's head start")
    runs = "targets: runs whose spread the table shows; election: trials (3)"
    add("--runs", type=int, default=3, help=runs)
    args = parser.parse_args(argv)
    args.rabbitmq_given = args.rabbitmq
    args.rabbitmq = devbroker.check_version(args.rabbitmq or devbroker.default_version())
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every server we started stops.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # aiormq warns when a channel close is cut short by a connection close; harmless here.
    logging.getLogger("aiormq.channel").setLevel(logging.ERROR)
    return (_report if args.scenario == "report" else _scenario)(args, argv)


if __name__ == "__main__":
    sys.exit(main())
