"""Objects, not mixins that share private state (issue 38 item 2): no class in engine/ reads a
``self._name`` it never assigns, in its own body or in a base class defined in engine/. A class
that needs another object's state is given that object (or the value) in its constructor and asks
it through its public methods. Checked on the source (AST), so a new mixin cannot creep back."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pagedserve"
SCOPE = ("engine",)

# (module, class, attribute) reads that break the rule, allowed for a while (empty: keep it so).
KNOWN_VIOLATIONS: set[tuple[str, str, str]] = set()


def _own_names(cls: ast.ClassDef) -> set[str]:
    """Attributes a class body defines (methods, class variables, fields) or its methods assign on self."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
        elif isinstance(node, ast.NamedExpr):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and isinstance(t.ctx, ast.Store)):
                    names.add(t.attr)
    return names


def _private_reads(cls: ast.ClassDef) -> set[str]:
    return {node.attr for node in ast.walk(cls)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and isinstance(node.ctx, ast.Load) and node.attr.startswith("_") and not node.attr.startswith("__")}


def _classes(root: Path = ROOT, scope: tuple[str, ...] = SCOPE) -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Class name -> [(module, class node)] over the scope (a name may be defined twice)."""
    found: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for room in scope:
        for path in sorted((root / room).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append((module, node))
    return found


def violations(root: Path = ROOT, scope: tuple[str, ...] = SCOPE) -> set[tuple[str, str, str]]:
    classes = _classes(root, scope)

    def assigned(cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str]:
        names = _own_names(cls)
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in classes and name not in seen:
                for _, base_cls in classes[name]:
                    names |= assigned(base_cls, seen | {cls.name})
        return names

    out = set()
    for name, defs in classes.items():
        for module, cls in defs:
            for attr in _private_reads(cls) - assigned(cls):
                out.add((module, name, attr))
    return out


def test_no_class_reads_private_state_it_never_assigns():
    found = violations()
    new = sorted(found - KNOWN_VIOLATIONS)
    assert not new, ("classes read a self._name that neither they nor a base of theirs assign (another "
                     "class's private state): give the collaborator to the constructor instead\n"
                     + "\n".join(f"  {m}.{c}: self.{a}" for m, c, a in new))
    gone = sorted(KNOWN_VIOLATIONS - found)
    assert not gone, "fixed: remove from KNOWN_VIOLATIONS: " + ", ".join(map(str, gone))


def test_the_checker_sees_a_mixin_reading_its_hosts_state(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "m.py").write_text(
        "class Mixin:\n"
        "    def f(self):\n        return self._host_state + self._own\n"
        "    def g(self):\n        self._own = 1\n        return self._helper()\n"
        "    def _helper(self):\n        return 0\n"
        "class Host(Mixin):\n"
        "    def __init__(self):\n        self._host_state = 1\n"
        "    def h(self):\n        return self._own + self._host_state\n")
    assert violations(tmp_path, ("engine",)) == {("engine.m", "Mixin", "_host_state")}
