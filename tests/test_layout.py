"""The package's layout, held by tests: the HTTP edge is three rooms whose modules stay small,
the network room does not know the OpenAI surface, and no module imports one that imports it
back, in any way (at module level, under `TYPE_CHECKING`, or inside a function). Nothing
breaks these rules, and nothing may."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "otel_engine"
EDGE = PACKAGE / "entrypoints"
ROOMS = ("network", "openai", "tools")
MAX_EDGE_MODULE_LINES = 400


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[str]:
    """Every `otel_engine` module `path` imports, wherever the import is (the package
    imports absolutely only)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}: relative"
            continue
        for name in names:
            if name.startswith("otel_engine."):
                yield name.removeprefix("otel_engine.")


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(path): path for path in paths}
    return {
        module: {name for name in _imports(path) if name in modules and name != module}
        for module, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_edge_is_three_rooms() -> None:
    loose = {p.name for p in EDGE.glob("*.py")} - {"__init__.py", "api_server.py"}
    rooms = {p.name for p in EDGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert set() == loose
    assert set(ROOMS) == rooms


def test_no_module_of_the_edge_is_over_400_lines() -> None:
    over = {
        str(path.relative_to(PACKAGE))
        for path in EDGE.rglob("*.py")
        if len(path.read_text(encoding="utf-8").splitlines()) > MAX_EDGE_MODULE_LINES
    }
    assert set() == over


def test_the_network_room_does_not_import_the_openai_surface() -> None:
    offenders = {
        str(path.relative_to(PACKAGE))
        for path in (EDGE / "network").rglob("*.py")
        if any(name.startswith("entrypoints.openai") for name in _imports(path))
    }
    assert set() == offenders


def test_no_import_cycle_of_any_kind() -> None:
    assert set() == _cycles(_graph())
