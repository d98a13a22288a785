"""tests/needs.py: a skip that could hide a broken install is a failure under CI (issue 38 item 8)."""
from __future__ import annotations

import pytest

from tests import needs


def test_a_missing_test_extra_package_skips_locally_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        needs.require("pagedserve_no_such_module")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(ImportError):
        needs.require("pagedserve_no_such_module")
    with pytest.raises(pytest.skip.Exception):  # not in the test extra on this machine: skips anyway
        needs.require("pagedserve_no_such_module", in_test_extra=False)
    with pytest.raises(ImportError):
        needs.require_installed("pagedserve_no_such_module")


def test_a_library_this_cpu_can_run_that_did_not_build_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        needs.require_library(None, "paged_attn", "not built")
    assert needs.needs_library(None, "paged_attn", "not built").args == (True,)
    monkeypatch.setenv("CI", "true")  # the scalar paged_attn build runs on any CPU
    with pytest.raises(pytest.fail.Exception, match="did not build"):
        needs.require_library(None, "paged_attn", "not built")
    with pytest.raises(RuntimeError, match="did not build"):
        needs.needs_library(None, "paged_attn", "not built")
    monkeypatch.setattr(needs, "_cpu_can_run", lambda kernel: False)  # an ISA this CPU lacks: a skip
    with pytest.raises(pytest.skip.Exception):
        needs.require_library(None, "paged_attn_amx", "no AMX")
    assert needs.require_library("lib", "paged_attn", "x") == "lib"
