"""The kernel build cache is code this process loads: a directory or library another user can
write must be refused (issue 22 item 8), with the reason, not loaded."""
from __future__ import annotations

import os
import shutil

import pytest

from pagedserve.kernels import cbuild, isa

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")

SOURCE = "answer.c"
ANSWER = isa.Kernel(SOURCE, (isa.Build("scalar", frozenset(), ()),))


@pytest.fixture(autouse=True)
def tiny_source(tmp_path, monkeypatch):
    """A one-line C source instead of a real kernel (those take a minute to compile)."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / SOURCE).write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(cbuild, "CSRC", csrc)
    monkeypatch.setitem(isa.KERNELS, "answer", ANSWER)


def _build(monkeypatch, cache):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(cache))
    lib = cbuild.build(SOURCE, [])
    assert lib.answer() == 42
    return lib


def test_a_private_cache_builds_and_loads(tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    lib = _build(monkeypatch, cache)
    assert lib is not None
    assert (cache.stat().st_mode & 0o077) == 0  # made private: only this user may read or write it
    [so] = list(cache.glob("*.so"))
    assert so.stat().st_uid == os.getuid()
    assert _build(monkeypatch, cache) is not None  # the cached file loads again


def test_a_world_writable_cache_dir_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    _build(monkeypatch, cache)  # a good build is cached there
    cache.chmod(0o777)  # now anyone could swap the library for their own
    with pytest.raises(cbuild.KernelBuildError) as e:
        _build(monkeypatch, cache)
    msg = str(e.value)
    assert str(cache) in msg and "writable" in msg and "PAGEDSERVE_KERNEL_CACHE" in msg


def test_a_group_writable_library_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    _build(monkeypatch, cache)
    [so] = list(cache.glob("*.so"))
    so.chmod(0o775)
    with pytest.raises(cbuild.KernelBuildError) as e:
        _build(monkeypatch, cache)
    assert so.name in str(e.value) and "writable" in str(e.value)


def test_a_refused_cache_turns_the_kernel_off_not_the_server(tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(cache))
    assert cbuild.build_or_none("answer", ANSWER.builds[0], "the torch path") is None
    assert not list(cache.glob("*.so"))  # nothing was built into (or loaded from) it


def test_a_foreign_owner_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    _build(monkeypatch, cache)
    real_uid = os.getuid()
    monkeypatch.setattr(cbuild.os, "getuid", lambda: real_uid + 1)
    with pytest.raises(cbuild.KernelBuildError) as e:
        _build(monkeypatch, cache)
    assert "owned by" in str(e.value)
