"""Every complete ```python example of README.md and docs/*.md runs, as its own program,
against the test node: a doc cannot drift from the code unnoticed.

Convention (README.md, section "Documentation"): a ```python block preceded by the line
``<!-- fragment -->`` (blank lines between allowed) is a piece of a larger program and is
not run; every other block is a complete program that reads the broker's URL from
``$AMQP_URL`` (``Broker()`` does) and, where it needs a database, from ``$DATABASE_URL``.
A ```text block right after a block (blank lines between allowed) is its exact output, a
``...`` in a line standing for any text. Each example runs in a vhost of its own, so the
names two examples share (``"images"``) never meet.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from amqp_locks_dev import devbroker, devdb

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
#: The fragments each file has, and why they cannot run: a new fragment must be added here.
FRAGMENTS = {
    # the election one-liner; docs/lockers.md has it as a complete program
    "README.md": 1,
    # the three URLs of a cluster; tests/cluster/ runs cluster mode on a real 3-node cluster
    "docs/cluster.md": 1,
    # OTLP exporters (a package the tests do not install); the cardinality switch alone
    "docs/observability.md": 2,
}
#: Seconds one example may take (each runs in a few; the bound only ends a hung one).
TIMEOUT = 60


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    code: str
    fragment: bool
    output: str | None  # the ```text block that follows, if any

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


#: An opening fence: three backticks and a language (or none), nothing else.
OPENING = re.compile(r"```[\w+-]*\s*")


def _fenced(lines: list[str], start: int) -> tuple[str, int]:
    """The text of the fenced block opening at `start`, and the index of its closing fence."""
    end = start + 1
    while end < len(lines) and lines[end].rstrip() != "```":
        end += 1
    assert end < len(lines), f"line {start + 1}: {lines[start]!r} is never closed"
    return "".join(f"{line}\n" for line in lines[start + 1 : end]), end


def _next_nonblank(lines: list[str], i: int, step: int) -> int:
    while 0 <= i < len(lines) and not lines[i].strip():
        i += step
    return i


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].rstrip() != "```python":
            if OPENING.fullmatch(lines[i]):  # another language's block: skip it whole
                i = _fenced(lines, i)[1]
            i += 1
            continue
        code, end = _fenced(lines, i)
        before = _next_nonblank(lines, i - 1, -1)
        after = _next_nonblank(lines, end + 1, 1)
        output = None
        if after < len(lines) and lines[after].rstrip() == "```text":
            output = _fenced(lines, after)[0]
        found.append(
            Block(
                path=str(path.relative_to(ROOT)),
                line=i + 1,
                code=code,
                fragment=before >= 0 and lines[before].strip() == FRAGMENT,
                output=output,
            )
        )
        i = end + 1
    return found


ALL = [block for path in DOCS for block in blocks(path)]
COMPLETE = [block for block in ALL if not block.fragment]


def _erlang_list(vhosts: list[str]) -> str:
    return "[" + ",".join(f'<<"{vhost}">>' for vhost in vhosts) + "]"


def _add_vhosts(node: devbroker.NodeInfo, vhosts: list[str]) -> None:
    """Each vhost, with every permission for guest: one ``rabbitmqctl eval`` (each call
    boots an Erlang VM, a second or more on a loaded machine), else the commands one by one."""
    who = '<<"amqp-locks tests">>'
    every = '<<".*">>, <<".*">>, <<".*">>'
    grant = f'rabbit_auth_backend_internal:set_permissions(<<"guest">>, V, {every}, {who})'
    expr = f"[begin ok = rabbit_vhost:add(V, {who}), {grant} end || V <- {_erlang_list(vhosts)}]."
    all_ok = "[" + ",".join(["ok"] * len(vhosts)) + "]"
    with contextlib.suppress(devbroker.DevBrokerError):
        if devbroker.rabbitmqctl(node, "eval", expr).split() == [all_ok]:
            return
    for vhost in vhosts:
        if vhost not in devbroker.rabbitmqctl(node, "list_vhosts").split():
            devbroker.rabbitmqctl(node, "add_vhost", vhost)
        devbroker.rabbitmqctl(node, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")


def _delete_vhosts(node: devbroker.NodeInfo, vhosts: list[str]) -> None:
    expr = f'[rabbit_vhost:delete(V, <<"amqp-locks tests">>) || V <- {_erlang_list(vhosts)}].'
    with contextlib.suppress(devbroker.DevBrokerError):
        devbroker.rabbitmqctl(node, "eval", expr)
    left = set(devbroker.rabbitmqctl(node, "list_vhosts").split()) & set(vhosts)
    for vhost in left:
        devbroker.rabbitmqctl(node, "delete_vhost", vhost)


@pytest.fixture(scope="module")
def vhost_urls(node: devbroker.NodeInfo) -> Iterator[dict[str, str]]:
    """A new vhost per example on the test node (deleted afterwards, with all it holds)."""
    vhosts = {block.id: f"doc{uuid.uuid4().hex[:8]}" for block in COMPLETE}
    _add_vhosts(node, list(vhosts.values()))
    try:
        yield {
            key: f"amqp://guest:guest@127.0.0.1:{node.amqp_port}/{vhost}"
            for key, vhost in vhosts.items()
        }
    finally:
        _delete_vhosts(node, list(vhosts.values()))


@pytest.fixture(scope="module")
def postgres() -> Iterator[devdb.DbInfo]:
    """A private PostgreSQL for the examples that need a database (started on first use)."""
    base = devdb.db_fixture_base()
    try:
        yield devdb.start("postgresql", name="docexamples", base_dir=base)
    finally:
        devdb.stop("postgresql", name="docexamples", base_dir=base)
        shutil.rmtree(base, ignore_errors=True)


def _python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _matches(expected: str, actual: str) -> bool:
    """Line by line; ``...`` in an expected line matches any text."""
    want, got = expected.rstrip("\n").splitlines(), actual.rstrip("\n").splitlines()
    return len(want) == len(got) and all(
        re.fullmatch(".*".join(re.escape(part) for part in w.split("...")), g)
        for w, g in zip(want, got, strict=True)
    )


@pytest.mark.parametrize("block", COMPLETE, ids=[block.id for block in COMPLETE])
def test_example_runs(
    block: Block, vhost_urls: dict[str, str], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": "", "AMQP_URL": vhost_urls[block.id]}
    env.pop("AMQP_LOCKS_SERVER_LEDGER", None)
    if "DATABASE_URL" in block.code:
        env["DATABASE_URL"] = request.getfixturevalue("postgres").url
    script = tmp_path / "example.py"
    script.write_text(block.code)
    proc = subprocess.run(
        [_python(), str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    if block.output is not None:
        assert _matches(block.output, proc.stdout), (
            f"{block.id} printed:\n{proc.stdout}\nthe docs say:\n{block.output}"
        )


def test_fragments_are_the_listed_ones() -> None:
    counts: dict[str, int] = {}
    for block in ALL:
        if block.fragment:
            counts[block.path] = counts.get(block.path, 0) + 1
    assert counts == FRAGMENTS


def test_every_marker_precedes_a_python_block() -> None:
    # A marker before anything else (a moved block, a typo in the fence) would be silently
    # ignored while the reader believes the block is checked, or the other way round.
    marked = {(block.path, block.line) for block in ALL if block.fragment}
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == FRAGMENT:
                opening = _next_nonblank(lines, i + 1, 1)
                where = (str(path.relative_to(ROOT)), opening + 1)
                assert where in marked, f"{where[0]}:{i + 1}: {FRAGMENT} before no ```python"


def test_the_parser_finds_the_examples() -> None:
    # The README's 30-second example is a complete program: if the parser stopped seeing
    # blocks, every test above would pass on nothing.
    readme = [block for block in COMPLETE if block.path == "README.md"]
    assert readme and "with Broker() as broker:" in readme[0].code
    assert len(COMPLETE) >= 8
