"""Two Ray "nodes" on this machine (ray.cluster_utils.Cluster: a head raylet plus a second one,
what Ray's docs recommend for testing multi-node code on one machine), 1 CPU each, so a SPREAD
placement group puts one rank on each: steps travel as Ray actor calls and gloo meets at rank 0's
node. Checked: tp=2 greedy tokens equal the single process; `pagedserve serve
--distributed-executor-backend ray --ray-address ...` joins the existing cluster, serves, turns
/health 503 when an actor is killed, and leaves the cluster with its placement group removed."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.needs import require

ray = require("ray")

from tests.gpu.test_ray_executor import assert_released, placement_states, tiny_checkpoint  # noqa: E402,F401

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    c.add_node(**NODE)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=True)
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_tensor_parallel_2_across_two_nodes_equals_single_process(cluster, tiny_checkpoint):
    from pagedserve.engine.llm import LLM
    from tests.gpu.test_mp_equivalence import GREEDY, prompts, token_ids

    options = {"model": tiny_checkpoint, "dtype": "float32", "kv_cache_memory": 1 / 16}
    single = LLM(executor="inproc", **options)
    try:
        ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="ray", ray_placement_strategy="SPREAD",
              **options)
    executor = llm.parts.executor
    try:
        assert type(executor).__name__ == "RayCallExecutor"
        assert len(set(executor._placed.nodes)) == 2  # one rank per node
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == ref
    finally:
        llm.shutdown()
    assert_released(executor)
    assert ray.is_initialized()  # the executor joined this cluster: it does not stop it


def test_serve_joins_the_cluster_and_a_killed_actor_turns_health_503(cluster):
    from tests.e2e.test_server_e2e import ServerProcess
    from tests.e2e.test_worker_death import assert_dead_but_answering, gone, wait_health_503

    before = set(placement_states())
    s = ServerProcess("--distributed-executor-backend", "ray", "--tensor-parallel-size", "2",
                      "--ray-placement-strategy", "SPREAD", "--ray-address", cluster.address)
    try:
        placed = re.search(r"placed 2 Ray worker\(s\) \(SPREAD\): rank -> node \[(.*?)\], pid \[(.*?)\]",
                           s.output())
        assert placed, s.output()
        nodes = [n.strip(" '") for n in placed.group(1).split(",")]
        pids = [int(p) for p in placed.group(2).split(",")]
        assert len(set(nodes)) == 2 and "steps over Ray actor calls" in s.output()
        r = httpx.post(s.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
        os.kill(pids[1], signal.SIGKILL)
        wait_health_503(s, time.monotonic(), within=15)  # the idle health check pings the actors
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                       timeout=5)
        assert r.status_code == 503 and "worker 1 (Ray actor) died" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/v1/models", timeout=2).status_code == 200
        assert s.stop() == 0, s.output()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(gone(p) for p in pids):
            time.sleep(0.1)
        assert all(gone(p) for p in pids)
        mine = {k: v for k, v in placement_states().items() if k not in before}
        assert mine and set(mine.values()) == {"REMOVED"}
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # the cluster itself lives on
    finally:
        s.stop()
