"""The data of the comparison with the peer libraries and of the scale run: tables,
verdicts on the targets, figures for the template.

Like ``report.py`` this only reads the results JSON. Ratios are ours / best peer for
times (above 1: we are slower) and ours / best peer for throughput (below 1: we do less).
"""

from __future__ import annotations

import math
from typing import Any

from .peers.kinds import KINDS
from .tables import Table, ms, num, times


def label(kind: str) -> str:
    k = KINDS.get(kind)
    return kind if k is None else (f"**{k.label}**" if k.ours else k.label)


def plain(kind: str) -> str:
    k = KINDS.get(kind)
    return kind if k is None else k.label


def ok(s: dict[str, Any] | None) -> bool:
    return s is not None and "error" not in s and s.get("n", 1) > 0


# ------------------------------------------------------------------------ metrics


def _uc(p: dict[str, Any]) -> dict[str, float]:
    """Uncontended acquire+release cycle p50 per kind."""
    return {k: s["cycle"]["p50_ms"] for k, s in p.get("uncontended", {}).items() if ok(s)}


def _ho(p: dict[str, Any], n: str) -> dict[str, float]:
    return {k: c[n]["p50_ms"] for k, c in p.get("handoff", {}).items() if n in c and ok(c[n])}


def _tp(p: dict[str, Any], slots: str) -> dict[str, float]:
    return {
        k: s["grants_per_s"]
        for k, s in p.get("throughput", {}).get(slots, {}).items()
        if "error" not in s
    }


def _cr(p: dict[str, Any], group: str) -> dict[str, float]:
    """Crash p50 per kind; inf when the lock never came free (no expiry)."""
    out: dict[str, float] = {}
    for k, groups in p.get("crash", {}).get("rows", {}).items():
        s = groups.get(group) or (groups.get("default") if KINDS[k].tuned is None else None)
        if not s or "error" in s:
            continue
        out[k] = math.inf if s.get("censored") else s["p50_ms"]
    return out


def _split(values: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    ours = {k: v for k, v in values.items() if KINDS[k].ours}
    return ours, {k: v for k, v in values.items() if not KINDS[k].ours}


def _best(values: dict[str, float], high: bool = False) -> tuple[str, float] | None:
    vals = [(k, v) for k, v in values.items() if not math.isnan(v)]
    if not vals:
        return None
    return max(vals, key=lambda kv: kv[1]) if high else min(vals, key=lambda kv: kv[1])


def _peers_best(values: dict[str, float], high: bool = False) -> tuple[str, float] | None:
    return _best(_split(values)[1], high)


# ------------------------------------------------------------------------- tables


def versions_table(r: dict[str, Any]) -> Table:
    p = r["peers"]
    servers = {
        "amqp": f"RabbitMQ {r['environment']['rabbitmq']['version']}",
        "redis": f"Redis {p['servers'].get('Redis', '?')}",
        "zookeeper": f"ZooKeeper {p['servers'].get('ZooKeeper', '?')}",
        "postgresql": "PostgreSQL (devdb)",
        None: "local files",
    }
    rows = []
    for k in p.get("kinds", []):
        kind = KINDS[k]
        tuned = (
            "as default"
            if kind.tuned is None
            else ", ".join(f"{a}={v}" for a, v in kind.tuned.items())
        )
        default = ", ".join(f"{a}={v}" for a, v in kind.default.items()) or "(none)"
        rows.append(
            [
                label(k),
                p["libraries"].get(k, "?"),
                servers[kind.server],
                kind.wait,
                kind.crash,
                f"`{default}`",
                f"`{tuned}`" if kind.tuned else tuned,
            ]
        )
    header = [
        "lock",
        "version",
        "server",
        "a blocked acquire learns the lock is free",
        "a crashed holder's lock is freed by",
        "default settings",
        "tuned settings",
    ]
    return Table(header, rows)


def uncontended_table(r: dict[str, Any]) -> Table:
    p, rtt = r["peers"], r["floors"]["broker_round_trip"]["p50_ms"]
    best = _peers_best(_uc(p))

    def row(name: str, s: dict[str, Any], vs_best: str) -> list[str]:
        a = s["acquire"]
        return [
            name,
            ms(a["p50_ms"]),
            ms(a["p99_ms"]),
            ms(s["release"]["p50_ms"]),
            ms(s["cycle"]["p50_ms"]),
            f"{a['p50_ms'] / rtt:.1f}x",
            vs_best,
        ]

    rows = [
        row(label(k), s, times(s["cycle"]["p50_ms"], best[1]) if best else "n/a")
        if ok(s)
        else [label(k), "error", "", "", "", "", ""]
        for k, s in p.get("uncontended", {}).items()
    ]
    rows += [
        row(f"locker: {name} (`start()` / `stop()`)", s, "")
        for name, s in p.get("lockers", {}).items()
        if ok(s)
    ]
    best_txt = f"best peer: {plain(best[0])}" if best else "best peer"
    header = ["lock", "acquire p50 ms", "acquire p99 ms", "release p50 ms", "cycle p50 ms"]
    return Table([*header, "acquire / RTT", f"cycle / {best_txt}"], rows)


def handoff_table(r: dict[str, Any]) -> Table:
    p = r["peers"]
    ns = [str(n) for n in p["plan"]["waiters"]]
    bests = {n: _peers_best(_ho(p, n)) for n in ns}
    rows = []
    for k, cells in p.get("handoff", {}).items():
        row = [label(k)]
        for n in ns:
            s, b = cells.get(n), bests[n]
            if s is None or not ok(s):
                row.append("error")
                continue
            ratio = f" ({times(s['p50_ms'], b[1])})" if KINDS[k].ours and b else ""
            row.append(f"{ms(s['p50_ms'])} / {ms(s['p99_ms'])}{ratio}")
        rows.append(row)
    rows.append(
        ["best peer"] + [f"{plain(b[0])}: {ms(b[1])}" if b else "n/a" for b in bests.values()]
    )
    return Table(["lock"] + [f"{n} waiters: p50 / p99 ms (ours / best peer)" for n in ns], rows)


def throughput_table(r: dict[str, Any]) -> Table:
    p = r["peers"]
    tp = p.get("throughput", {})
    bests = {s: _peers_best(_tp(p, s), high=True) for s in tp}
    rows = []
    for k in dict.fromkeys(k for s in tp for k in tp[s]):
        row = [label(k)]
        for s in tp:
            c, b = tp[s].get(k), bests[s]
            if c is None:
                row += ["-", "-"]
            elif "error" in c:
                row += ["error", ""]
            else:
                f = c["fairness"]
                ratio = f" ({c['grants_per_s'] / b[1]:.2g}x)" if KINDS[k].ours and b else ""
                row += [
                    f"{c['grants_per_s']:,.0f}{ratio}",
                    f"{num(f['jain'])} / {num(f['cv'])} / {f['min']}-{f['max']}",
                ]
        rows.append(row)
    header = ["lock"]
    for s in tp:
        recipe = " (locks-only peers: N locks)" if s != "1" else ""
        header += [f"{s} slot(s){recipe}: grants/s (ours / best peer)", "Jain / CV / min-max"]
    return Table(header, rows)


def _crash_cell(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    if "error" in s:
        return "error"
    if s.get("censored"):
        return f"never (still held after {s['cap_s']:.0f} s)"
    return f"{ms(s['p50_ms'])} / {ms(s['max_ms'])}"


def crash_table(r: dict[str, Any]) -> Table:
    rows = []
    for k, groups in r["peers"].get("crash", {}).get("rows", {}).items():
        d, t = groups.get("default"), groups.get("tuned")
        tuned = "as default" if KINDS[k].tuned is None and t is None else _crash_cell(t)
        n = "/".join(str(g.get("n", 0)) for g in (d, t) if g)
        rows.append([label(k), _crash_cell(d), tuned, n])
    return Table(["lock", "default settings: p50 / max ms", "tuned: p50 / max ms", "n"], rows)


# ---------------------------------------------------------------------- verdicts


def headline_table(r: dict[str, Any]) -> Table:
    """One row per metric: our best primitive, the best peer, the ratio, win or loss."""
    p = r["peers"]
    rows: list[list[str]] = []

    def add(metric: str, values: dict[str, float], high: bool = False) -> None:
        ours, peers = _split(values)
        bo, bp = _best(ours, high), _best(peers, high)
        if not bo or not bp:
            return
        fmt = (lambda v: f"{v:,.0f}") if high else ms
        if high:
            ratio = f"{bo[1] / bp[1]:.2f}x"
        else:
            ratio = "n/a" if math.isinf(bp[1]) else times(bo[1], bp[1])
        win = bo[1] >= bp[1] if high else bo[1] <= bp[1]
        best_ours, best_peer = f"{plain(bo[0])}: {fmt(bo[1])}", f"{plain(bp[0])}: {fmt(bp[1])}"
        rows.append([metric, best_ours, best_peer, ratio, "**win**" if win else "loss"])

    add("uncontended acquire + release (p50 ms)", _uc(p))
    for n in (str(n) for n in p["plan"]["waiters"]):
        add(f"handoff, {n} waiters (p50 ms)", _ho(p, n))
    for s in p.get("throughput", {}):
        add(f"throughput, {p['plan']['processes']} processes / {s} slot(s)", _tp(p, s), True)
    for g in ("default", "tuned"):
        vals = _cr(p, g)
        if vals:
            add(f"crash: kill -9 -> waiter holds, {g} settings (p50 ms)", vals)
    return Table(["metric", "ours (best primitive)", "best peer", "ours / best peer", ""], rows)


def pollers_verdict(r: dict[str, Any]) -> tuple[bool | None, Table | None]:
    """Target: handoff and crash failover >= 10x faster than every polling peer (defaults).

    The verdict (None: not measured) and a table of factors (peer time / our time) per
    metric, our lock and polling peer.
    """
    p = r["peers"]
    pollers = [k for k in p.get("kinds", []) if KINDS[k].polls]
    checks = [(f"handoff, {n} waiters", _ho(p, str(n))) for n in p["plan"]["waiters"]]
    if _cr(p, "default"):
        checks.append(("crash, default settings", _cr(p, "default")))
    rows: list[list[str]] = []
    met_all = True
    for metric, vals in checks:
        for ours in (k for k in vals if KINDS[k].ours):
            row = [metric, f"{plain(ours)} ({ms(vals[ours])} ms)"]
            for peer in pollers:
                if peer not in vals:
                    row.append("n/a")
                    continue
                factor = vals[peer] / vals[ours] if vals[ours] else math.inf
                met_all &= factor >= 10
                shown = "never frees" if math.isinf(factor) else f"{factor:.1f}x"
                row.append(f"**{shown}**" if factor >= 10 else shown)
            rows.append(row)
    if not rows:
        return None, None
    return met_all, Table(["metric", "ours"] + [f"vs {plain(k)}" for k in pollers], rows)


def targets(r: dict[str, Any]) -> dict[str, Any]:
    """The comparison's three targets: pollers (verdict, table), token acquire, search."""
    rtt = r["floors"]["broker_round_trip"]["p50_ms"]
    met, table = pollers_verdict(r)
    out: dict[str, Any] = {"pollers": met, "pollers_table": table, "rtt": rtt}
    out.update(token=None, search=None)
    tok = r["peers"].get("uncontended", {}).get("ours_token")
    if tok is not None and ok(tok):
        p50 = tok["acquire"]["p50_ms"]
        out["token"] = {"p50": p50, "x": p50 / rtt, "met": p50 / rtt <= 3}
    rows = r.get("search", [])
    c1 = next((s for s in rows if s["capacity"] == 1), None)
    big = [s for s in rows if s["capacity"] == max((s["capacity"] for s in rows), default=0)]
    if c1 and big:
        parts = [(s["free_slot"], s["p50_ms"], s["p50_ms"] / c1["p50_ms"]) for s in big]
        out["search"] = {
            "capacity": big[0]["capacity"],
            "c1": c1["p50_ms"],
            "parts": parts,
            "met": all(x <= 3 for *_, x in parts),
        }
    return out


# --------------------------------------------------------------------------- scale


def scale_table(r: dict[str, Any]) -> Table:
    rows = []
    for row in r.get("scale", {}).get("rows", []):
        b = row.get("broker", {})
        mem = b.get("memory", {})
        q = b.get("queues", {})
        rows.append(
            [
                f"{row['locks']:,}",
                str(row["connections"]),
                ms(row["acquire"]["p50_ms"]),
                ms(row["acquire"]["p99_ms"]),
                num(mem.get("total", math.nan) / 2**20, 0, True) if mem else "n/a",
                num((b.get("beam_rss") or math.nan) / 2**20, 0, True),
                f"{sum(x['queues'] for x in q.values()):,}" if q else "n/a",
                f"{b.get('erlang_processes', 0):,}" if b else "n/a",
                str(b.get("fds_used", "n/a")),
                num(row.get("place_s"), 1, True),
            ]
        )
    header = ["live locks", "connections", "acquire p50 ms", "acquire p99 ms"]
    header += ["broker memory MiB (Erlang)", "broker RSS MiB", "queues", "Erlang processes"]
    return Table([*header, "file descriptors", "placed in s"], rows)


def scale(r: dict[str, Any]) -> dict[str, Any]:
    """The scale run's figures: per-lock slopes (KiB), the idle connection, the fence queue."""
    sc = r.get("scale", {})
    sl, ex = sc.get("slopes", {}), sc.get("extras", {})
    rows = sc.get("rows", [])
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    conn, fence = ex.get("connections", {}), ex.get("fence_queues", {})

    def kib(d: dict[str, Any], key: str) -> float:
        return float(d.get(key, math.nan)) / 1024

    return {
        "table": scale_table(r),
        "bytes_lock": kib(sl, "bytes_total"),
        "rss_lock": kib(sl, "bytes_rss"),
        "queue_bytes": kib(sl, "queue_bytes_each"),
        "queues_each": sl.get("queues_each"),
        "procs_each": sl.get("erlang_processes_each"),
        "categories": list(sl.get("bytes_by_category", {}).items())[:6],
        "conn_bytes": kib(conn, "bytes_each"),
        "conn_binary": kib(conn, "binary_bytes_each"),
        "conn_rss": kib(conn, "rss_bytes_each"),
        "conn_procs": conn.get("erlang_processes_each"),
        "fence_quorum": kib(fence, "quorum_bytes_each"),
        "fence_bytes": kib(fence, "bytes_each_total"),
        "fence_queue_bytes": kib(fence, "bytes_each_queue"),
        "fence_procs": fence.get("erlang_processes_each"),
        "fence_first_ms": fence.get("first_acquire_ms"),
        "min": first.get("locks", 0),
        "max": last.get("locks", 0),
        "acq_min": first.get("acquire", {}).get("p50_ms", math.nan),
        "acq_max": last.get("acquire", {}).get("p50_ms", math.nan),
        "per_connection": sc.get("per_connection", "n/a"),
        "wall": sc.get("wall_s"),
    }


def context(r: dict[str, Any]) -> dict[str, Any] | None:
    """The comparison's tables, verdicts and plan for the template (None: not measured)."""
    if "peers" not in r:
        return None
    p = r["peers"]
    return {
        "p": p,
        "plan": p["plan"],
        "versions": versions_table(r),
        "headline": headline_table(r),
        "targets": targets(r),
        "uncontended": uncontended_table(r),
        "handoff": handoff_table(r),
        "throughput": throughput_table(r),
        "crash": crash_table(r),
        "crash_wall": p.get("crash", {}).get("wall_s"),
    }
