"""`pagedserve env`: every PAGEDSERVE_* environment switch, from the one table that declares them
(contracts/env.py), with the value set here where there is one."""
from __future__ import annotations

import argparse

from pagedserve.contracts import env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="store_true", help="only the switches set in this environment")


def render(only_set: bool = False) -> str:
    header = ("NAME", "VALUES", "DEFAULT", "SET", "WHAT IT DOES")
    rows = [(name, values, default or "-", _shown(name), doc)
            for name, values, default, doc in env.table()
            if not only_set or env.SWITCHES[name].is_set()]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4]
             for row in (header, *rows)]
    return "\n".join(line.rstrip() for line in lines)


def _shown(name: str) -> str:
    if not env.SWITCHES[name].is_set():
        return "-"
    return "(set)" if name == env.API_KEY.name else env.SWITCHES[name].raw()  # never print a secret


def run(args: argparse.Namespace) -> int:
    print(render(args.set))
    return 0
