"""The floor plan of gateway/, read from the source with `ast`: no module imports itself
back through others (at run time or under TYPE_CHECKING), no function imports gateway
code, package `__init__` files re-export nothing, and the parsers that settings use to
check values import no settings."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"

# Leaves that a settings model imports to check its values: importing settings back
# would make a circle through the validators.
SETTINGS_FREE = (
    "gateway.types",
    "gateway.errors",
    "gateway.media.types",
    "gateway.media.urls",
    "gateway.media.addresses",
    "gateway.media.images",
    "gateway.config.tls",
    "gateway.config.key_file",
    "gateway.access.endpoints",
    "gateway.access.clients",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The gateway modules `node` imports: a name that is a module counts as that module."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{alias.name}" for alias in node.names]
        names = [n if n in MODULES else base for n in names]
    for name in names:
        if name == "gateway" or name.startswith("gateway."):
            yield name


class Imports(ast.NodeVisitor):
    """Every gateway import of one module, and the ones made inside a function."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.all: set[str] = set()
        self.in_functions: list[tuple[str, int]] = []
        self._depth = 0

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for name in imported(self.module, node):
            if name != self.module:
                self.all.add(name)
                if self._depth:
                    self.in_functions.append((name, node.lineno))

    visit_ImportFrom = visit_Import


def imports_of(module: str) -> Imports:
    found = Imports(module)
    found.visit(ast.parse(MODULES[module].read_text(encoding="utf-8")))
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_the_walk_sees_the_whole_package() -> None:
    # A walk that found nothing would pass every check below.
    assert len(MODULES) > 60
    assert "gateway.config.settings" in GRAPH["gateway.app"].all
    assert sum(len(found.all) for found in GRAPH.values()) > 150


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    graph = {module: {t for t in found.all if t in MODULES} for module, found in GRAPH.items()}
    assert cycles(graph) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_imports_gateway_code(module: str) -> None:
    assert GRAPH[module].in_functions == []


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_packages_re_export_nothing(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    body = [node for node in tree.body if not isinstance(node, ast.Expr)]
    assert body == [], f"{module} holds more than its docstring"


@pytest.mark.parametrize("module", SETTINGS_FREE)
def test_parsers_import_no_settings(module: str) -> None:
    settings = {t for t in GRAPH[module].all if t.rsplit(".", 1)[-1] == "settings"}
    assert settings == set()


def test_function_level_imports_are_seen() -> None:
    source = "def f():\n    from gateway.errors import GatewayError\n"
    found = Imports("gateway.app")
    found.visit(ast.parse(source))
    assert found.in_functions == [("gateway.errors", 2)]
