"""A local Ray instance started by pagedserve listens on the loopback interface only (issue 37,
finding 8). Ray binds its GCS, raylet and workers to the node's IP on every interface (:: /
0.0.0.0) unless the node IP is the loopback one; a Ray that pagedserve starts for itself is one
node, so nothing of it should be reachable from the network. Checked on a real instance, in a
child process (its Ray state stays out of this one): every listening TCP socket of the process
tree is on 127.0.0.1 / ::1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.needs import require

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, psutil
import ray._private.services
# No Ray found on this machine (other test processes may run theirs): start our own.
def no_gcs():
    return []
no_gcs.cache_clear = lambda: None
ray._private.services.find_gcs_addresses = no_gcs
ray._private.services.find_bootstrap_address = lambda temp_dir: None
from pagedserve.gpu import ray_cluster
started = ray_cluster.connect(None, 1)
me = psutil.Process()
pids = {p.pid for p in me.children(recursive=True)} | {me.pid}
listening = [(c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name()) for c in psutil.net_connections("inet")
             if c.status == psutil.CONN_LISTEN and c.pid in pids]
import ray
gcs = ray.get_runtime_context().gcs_address
ray_cluster.leave_local_ray()
print(json.dumps({"started": started, "listening": listening, "gcs": gcs,
                  "env_after": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}))
"""


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_a_local_ray_started_here_listens_on_loopback_only():
    require("ray")
    require("psutil", in_test_extra=False)  # not in the test extra
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if not report["started"]:
        pytest.skip("a Ray cluster already runs on this machine (`ray start`): not one pagedserve started")
    assert report["listening"], report
    exposed = [entry for entry in report["listening"] if not _loopback(entry[0])]
    assert not exposed, f"listening beyond the loopback interface: {exposed}"
    assert report["gcs"].startswith("127.0.0.1:"), report["gcs"]
    assert report["env_after"] is None  # the driver's environment is left as it was
