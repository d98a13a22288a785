"""How many CPUs a process may use (affinity mask, cgroup v2/v1 CPU quota) and the OpenMP wait
settings set before libgomp loads (issue 36 item 5). Fake cgroup trees in tmp_path; nothing timed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.contracts import cpu_threads
from pagedserve.contracts.cpu_threads import cgroup_cpu_limit, openmp_defaults, openmp_loaded, usable_cpus

ROOT = Path(__file__).resolve().parents[2]


def fake_cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /sys/fs/cgroup under tmp_path and a fake /proc/self/cgroup holding ``proc_line``."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line + "\n")
    return root, proc


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))


def test_v2_quota_is_read_from_this_process_cgroup(tmp_path):
    root, proc = fake_cgroup(tmp_path, "0::/user.slice/app.scope",
                             {"user.slice/app.scope/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 1.5


def test_v2_a_tighter_ancestor_binds(tmp_path):
    root, proc = fake_cgroup(tmp_path, "0::/a/b", {"a/b/cpu.max": "400000 100000", "a/cpu.max": "200000 100000"})
    assert cgroup_cpu_limit(root, proc) == 2.0


@pytest.mark.parametrize("text", ["max 100000", "max", "", "garbage here", "0 100000"])
def test_v2_no_quota(tmp_path, text):
    root, proc = fake_cgroup(tmp_path, "0::/", {"cpu.max": text})
    assert cgroup_cpu_limit(root, proc) is None


def test_v2_in_a_container_its_own_cgroup_is_the_root(tmp_path):
    root, proc = fake_cgroup(tmp_path, "0::/", {"cpu.max": "50000 100000"})  # docker --cpus 0.5
    assert cgroup_cpu_limit(root, proc) == 0.5


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path / "none", tmp_path / "none_either") is None


def test_v1_quota(tmp_path):
    root, proc = fake_cgroup(tmp_path, "4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc",
                             {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000",
                              "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(root, proc) == 3.0


def test_v1_unlimited(tmp_path):
    root, proc = fake_cgroup(tmp_path, "4:cpu,cpuacct:/", {"cpu,cpuacct/cpu.cfs_quota_us": "-1",
                                                          "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(root, proc) is None


def test_usable_cpus_is_the_affinity_mask_without_a_quota(eight_cpus, tmp_path):
    assert usable_cpus(tmp_path / "none", tmp_path / "none") == 8


def test_usable_cpus_is_capped_by_the_quota_rounded_down(eight_cpus, tmp_path):
    root, proc = fake_cgroup(tmp_path, "0::/", {"cpu.max": "250000 100000"})
    assert usable_cpus(root, proc) == 2


def test_usable_cpus_never_exceeds_the_mask_nor_falls_below_one(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    root, proc = fake_cgroup(tmp_path, "0::/", {"cpu.max": "800000 100000"})
    assert usable_cpus(root, proc) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    root.joinpath("cpu.max").write_text("20000 100000")  # 0.2 CPU: one thread still runs
    assert usable_cpus(root, proc) == 1


def test_the_real_machine_answers_something_sane():
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


# ---- OpenMP wait settings ----------------------------------------------------------------------

def test_openmp_defaults_set_a_short_spin_where_the_user_chose_nothing():
    environ: dict[str, str] = {}
    assert openmp_defaults(environ) == {"GOMP_SPINCOUNT": cpu_threads.GOMP_SPINCOUNT_DEFAULT}
    assert environ == {"GOMP_SPINCOUNT": cpu_threads.GOMP_SPINCOUNT_DEFAULT}
    assert int(cpu_threads.GOMP_SPINCOUNT_DEFAULT) < 300_000  # libgomp's own default spins ms


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"},
                                  {"GOMP_SPINCOUNT": "infinite"}, {"GOMP_SPINCOUNT": "300000"}])
def test_openmp_defaults_keep_what_the_user_set(user):
    environ = dict(user)
    assert openmp_defaults(environ) == {}
    assert environ == user


def test_openmp_settings_are_what_a_ray_actor_is_given():
    from pagedserve.contracts.cpu_threads import openmp_settings

    assert openmp_settings({"GOMP_SPINCOUNT": "1000", "OMP_NUM_THREADS": "2", "PATH": "/bin"}) == \
        {"GOMP_SPINCOUNT": "1000"}
    assert openmp_settings({"OMP_WAIT_POLICY": " "}) == {}


def test_openmp_loaded_reads_the_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00 r-xp 0 0:0 0 /usr/lib/libc.so.6\n")
    assert not openmp_loaded(maps)
    maps.write_text("7f00 r-xp 0 0:0 0 /venv/torch/lib/libgomp.so.1\n")
    assert openmp_loaded(maps)
    assert not openmp_loaded(tmp_path / "missing")


def _environ_without_openmp() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in cpu_threads.OPENMP_VARIABLES} | {"PYTHONPATH": str(ROOT)}


def test_the_cli_sets_them_before_torch_loads_libgomp():
    """``pagedserve`` sets the spin before any subcommand imports torch, so the libgomp torch loads
    reads it; the same process then shows no OpenMP mapped at the moment the default is set."""
    code = ("import sys\n"
            "from pagedserve.contracts import cpu_threads\n"
            "seen = []\n"
            "real = cpu_threads.openmp_defaults\n"
            "def spy(environ=None):\n"
            "    seen.append(('torch' in sys.modules, cpu_threads.openmp_loaded()))\n"
            "    return real(environ)\n"
            "cpu_threads.openmp_defaults = spy\n"
            "import pagedserve.app.cli\n"
            "pagedserve.app.cli.openmp_defaults = spy\n"
            "pagedserve.app.cli.main(['env'])\n"
            "import os, torch\n"
            "print(seen, os.environ.get('GOMP_SPINCOUNT'), cpu_threads.openmp_loaded())\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=_environ_without_openmp())
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last == f"[(False, False)] {cpu_threads.GOMP_SPINCOUNT_DEFAULT} True", last


def test_a_spawned_worker_inherits_them_and_sets_them_itself():
    """The worker entry sets the default too (a worker started by another parent), before torch."""
    code = ("import os, sys\n"
            "from pagedserve.gpu import worker\n"
            "assert 'torch' not in sys.modules\n"
            "from pagedserve.contracts import cpu_threads\n"
            "os.environ.pop('GOMP_SPINCOUNT', None)\n"
            "class Stop(Exception): pass\n"
            "def stop(*a, **k):\n"
            "    print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules); raise Stop\n"
            "worker.configure_logging = stop\n"
            "try:\n"
            "    from types import SimpleNamespace\n"
            "    worker.worker_main(SimpleNamespace(log_level=20, log_format='text', rank=0))\n"
            "except Stop:\n"
            "    pass\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=_environ_without_openmp())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"{cpu_threads.GOMP_SPINCOUNT_DEFAULT} False"
