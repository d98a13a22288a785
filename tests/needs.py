"""Skips that cannot hide a broken install (issue 38 item 8).

Locally a test may skip where a package of the test extra is missing or a C library did not build:
a developer's venv may lack them. Under CI (``CI`` set, as CI services and `.ci/run`'s environment
set it; `make test` installs the test extra and has a compiler) the same condition is a failure:
the test extra is installed there, and a library the CPU can run that did not build is a broken
build, not an absent feature. Only what the machine truly cannot do (an ISA it lacks) skips there.
"""
from __future__ import annotations

import importlib
import os
import platform
from types import ModuleType
from typing import Any

import pytest

__all__ = ["in_ci", "needs_library", "on_x86_64", "require", "require_installed", "require_library"]


def in_ci() -> bool:
    """Is this run CI's (env ``CI`` set to anything but "", 0, false, no)?"""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module: str, *, in_test_extra: bool = True) -> ModuleType:
    """``pytest.importorskip(module)`` locally; under CI a plain import (an ImportError fails the
    test, or the module's collection) when the test extra installs ``module`` on this machine."""
    if in_ci() and in_test_extra:
        return importlib.import_module(module)
    return pytest.importorskip(module)


def require_installed(module: str, *, in_test_extra: bool = True) -> None:
    """Skip the calling module unless ``module`` is installed, without importing it (triton must be
    imported only in the child processes that set TRITON_INTERPRET); under CI, when the test extra
    installs it here, its absence is an ImportError instead."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return
    if in_ci() and in_test_extra:
        raise ImportError(f"{module} is not installed, but the test extra installs it here (CI=true: this "
                          "fails instead of skipping); pip install -e '.[test]'")
    pytest.skip(f"{module} is not installed", allow_module_level=True)


def on_x86_64() -> bool:
    """The test extra installs triton only there (pyproject: platform_machine == 'x86_64')."""
    return platform.machine() in ("x86_64", "AMD64")


def _cpu_can_run(kernel: str) -> bool:
    from pagedserve.kernels import isa

    return isa.choose(kernel) is not None


def _broken(kernel: str, what: str) -> str:
    return (f"{what}: this CPU can run the {kernel!r} kernel but its library did not build (CI=true: a "
            "failed build fails the suite instead of skipping; see the warning in the log)")


def require_library(lib: Any, kernel: str, reason: str) -> Any:
    """Inside a test: ``lib`` (a loader's result), else skip with ``reason``, or fail under CI when
    the CPU can run ``kernel`` (the build failed)."""
    if lib is not None and lib is not False:
        return lib
    if in_ci() and _cpu_can_run(kernel):
        pytest.fail(_broken(kernel, reason))
    pytest.skip(reason)


def needs_library(lib: Any, kernel: str, reason: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark for a module or test: skip where ``lib`` is None; under CI, where the CPU
    can run ``kernel``, raise at collection instead (the module errors: the suite fails)."""
    missing = lib is None or lib is False
    if missing and in_ci() and _cpu_can_run(kernel):
        raise RuntimeError(_broken(kernel, reason))
    return pytest.mark.skipif(missing, reason=reason)
