"""A contended handoff across processes, as the spans record it: the picture of
docs/observability.md, and the runs tests/test_otel_handoff.py checks.

Each process (``python -m benchmarks.otel_timeline child ...``) instruments amqp-locks
with the SDK's in-memory span exporter, takes one lock inside a span of its own
(``job``), says ``HELD``, works ``--work`` seconds, releases when told and, once told to
exit, writes its finished spans as JSON. :func:`contend` drives them: the first holds
while the others queue up, then each release hands the lock to the next. :func:`check`
reads the links (each acquire after the first links the previous holder's hold span) and
that no two holds overlap; :func:`render` draws the timeline.

Regenerate the picture (a private broker, or any ``AMQP_URL``):
``python -m benchmarks.otel_timeline --write-docs`` (``--url``, default ``$AMQP_URL``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "observability.md"
BEGIN, END = "<!-- handoff-timeline:begin -->", "<!-- handoff-timeline:end -->"
#: Columns of the timeline's bars.
WIDTH = 48


# --- the child ---------------------------------------------------------------------------


def _record(span: Any) -> dict[str, Any]:
    ctx = span.context
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent": None if span.parent is None else f"{span.parent.span_id:016x}",
        "start": span.start_time,
        "end": span.end_time,
        "attributes": dict(span.attributes or {}),
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
    }


def _say_attempts() -> None:
    """Print ``TRIED`` after each attempt of a waiting mutex or semaphore
    (``waiting._attempt``): the driver releases only once a waiter's attempt after it
    subscribed has failed, so the release's notice is what wakes it."""
    from amqp_locks import waiting

    attempt = waiting._attempt

    async def said(coro: Any) -> Any:
        try:
            return await attempt(coro)
        finally:
            print("TRIED", flush=True)

    waiting._attempt = said  # type: ignore[assignment]


def child(args: argparse.Namespace) -> None:
    """One contender (see the module docstring). Without ``--instrument`` it never
    imports OpenTelemetry; its last line says whether anything did."""
    from amqp_locks import Backoff, Broker, Mutex, TokenSemaphore

    exporter = provider = None
    if args.instrument:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        from amqp_locks.otel import AmqpLocksInstrumentor

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        AmqpLocksInstrumentor().instrument(tracer_provider=provider)
    _say_attempts()
    with Broker(args.url, cluster=args.cluster) as broker:
        # A waiting mutex re-checks the lock every second besides waiting for the release's
        # notice; a re-check landing between one holder's release and the notified
        # waiter's attempt would take the lock unlinked (allowed: a mutex is not fair),
        # and the picture is of handoffs. So the re-checks are 30 s apart here.
        recheck = Backoff(initial=30, maximum=30)
        lock: Any = (
            Mutex(broker, args.name, backoff=recheck)
            if args.kind == "mutex"
            else TokenSemaphore(broker, args.name)
        )
        job = (
            provider.get_tracer("app").start_as_current_span("job")
            if provider is not None
            else contextlib.nullcontext()
        )
        with job:
            lease = lock.acquire()
            print("HELD", lease.fencing_token, flush=True)
            time.sleep(args.work)  # the job's work while it holds the lock
            sys.stdin.readline()  # "release"
            lease.release(wait=True)
        print("RELEASED", flush=True)
        sys.stdin.readline()  # "exit": after the next holder has it
    spans = [] if exporter is None else [_record(s) for s in exporter.get_finished_spans()]
    Path(args.out).write_text(json.dumps(spans))
    print("DONE", "opentelemetry" in sys.modules, flush=True)


# --- the driver --------------------------------------------------------------------------


@dataclass
class Contender:
    """One child process and what it said."""

    index: int
    instrumented: bool
    out: Path
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    #: Attempts it has made (``TRIED`` lines: a mutex or semaphore waiter's).
    tried: int = 0
    spans: list[dict[str, Any]] = field(default_factory=list)
    imported_otel: bool | None = None

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout: float) -> list[str]:
        try:
            line = self.lines.get(timeout=timeout).split()
        except queue.Empty:
            raise AssertionError(f"contender {self.index} did not say {word}") from None
        assert line[:1] == [word], (self.index, line)
        return line


def _spawn(index: int, args: list[str], instrumented: bool, tmp: Path) -> Contender:
    out = tmp / f"spans-{index}.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.otel_timeline", "child", *args, "--out", str(out)]
        + (["--instrument"] if instrumented else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    c = Contender(index, instrumented, out, proc)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("TRIED"):
                c.tried += 1
            else:
                c.lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return c


def _wait_for_waiters(
    url: str, name: str, kind: str, cluster: bool, waiters: list[Contender]
) -> None:
    """Until `waiters` wait: consumers of the mutex's wake-up queue (one node), each
    having made its attempt after subscribing (``TRIED`` twice), or consumers of the
    token queue less its holder (polled: no event says so)."""
    from amqp_locks import Broker
    from amqp_locks.names import quorum_mutex_name, token_queue, wakeup_queue

    if kind == "mutex" and not cluster:
        q, holders = wakeup_queue(name, "mutex"), 0
    else:
        q = token_queue(quorum_mutex_name(name) if kind == "mutex" else name)
        holders = 1

    with Broker(url, cluster=cluster) as b:

        async def waiting() -> int:
            session = await b.core.session()
            try:
                return (await session.declare_passive_counts(q))[1] - holders
            except Exception:  # not declared yet: nobody waits
                return 0

        deadline = time.monotonic() + 60
        n = len(waiters)
        notices = kind == "mutex" and not cluster

        def ready() -> bool:
            if notices and any(c.tried < 2 for c in waiters):
                return False
            return b.core.run(waiting()) >= n

        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"{n} contenders never queued up for {name!r}")
            time.sleep(0.02)


def contend(
    url: str,
    name: str,
    kind: str,
    *,
    cluster: bool = False,
    instrumented: Sequence[bool] = (True, True, True),
    together: bool = True,
    work: float = 0.2,
    timeout: float = 60.0,
) -> list[Contender]:
    """Run one contender per entry of `instrumented` on lock `name` ("mutex" or "token":
    a classic one-permit token semaphore on one node, set up here). The first holds while
    the others queue (all at once when `together`, else each after the previous one
    holds); each release hands the lock on. Returns them in the order they held it."""
    from amqp_locks import Broker, TokenAdmin

    if kind == "token":
        with Broker(url, cluster=cluster) as b:
            TokenAdmin(b, name).setup(1)
    base = ["--url", url, "--name", name, "--kind", kind, "--work", str(work)]
    base += ["--cluster"] if cluster else []
    with tempfile.TemporaryDirectory() as tmp:
        started: list[Contender] = []
        try:
            first = _spawn(0, base, instrumented[0], Path(tmp))
            started.append(first)
            first.expect("HELD", timeout)
            order = [first]
            rest = range(1, len(instrumented))
            if together:
                started += [_spawn(i, base, instrumented[i], Path(tmp)) for i in rest]
                _wait_for_waiters(url, name, kind, cluster, started[1:])
            for _ in rest:
                if not together:
                    started.append(
                        _spawn(len(started), base, instrumented[len(started)], Path(tmp))
                    )
                    _wait_for_waiters(url, name, kind, cluster, started[-1:])
                holder = order[-1]
                holder.say("release")
                holder.expect("RELEASED", timeout)
                order.append(_next_holder(started, order, timeout))
            order[-1].say("release")
            order[-1].expect("RELEASED", timeout)
            for c in order:
                c.say("exit")
                c.imported_otel = c.expect("DONE", timeout)[1] == "True"
                c.proc.wait(timeout)
                c.spans = json.loads(c.out.read_text())
            return order
        finally:
            for c in started:
                if c.proc.poll() is None:
                    c.proc.kill()
                    c.proc.wait(30)


def _next_holder(started: list[Contender], order: list[Contender], timeout: float) -> Contender:
    """The contender that says HELD next (the others must stay silent meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in started:
            if c in order:
                continue
            with contextlib.suppress(queue.Empty):
                line = c.lines.get(timeout=0.01).split()
                assert line[:1] == ["HELD"], (c.index, line)
                return c
    raise AssertionError("nobody got the lock after the release")


# --- reading the spans -------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the timeline: process label (P1 = first holder), span name, start and
    end (ns, absolute) and the row it links ("" for none)."""

    process: str
    span: str
    start: int
    end: int
    link: str


def _one(spans: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"].startswith(prefix)]
    assert len(found) == 1, [s["name"] for s in spans]
    return found[0]


def check(order: list[Contender], *, linked: Sequence[bool]) -> list[Row]:
    """Check the recorded spans: each instrumented holder has one granted acquire span
    and one released hold span; `linked[i]` says whether holder i's acquire links holder
    i-1's hold span (else it links nothing: never a wrong link); holds never overlap.
    Returns the timeline's rows, holder by holder."""
    rows: list[Row] = []
    holds: list[dict[str, Any] | None] = []
    for i, c in enumerate(order):
        label = f"P{i + 1}"
        if not c.instrumented:
            assert c.spans == [] and not c.imported_otel
            holds.append(None)
            continue
        job, acquire, hold = (_one(c.spans, p) for p in ("job", "acquire ", "hold "))
        assert acquire["attributes"]["amqp_locks.outcome"] == "granted"
        assert hold["attributes"]["amqp_locks.hold.end"] == "released"
        assert acquire["parent"] == hold["parent"] == job["span_id"]
        previous = holds[-1] if holds else None
        if linked[i]:
            assert previous is not None
            assert [(x["trace_id"], x["span_id"]) for x in acquire["links"]] == [
                (previous["trace_id"], previous["span_id"])
            ], (label, acquire["links"])
        else:
            assert acquire["links"] == [], (label, acquire["links"])
        holds.append(hold)
        link = f"{f'P{i}'} {previous['name']}" if linked[i] and previous is not None else ""
        rows.append(Row(label, job["name"], job["start"], job["end"], ""))
        rows.append(Row(label, acquire["name"], acquire["start"], acquire["end"], link))
        rows.append(Row(label, hold["name"], hold["start"], hold["end"], ""))
    spans = [h for h in holds if h is not None]
    for a, b in itertools.pairwise(spans):
        assert a["end"] <= b["start"], "two holds overlap"
    return rows


def render(rows: list[Row], width: int = WIDTH) -> str:
    """The timeline as text: one bar per span on a common axis (0 = the first start),
    scaled to `width` columns; the link column names the row an acquire links."""
    t0 = min(r.start for r in rows)
    total = max(r.end for r in rows) - t0 or 1
    label = max(len(f"{r.process} {r.span}") for r in rows)
    scale = f"0 ms{'':>{width - 4 - len(str(round(total / 1e6)))}}{round(total / 1e6)} ms"
    lines = [f"{'':<{label}}  {scale}"]
    for r in rows:
        a = min(width - 1, int((r.start - t0) * width / total))
        b = max(a + 1, min(width, round((r.end - t0) * width / total)))
        bar = "." * a + "#" * (b - a) + "." * (width - b)
        tail = f" links {r.link}" if r.link else ""
        lines.append(f"{f'{r.process} {r.span}':<{label}} |{bar}|{tail}")
    return "\n".join(lines)


_ROW = re.compile(r"^(P\d+ [^|]*?)\s*\|[.#]+\|(?: links (.*))?$")


def structure(picture: str) -> list[tuple[str, str]]:
    """What must stay true of a picture whatever the timings: its rows, in order, and
    the links (the bars and the scale are left out)."""
    out = []
    for line in picture.splitlines():
        m = _ROW.match(line)
        if m:
            out.append((m[1], m[2] or ""))
    return out


def documented(doc: Path = DOC) -> str:
    """The picture in docs/observability.md (between its markers)."""
    text = doc.read_text()
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return body.strip().removeprefix("```text").removesuffix("```").strip("\n")


def write_docs(picture: str, doc: Path = DOC) -> None:
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{BEGIN}\n```text\n{picture}\n```\n{END}{tail}")


def picture(url: str) -> str:
    """Three processes contending one mutex (one node), rendered."""
    order = contend(url, f"timeline-{uuid.uuid4().hex[:8]}", "mutex")
    return render(check(order, linked=(False, True, True)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("child")
    c.add_argument("--url", required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--kind", choices=("mutex", "token"), required=True)
    c.add_argument("--cluster", action="store_true")
    c.add_argument("--instrument", action="store_true")
    c.add_argument("--work", type=float, default=0.2)
    c.add_argument("--out", required=True)
    parser.add_argument("--url", default=os.environ.get("AMQP_URL"))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "child":
        child(args)
        return
    if not args.url:
        parser.error("--url or AMQP_URL is needed")
    drawn = picture(args.url)
    print(drawn)
    if args.write_docs:
        write_docs(drawn)


if __name__ == "__main__":
    main()
