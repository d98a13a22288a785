"""The rooms import each other in one direction only (README, Architecture):

    app -> engine -> gpu -> kernels, every room -> contracts, contracts -> no room,

loadtest's HTTP clients (everything in loadtest/ outside loadtest/micro/) import nothing of the
server, and nothing shipped imports tests/. Checked on the source (every import statement,
top level or inside a function, relative ones resolved), so a lazy import counts as much as an
eager one. And the scheduler, the block manager and the engine core import without torch.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pagedserve"  # the rooms live under one package
ROOMS = ("app", "contracts", "engine", "gpu", "kernels", "loadtest")
SERVER = {"app", "engine", "gpu", "kernels"}

# room (or "loadtest/http": loadtest outside loadtest/micro) -> the top-level packages it must not import
FORBIDDEN = {
    "app": {"gpu", "kernels", "loadtest", "tests"},
    "engine": {"app", "loadtest", "tests"},
    "gpu": {"app", "engine", "loadtest", "tests"},
    "kernels": {"app", "engine", "gpu", "loadtest", "tests"},
    "contracts": {"app", "engine", "gpu", "kernels", "loadtest", "tests"},
    "loadtest/http": SERVER | {"tests"},
    "loadtest/micro": {"tests"},
}

# Imports that break a rule today, in files other helpers of issue 26 own; each is removed by its
# owner's change, and the lead empties this set at merge. (importer module, imported module)
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def _room(rel: Path) -> str:
    if rel.parts[0] == "loadtest":
        return "loadtest/micro" if len(rel.parts) > 2 and rel.parts[1] == "micro" else "loadtest/http"
    return rel.parts[0]


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module this file imports, absolute (``from . import x`` resolved against ``module``)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
    return found


def product_files():
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            yield path.relative_to(ROOT)


def _top(imported: str) -> str:
    """The room (or other top-level package) an import names: ``pagedserve.gpu.x`` -> ``gpu``."""
    parts = imported.split(".")
    return parts[1] if parts[0] == "pagedserve" and len(parts) > 1 else parts[0]


def violations() -> set[tuple[str, str]]:
    out = set()
    for rel in product_files():
        module = _module_name(rel)
        forbidden = FORBIDDEN[_room(rel)]
        for imported in _imports(ROOT / rel, module):
            if _top(imported) in forbidden:
                out.add((module, imported))
    return out


def test_every_product_module_is_in_a_room_with_rules():
    rooms = {_room(rel) for rel in product_files()}
    assert rooms <= set(FORBIDDEN), rooms - set(FORBIDDEN)
    assert {"app", "engine", "gpu", "kernels", "contracts", "loadtest/http", "loadtest/micro"} <= rooms


def test_imports_follow_the_layers():
    found = violations()
    new = sorted(found - KNOWN_VIOLATIONS)
    assert not new, "imports against the layering (README, Architecture):\n" + "\n".join(
        f"  {importer} imports {imported}" for importer, imported in new)
    fixed = sorted(KNOWN_VIOLATIONS - found)
    assert not fixed, f"fixed, remove from KNOWN_VIOLATIONS: {fixed}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The AST walk finds an import inside a function and resolves a relative one."""
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent("""
        def f():
            from pagedserve.gpu.worker import x
        from . import sibling
        from .sub import y
    """))
    (pkg / "__init__.py").write_text("from .mod import f\n")
    assert _imports(pkg / "mod.py", "app.mod") == {"pagedserve.gpu.worker", "app", "app.sub"}
    assert _imports(pkg / "__init__.py", "app") == {"app.mod"}


def test_scheduler_block_manager_and_core_import_without_torch():
    code = textwrap.dedent("""
        import importlib.abc, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"torch is hidden from this process ({name})")
                return None

        sys.meta_path.insert(0, NoTorch())
        import pagedserve.engine.scheduler
        from pagedserve import engine
        import pagedserve.engine.kv_blocks
        import pagedserve.engine.core
        assert "torch" not in sys.modules
        print("imported without torch")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "imported without torch" in r.stdout
