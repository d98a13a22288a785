"""No import circles among the product's modules (app, engine, gpu, kernels, contracts, loadtest).

A circle makes import order matter and hides which module a thing belongs to. Both kinds of
import count: those at the top of a module and those inside a function (a lazy import closes
a circle too; it only defers the failure to the first call). Imports under ``if TYPE_CHECKING:``
never run, but a circle through them still means two modules each need the other to be
understood: they count too (a protocol in a module of its own is the way out).

``python tests/test_import_cycles.py`` prints the circles and their counts (module-level imports
only; module- and function-level; all, TYPE_CHECKING ones too).
"""
from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pagedserve",)  # the rooms live under one package


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, modules: dict, top_level_only: bool,
             type_checking: bool) -> set[str]:
    """The product modules ``module`` imports (``from pkg import sub`` names the submodule)."""
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for sub in child.orelse:
                    visit(sub, nested)
                continue
            if isinstance(child, ast.Import):
                if not (nested and top_level_only):
                    found.update(filter(None, (resolve(a.name) for a in child.names)))
            elif isinstance(child, ast.ImportFrom):
                if not (nested and top_level_only):
                    base = child.module or ""
                    if child.level:
                        package = module if is_package else module.rpartition(".")[0]
                        for _ in range(child.level - 1):
                            package = package.rpartition(".")[0]
                        base = f"{package}.{base}" if base else package
                    for a in child.names:
                        target = resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else resolve(base)
                        if target:
                            found.add(target)
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, False)
    found.discard(module)
    return found


def import_graph(top_level_only: bool, type_checking: bool = False) -> dict[str, set[str]]:
    modules = product_modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        graph[name] = _imports(tree, name, path.name == "__init__.py", modules, top_level_only, type_checking)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def strongconnect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(out)


ALLOWED: list[list[str]] = []  # none: a circle is broken, never allowed


def test_no_import_circle_among_product_modules():
    found = [c for c in circles(import_graph(top_level_only=False, type_checking=True)) if c not in ALLOWED]
    assert not found, "import circles (module-level, function-level and TYPE_CHECKING imports): " + "; ".join(
        " <-> ".join(c) for c in found)


if __name__ == "__main__":
    for label, top, typing_too in (("module-level imports", True, False),
                                   ("module- and function-level imports", False, False),
                                   ("all imports (TYPE_CHECKING ones too)", False, True)):
        found = circles(import_graph(top, typing_too))
        print(f"{label}: {len(found)} circle(s)")
        for c in found:
            print("   ", " <-> ".join(c))
