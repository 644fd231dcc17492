"""The package's layers (docs/architecture.md): no import runs up, none runs in a circle.

Read from the source with `ast`, type-only imports included: a module that needs another
only for its annotations still cannot be read without it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

#: Bottom to top; a module may import its own layer and those below. The first prefix that
#: matches a module's dotted name (without ``amqp_locks.``) gives its layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("errors", "events", "extras", "names", "records", "stamps")),
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
        ),
    ),
    ("lock kinds", ("tokens", "mutex", "semaphore", "rwlock")),
    ("composition", ("status", "aio", "lockers", "service", "metrics", "celery")),
    ("front ends", ("cli", "tooz_driver", "")),  # "": the package root re-exports all
)


def layer_of(module: str) -> int:
    rel = module.removeprefix("amqp_locks").removeprefix(".")
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if rel == prefix or rel.startswith(prefix + ".") or (prefix == "" and rel == ""):
                return rank
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "amqp_locks").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file)."""
    modules = _modules()
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


@pytest.mark.parametrize("importer", sorted(import_graph()))
def test_no_import_runs_up(importer: str) -> None:
    mine = layer_of(importer)
    upward = sorted(m for m in import_graph()[importer] if layer_of(m) > mine)
    assert not upward, f"{importer} ({LAYERS[mine][0]}) imports from higher layers: " + ", ".join(
        f"{m} ({LAYERS[layer_of(m)][0]})" for m in upward
    )
