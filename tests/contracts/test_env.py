"""contracts/env.py is the one reader of PAGEDSERVE_* variables (issue 26 item 1): every such name
in the product is declared there, no other module reads (or writes) one through os.environ, and a
value that does not parse is a ConfigError naming the variable."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pagedserve.contracts import env
from pagedserve.contracts.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_ROOMS = ("app", "engine", "gpu", "kernels", "contracts", "loadtest")
REGISTRY = ROOT / "pagedserve" / "contracts" / "env.py"
# kernels/ moves its reads onto the registry in its own change; until that merges these may still
# read the environment themselves. The lead empties this set at merge: keep it shrinking only.


def product_files() -> list[Path]:
    return sorted(p for room in PRODUCT_ROOMS for p in (ROOT / room).rglob("*.py"))


def test_every_pagedserve_name_in_the_product_is_declared():
    declared = set(env.SWITCHES)
    found: dict[str, set[str]] = {}
    for path in product_files():
        for name in re.findall(r"PAGEDSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    unknown = {name: sorted(where) for name, where in found.items() if name not in declared}
    assert not unknown, f"declare these in contracts/env.py: {unknown}"


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def _switch_names(tree: ast.AST) -> set[str]:
    """Module names bound to a switch's name: ``X = "PAGEDSERVE_..."`` or ``X = env.SWITCH.name``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _names_a_switch(node.value, set()):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _names_a_switch(node: ast.AST | None, bound: set[str]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("PAGEDSERVE_")
    if isinstance(node, ast.JoinedStr) and node.values:
        return _names_a_switch(node.values[0], bound)
    if isinstance(node, ast.Name):  # a bound name, or one imported under an ENV-like name
        return node.id in bound or re.search(r"(^|_)ENV(_|$)", node.id) is not None
    if isinstance(node, ast.Attribute) and node.attr == "name":  # env.SWITCH.name
        return isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name) \
            and node.value.value.id == "env"
    return False


def environment_reads(source: str) -> list[int]:
    """Lines where ``source`` reads or writes a PAGEDSERVE_* variable through os.environ /
    os.getenv, or walks the environment for that prefix."""
    tree = ast.parse(source)
    bound = _switch_names(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            by_environ = isinstance(f, ast.Attribute) and _is_environ(f.value)
            by_getenv = (isinstance(f, ast.Attribute) and f.attr in ("getenv", "putenv", "unsetenv")) or (
                isinstance(f, ast.Name) and f.id == "getenv")
            if (by_environ or by_getenv) and node.args and _names_a_switch(node.args[0], bound):
                lines.append(node.lineno)
            if (isinstance(f, ast.Attribute) and f.attr == "startswith" and node.args
                    and _names_a_switch(node.args[0], bound) and "environ" in source):
                lines.append(node.lineno)  # {k: v for k, v in os.environ.items() if k.startswith(...)}
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and _names_a_switch(node.slice, bound):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators)
              and _names_a_switch(node.left, bound)):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_but_the_registry_reads_a_switch_from_the_environment():
    offenders = {}
    for path in product_files():
        rel = str(path.relative_to(ROOT))
        if path == REGISTRY:
            continue
        lines = environment_reads(path.read_text())
        if lines:
            offenders[rel] = lines
    assert not offenders, f"read these through contracts.env (Switch.get()): {offenders}"


@pytest.mark.parametrize("source", [
    'import os\nx = os.environ.get("PAGEDSERVE_FUSED", "1")',
    'import os\nx = os.getenv("PAGEDSERVE_FUSED")',
    'import os\nx = os.environ["PAGEDSERVE_FUSED"]',
    'import os\nENV = "PAGEDSERVE_FUSED"\nx = ENV in os.environ',
    'import os\nENV = "PAGEDSERVE_FUSED"\nos.environ[ENV] = "1"',
    'import os\nfrom pagedserve.contracts import env\nos.environ.pop(env.FUSED.name, None)',
    'import os\nfrom pagedserve.gpu.ray_executor import ENV_RAY_TRANSPORT\nsaved = os.environ.get(ENV_RAY_TRANSPORT)',
    'import os\nx = {k: v for k, v in os.environ.items() if k.startswith("PAGEDSERVE_")}',
])
def test_the_check_sees_each_way_of_reading(source):
    assert environment_reads(source)


def test_the_check_lets_other_variables_and_mentions_be():
    assert not environment_reads('import os\nx = os.environ.get("RAY_ADDRESS")\n"""PAGEDSERVE_FUSED=0"""')
    assert not environment_reads('import os\nchild = {**os.environ, "PAGEDSERVE_API_KEY": ""}')


@pytest.mark.parametrize("switch, raw", [
    (env.WORKER_THREADS, "0"), (env.WORKER_THREADS, "many"), (env.FUSED, "maybe"),
    (env.STEP_TRANSPORT, "carrier-pigeon"), (env.RAY_TRANSPORT, "pipe"), (env.FAST_DECODE, "fast"),
    (env.RAY_PLACEMENT_TIMEOUT, "-1"), (env.WORKER_STARTUP_TIMEOUT, "soon"),
])
def test_a_bad_value_is_a_config_error_naming_the_variable(monkeypatch, switch, raw):
    monkeypatch.setenv(switch.name, raw)
    with pytest.raises(ConfigError, match=switch.name):
        switch.get()


def test_values_are_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.delenv(env.WORKER_THREADS.name, raising=False)
    assert env.WORKER_THREADS.get() is None and not env.WORKER_THREADS.is_set()
    monkeypatch.setenv(env.WORKER_THREADS.name, "3")
    assert env.WORKER_THREADS.get() == 3
    monkeypatch.setenv(env.FAST_DECODE.name, "layer")
    assert env.FAST_DECODE.get() == "layer"
    for raw, mode in (("0", "off"), ("false", "off"), ("1", "on"), ("yes", "on")):
        monkeypatch.setenv(env.FAST_DECODE.name, raw)
        assert env.FAST_DECODE.get() == mode


def test_forwarded_holds_only_the_switches_set(monkeypatch):
    for name in env.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env.FUSED.name, "0")
    monkeypatch.setenv("PAGEDSERVE_NOT_A_SWITCH_TEST", "1")
    assert env.forwarded() == {env.FUSED.name: "0"}


def test_pagedserve_env_prints_every_switch(capsys):
    from pagedserve.app.cli import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name, _values, _default, doc in env.table():
        assert name in out and doc in out
