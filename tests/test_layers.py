"""The package's layers (docs/architecture.md): no import runs up, none runs in a circle.

Read from the source with `ast`, type-only imports included: a module that needs another
only for its annotations still cannot be read without it.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import aiormq
import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
#: Every Python tree of the repository and the directory its dotted names start from.
TREES = ((SRC, "amqp_locks"), (ROOT, "amqp_locks_dev"), (ROOT, "benchmarks"), (ROOT, "tests"))

#: Bottom to top; a module may import its own layer and those below. The first prefix that
#: matches a module's dotted name (without ``amqp_locks.``) gives its layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("errors", "events", "extras", "names", "records", "signals", "stamps", "topology")),
    ("transport", ("transport",)),
    (
        "protocol core",
        (
            "held",
            "queue_lease",
            "lease",
            "waiting",
            "fencing",
            "replication",
            "holders",
            "lockobject",
            "admin_mutex",
            "shape",
        ),
    ),
    ("lock kinds", ("tokens", "mutex", "semaphore", "rwlock")),
    ("composition", ("status", "aio", "lockers", "service", "metrics", "celery", "otel")),
    ("front ends", ("cli", "tooz_driver", "")),  # "": the package root re-exports all
)


def layer_of(module: str) -> int:
    rel = module.removeprefix("amqp_locks").removeprefix(".")
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if rel == prefix or rel.startswith(prefix + ".") or (prefix == "" and rel == ""):
                return rank
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py")


def _modules(trees: tuple[tuple[Path, str], ...] = TREES[:1]) -> dict[str, Path]:
    out = {}
    for base, top in trees:
        for path in (base / top).rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


@functools.cache
def import_graph(trees: tuple[tuple[Path, str], ...] = TREES[:1]) -> dict[str, set[str]]:
    """Module -> the modules of `trees` it imports (anywhere in the file); by default the
    package's own."""
    modules = _modules(trees)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                names = subs or [target]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[module] |= {n for n in names if n in modules and n != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the path that closes it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_graph_sees_imports() -> None:
    graph = import_graph()
    # Spot checks that the reader follows relative, aliased and package imports.
    assert "amqp_locks.transport.session" in graph["amqp_locks.transport.core"]
    assert "amqp_locks.holders" in graph["amqp_locks.aio"]  # `from .. import holders as _h`
    assert "amqp_locks.records" in graph["amqp_locks.status"]


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


def test_no_import_circle_anywhere_in_the_repository() -> None:
    """The development tooling, the benchmarks and the tests too (issue 38: mesh.py and
    partition.py imported each other)."""
    graph = import_graph(TREES)
    assert "amqp_locks_dev.partition" in graph["amqp_locks_dev.mesh"]  # the reader sees them
    assert any(m.startswith("benchmarks.") for m in graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


@pytest.mark.parametrize("importer", sorted(import_graph()))
def test_no_import_runs_up(importer: str) -> None:
    mine = layer_of(importer)
    upward = sorted(m for m in import_graph()[importer] if layer_of(m) > mine)
    assert not upward, f"{importer} ({LAYERS[mine][0]}) imports from higher layers: " + ", ".join(
        f"{m} ({LAYERS[layer_of(m)][0]})" for m in upward
    )


# --- a narrow transport (issue 37): the AMQP client is transport/'s -------------------------

#: The modules outside transport/ that may still import aiormq or pamqp. A module added here
#: needs a reason; one that stops importing them must leave (the test says so).
AMQP_CLIENT_IMPORTERS: set[str] = set()

#: The modules outside transport/ that may still call AMQP methods on a channel themselves:
#: none (issue 37: every step is a transport/ function named for what it does).
RAW_CHANNEL_CALLERS: set[str] = set()

#: aiormq's channel methods (AMQP methods: basic.*, queue.*, exchange.*, tx.*, confirm).
AMQP_METHODS = frozenset(
    n
    for n in dir(aiormq.Channel)
    if n.split("_")[0] in {"basic", "queue", "exchange", "tx", "confirm"}
)


def _above_transport() -> dict[str, ast.Module]:
    return {
        module: ast.parse(path.read_text())
        for module, path in _modules().items()
        if not module.startswith("amqp_locks.transport")
    }


def _imports_amqp_client(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.level:  # relative: transport's compatibility module is the client's too
                names = [n for n in names if n.split(".")[-1] == "aiormq_compat"]
        else:
            continue
        if any(n.split(".")[0] in {"aiormq", "pamqp"} or "aiormq_compat" in n for n in names):
            return True
    return False


def amqp_client_importers() -> set[str]:
    """The modules outside transport/ that import aiormq or pamqp (type-only included), or
    transport's aiormq compatibility module."""
    return {module for module, tree in _above_transport().items() if _imports_amqp_client(tree)}


def raw_channel_callers() -> dict[str, int]:
    """Module -> how many AMQP method calls (``x.basic_get(...)``) it makes, outside
    transport/."""
    found: dict[str, int] = {}
    for module, tree in _above_transport().items():
        calls = _amqp_calls(tree)
        if calls:
            found[module] = calls
    return found


def _amqp_calls(tree: ast.AST) -> int:
    return sum(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in AMQP_METHODS
        for node in ast.walk(tree)
    )


def test_the_checks_see_imports_and_calls() -> None:
    assert "basic_get" in AMQP_METHODS and "exchange_bind" in AMQP_METHODS
    for source in (
        "import aiormq.exceptions",
        "from pamqp.commands import Basic",
        "from ..transport.aiormq_compat import send_together",
    ):
        assert _imports_amqp_client(ast.parse(source)), source
    assert not _imports_amqp_client(ast.parse("from ..transport.wire import Basic"))
    assert _amqp_calls(ast.parse("async def f(ch):\n    await ch.basic_get('q')")) == 1
    assert _amqp_calls(ast.parse("async def f(ch):\n    await take(ch, 'q')")) == 0


def test_only_the_listed_modules_import_the_amqp_client() -> None:
    found = amqp_client_importers()
    assert found - AMQP_CLIENT_IMPORTERS == set(), (
        "import aiormq/pamqp under transport/ only (transport/wire.py names their types)"
    )
    assert AMQP_CLIENT_IMPORTERS - found == set(), "no longer imports them: drop from the list"


def test_only_the_listed_modules_make_raw_channel_calls() -> None:
    found = set(raw_channel_callers())
    assert found - RAW_CHANNEL_CALLERS == set(), (
        "put the call in a transport/ function named for what it does (channel_ops.py, "
        "exchanges.py, the Session)"
    )
    assert RAW_CHANNEL_CALLERS - found == set(), "no longer calls them: drop from the list"


#: Modules whose job is to reach into a third-party library's private attributes, each
#: with its reasons in its docstring (aiormq's channel internals; py-amqp's, for Celery).
COMPAT_SHIMS = ("amqp_locks.transport.aiormq_compat", "amqp_locks.celery.amqp_compat")
#: Public names that start with an underscore.
PUBLIC = {"os._exit"}


def _private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """`x._name` where `x` is not `self`, `cls` or `super()`: a private attribute of
    another object (dunders are the language's own)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or (attr.startswith("__") and attr.endswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            continue
        if ast.unparse(node) not in PUBLIC:
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_class_reads_another_objects_private_attributes() -> None:
    """Issue 37: the package's parts speak through each other's public names (the asyncio
    twins through `acquire_on_loop` and friends, everything through `Broker.core`), so a
    private name can change without a search; only the compat shims reach into aiormq or
    py-amqp."""
    found = []
    for module, path in _modules().items():
        if module in COMPAT_SHIMS:
            continue
        for line, text in _private_reads(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert not found, "\n".join(found)


def test_no_module_imports_another_modules_private_names() -> None:
    """`from .x import _name` would tie a module to another's private name as surely as
    `x._name` does (fencing.py once imported queue_ops' `_bulk_probe`); the benchmarks and
    the dev tooling use the package's public names too (benchmarks/latency.py imported the
    semaphore client's `_claim`, and a change of its signature broke the CI's benchmark).
    The tests are white-box and may."""
    found = []
    for module, path in _modules(TREES[:3]).items():
        in_package = module.split(".")[0] == "amqp_locks"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = node.module or ""
            if not in_package and source.split(".")[0] != "amqp_locks":
                continue  # the dev tooling's own modules among themselves
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name}")
    assert not found, "\n".join(found)


def test_the_architecture_diagram_names_every_module() -> None:
    """docs/architecture.md's layer diagram stays current: every module of the package is
    named in it (a top-level one as ``name.py``, one in a subpackage by its stem or as
    ``name.py``), so a new module cannot be added without placing it in a layer (issue
    38: five were missing)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    diagram = doc.split("```\n", 2)[1]
    words = set(re.findall(r"[\w.]+", diagram))
    package = SRC / "amqp_locks"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.name == "__init__.py":
            continue
        named = {rel.name} if len(rel.parts) == 1 else {rel.name, rel.stem}
        if not named & words:
            missing.append(str(rel))
    assert not missing, f"not in docs/architecture.md's layer diagram: {missing}"
