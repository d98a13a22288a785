"""The ctypes mirror (kernels/abi.py) against the C side (kernels/csrc/exports.h): every exported
function with the same argument and return types, argument by argument, and every struct that
crosses with the compiler's own size and field offsets. ctypes checks none of this, and a c_int
passed for an int64_t or a field out of place corrupts memory silently."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from pagedserve.kernels import abi, cbuild, isa

EXPORTS = cbuild.CSRC / "exports.h"
_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
has_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")


def parse_exports(text: str) -> dict[str, dict[str, tuple]]:
    """kernel -> function -> (restype, argtypes), read from exports.h's sections."""
    text = re.sub(r"/\*(?!\s*----).*?\*/", "", text, flags=re.S)  # comments, but the section markers
    text = re.sub(r"typedef struct \{.*?\}\s*\w+;", "", text, flags=re.S)
    text = re.sub(r"^\s*#.*$", "", text, flags=re.M)  # preprocessor lines (guards, the FZ_KV_* constants)
    out: dict[str, dict[str, tuple]] = {}
    kernel = None
    for token in re.finditer(r'SIGNATURES\["(\w+)"\]|(\w[\w\s]*?)\b(\w+)\s*\(([^)]*)\)\s*;', text):
        if token.group(1):
            kernel = token.group(1)
            out[kernel] = {}
            continue
        ret, name, args = token.group(2), token.group(3), " ".join(token.group(4).split())
        params = [] if args == "void" else [_param(a) for a in args.split(",")]
        out[kernel][name] = (_param(ret), params)
    return out


def _param(decl: str):
    """The ctypes type that carries one C parameter or return type (a pointer of any kind: c_void_p)."""
    if "*" in decl:
        return ctypes.c_void_p
    base = decl.replace("const ", "").split()[0]
    return None if base == "void" else _SCALARS[base]


def mismatches(c_side: dict, py_side: dict) -> list[str]:
    problems = []
    for kernel in sorted(set(c_side) | set(py_side)):
        c_fns, py_fns = c_side.get(kernel, {}), py_side.get(kernel, {})
        for name in sorted(set(c_fns) | set(py_fns)):
            if name not in py_fns:
                problems.append(f"{kernel}.{name}: declared in exports.h, missing from kernels/abi.py")
            elif name not in c_fns:
                problems.append(f"{kernel}.{name}: in kernels/abi.py, not declared in exports.h")
            elif c_fns[name][0] is not py_fns[name][0]:
                problems.append(f"{kernel}.{name}: returns {c_fns[name][0]} in C, {py_fns[name][0]} in ctypes")
            elif list(c_fns[name][1]) != list(py_fns[name][1]):
                c_args, py_args = c_fns[name][1], py_fns[name][1]
                at = next((i for i, (a, b) in enumerate(zip(c_args, py_args)) if a is not b), min(len(c_args),
                                                                                               len(py_args)))
                problems.append(f"{kernel}.{name}: argument {at} differs ({len(c_args)} C arguments, "
                                f"{len(py_args)} ctypes): {c_args[at:at + 1]} vs {py_args[at:at + 1]}")
    return problems


def test_every_export_has_the_same_signature_on_both_sides() -> None:
    c_side = parse_exports(EXPORTS.read_text())
    assert set(c_side) == set(isa.KERNELS)  # one section per kernel of the ISA table
    assert mismatches(c_side, abi.SIGNATURES) == []


def test_the_comparison_catches_a_narrowed_argument_and_a_lost_one() -> None:
    c_side = parse_exports(EXPORTS.read_text())
    narrowed = {k: dict(v) for k, v in abi.SIGNATURES.items()}
    res, args = narrowed["paged_attn"]["pa_decode"]
    narrowed["paged_attn"]["pa_decode"] = (res, [*args[:-2], ctypes.c_int, args[-1]])  # int64_t part -> int
    narrowed["fused_cpu"]["fz_write_kv"] = (ctypes.c_int, narrowed["fused_cpu"]["fz_write_kv"][1])
    del narrowed["sample_cpu"]["sp_draw"]
    found = mismatches(c_side, narrowed)
    assert len(found) == 3 and any("pa_decode: argument 16" in p for p in found), found


@has_cc
def test_every_struct_has_the_compilers_size_and_offsets(tmp_path) -> None:
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "exports.h"', "int main(void) {"]
    for c_name, struct in abi.STRUCTS.items():
        lines.append(f'    printf("{c_name} %zu %zu\\n", sizeof({c_name}), _Alignof({c_name}));')
        for field, _ in struct._fields_:
            lines.append(f'    printf("{c_name}.{field} %zu %zu\\n", offsetof({c_name}, {field}), '
                         f"sizeof((({c_name} *)0)->{field}));")
    lines += ["    return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-std=c11", f"-I{cbuild.CSRC}", str(src), "-o", str(exe)], check=True)
    c_side = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        key, *numbers = line.split()
        c_side[key] = tuple(map(int, numbers))
    for c_name, struct in abi.STRUCTS.items():
        assert c_side[c_name] == (ctypes.sizeof(struct), ctypes.alignment(struct)), c_name
        for field, _ in struct._fields_:
            descriptor = getattr(struct, field)
            assert c_side[f"{c_name}.{field}"] == (descriptor.offset, descriptor.size), f"{c_name}.{field}"


def test_the_loaded_libraries_export_every_declared_function() -> None:
    """Each kernel this CPU builds has every symbol its table names (bind fails on a missing one)."""
    for name in isa.KERNELS:
        choice = isa.choose(name)
        if choice is None:
            continue
        try:
            lib = cbuild.build_kernel(name, choice)
        except cbuild.CompilerMissing:
            pytest.skip("no C compiler")
        abi.bind(lib, name)
        for fn, (restype, argtypes) in abi.SIGNATURES[name].items():
            assert getattr(lib, fn).argtypes == argtypes
