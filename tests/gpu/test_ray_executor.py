"""The Ray executor on one local Ray instance (shared by this module: Ray takes seconds to start),
bounded to 4 logical CPUs and a small object store. Both step transports run the same fake
runner as the mp executor's tests: the shared-memory ring (actors on the driver's node, the
default) and Ray actor calls (what spans nodes; forced here by PAGEDSERVE_RAY_TRANSPORT)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from tests.needs import require

ray = require("ray")

from pagedserve.contracts.config import EngineConfig  # noqa: E402
from pagedserve.contracts.errors import ExecutorError  # noqa: E402
from pagedserve.gpu.executor_factory import create_executor  # noqa: E402
from tests.gpu.test_mp_executor import (  # noqa: E402,F401  (own_segments is a fixture)
    FAILING_STEP, HERE, NAP_STEP, SLOW_STEP, _existing, _gone, _step, own_segments)

FAKE = f"{HERE}:FakeRunner"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, object_store_memory=80 << 20, include_dashboard=False,
             log_to_driver=True)
    yield
    ray.shutdown()


def placement_states() -> dict[str, str]:
    from ray.util import placement_group_table

    return {pg_id: pg["state"] for pg_id, pg in placement_group_table().items()}


def assert_released(executor) -> None:
    """No actor process left, and every placement group this module made is removed."""
    assert all(_gone(p) for p in executor.worker_pids)
    assert set(placement_states().values()) <= {"REMOVED"}


def _config(tp: int = 1) -> EngineConfig:
    return EngineConfig.from_options(tensor_parallel_size=tp, distributed_executor_backend="ray",
                                     num_gpu_blocks_override=77)


def start(tp: int = 1, runner: str = FAKE):
    from pagedserve.gpu.executor_factory import create_ray_executor

    return create_ray_executor(_config(tp), runner_factory=runner, startup_timeout=120)


@pytest.fixture(params=["shm", "ray"])
def transport(request, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_RAY_TRANSPORT", request.param)
    return request.param


EXECUTOR_CLASS = {"shm": "RayRingExecutor", "ray": "RayCallExecutor"}


def test_two_ranks_serve_sync_and_async_steps_and_release_everything(transport, own_segments):
    ex = start(tp=2)
    try:
        assert type(ex).__name__ == EXECUTOR_CLASS[transport]
        assert ex.num_blocks == 77 and len(ex.worker_pids) == 2
        out = ex.execute(_step(1, [5, 6], new=[5, 6]))
        assert out.step_id == 1 and out.seq_ids.tolist() == [5, 6]
        assert out.token_ids.tolist() == [5003, 6003]  # seq s samples s * 1000 + its length
        out = asyncio.run(ex.execute_async(_step(2, [6])))
        assert out.token_ids.tolist() == [6004]  # the workers kept the sequence's state
        assert (len(own_segments) == 2) == (transport == "shm")
    finally:
        ex.shutdown()
        ex.shutdown()  # idempotent
    assert_released(ex)
    assert not _existing(own_segments)


def test_step_error_on_a_single_rank_fails_that_step_only(transport):
    ex = start()
    try:
        assert "boom in the fake runner" in ex.execute(_step(FAILING_STEP, [1], new=[1])).error
        assert ex.execute(_step(2, [1], new=[1])).token_ids.tolist() == [1003]
    finally:
        ex.shutdown()
    assert_released(ex)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill9_of_an_actor_mid_step_fails_the_executor(transport, mode):
    ex = start()
    pid = ex.worker_pids[0]
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(ExecutorError, match="worker 0 .*(exited|died)") as err:
        if mode == "sync":
            ex.execute(_step(SLOW_STEP, [1], new=[1]))
        else:
            asyncio.run(ex.execute_async(_step(SLOW_STEP, [1], new=[1])))
    assert "in-flight requests cannot finish" in str(err.value)
    with pytest.raises(ExecutorError) as again:  # every later call: the same error
        ex.execute(_step(3, [1]))
    assert again.value is err.value
    with pytest.raises(ExecutorError):
        ex.check_health()
    ex.shutdown()
    assert_released(ex)


def test_a_cancelled_async_step_is_dropped_and_the_next_gets_its_own_reply(transport):
    """The caller of a step gives up while the actor still works on it: its reply is waited
    for and dropped, the next step gets its own (the same seam the pipelined loop uses)."""
    ex = start()
    try:
        async def main():
            task = asyncio.ensure_future(ex.execute_async(_step(NAP_STEP, [3], new=[3])))
            await asyncio.sleep(0.1)  # sent; the actor naps half a second before answering
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await ex.execute_async(_step(2, [3]))

        out = asyncio.run(main())
        assert (out.step_id, out.token_ids.tolist()) == (2, [3004])
    finally:
        ex.shutdown()
    assert_released(ex)


def test_idle_death_is_seen_by_the_health_check(transport):
    ex = start()
    try:
        asyncio.run(ex.check_health_async())
        os.kill(ex.worker_pids[0], signal.SIGKILL)

        async def until_dead():
            while True:
                await ex.check_health_async()
                await asyncio.sleep(0.05)

        with pytest.raises(ExecutorError, match="worker 0"):
            asyncio.run(until_dead())
    finally:
        ex.shutdown()
    assert_released(ex)


def test_startup_error_is_reported_and_the_placement_group_released():
    with pytest.raises(ExecutorError, match="worker 0 failed to start") as err:
        start(runner=f"{HERE}:BrokenRunner")
    assert "fake weights missing: /nowhere/model.gguf" in str(err.value)
    assert set(placement_states().values()) <= {"REMOVED"}


def test_unplaceable_group_is_a_clear_error(monkeypatch):
    from pagedserve.contracts import env

    monkeypatch.setenv(env.RAY_PLACEMENT_TIMEOUT.name, "1")  # read when placing, not at import
    with pytest.raises(ExecutorError, match="could not place 9 worker"):
        start(tp=9)  # 9 bundles of 1 CPU on a 4-CPU instance
    assert set(placement_states().values()) <= {"REMOVED"}


def test_executor_seam_picks_ray_and_unknown_strategy_is_refused():
    config = _config()
    config.parallel.ray_placement_strategy = "SIDEWAYS"
    with pytest.raises(ExecutorError, match="placement strategy 'SIDEWAYS'"):
        create_executor(config)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from tests.gpu.test_mp_equivalence import UNTIED
    from pagedserve.engine.tokenizer import Tokenizer
    from tests.gpu.test_models import save_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-ray")
    save_hf_model(UNTIED, path, seed=3)
    Tokenizer.from_model()._tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_tensor_parallel_2_on_ray_equals_single_process(tiny_checkpoint):
    """Greedy tokens of tp=2 Ray actors (gloo) equal the in-process model's, fp32."""
    from pagedserve.engine.llm import LLM
    from tests.gpu.test_mp_equivalence import GREEDY, prompts, token_ids

    options = {"model": tiny_checkpoint, "dtype": "float32", "kv_cache_memory": 1 / 16}
    single = LLM(executor="inproc", **options)
    try:
        ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()
    assert len({tuple(t) for t in ref}) == len(ref) and all(len(set(t)) > 1 for t in ref)
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="ray", **options)
    executor = llm.parts.executor
    try:
        assert llm.config.parallel.executor == "ray"
        assert type(executor).__name__ == "RayRingExecutor"
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == ref
    finally:
        llm.shutdown()
    assert_released(executor)


def test_everything_but_the_ray_executor_works_without_ray():
    """With Ray not importable: the engine, the executor seam and the Ray modules import; asking
    for the Ray executor is an ExecutorError that says what to install."""
    code = textwrap.dedent("""
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import pagedserve.app.cli
        from pagedserve import app
        import pagedserve.engine.async_engine
        from pagedserve import engine
        import pagedserve.engine.llm
        import pagedserve.gpu.executor
        from pagedserve import gpu
        import pagedserve.gpu.ray_executor
        from pagedserve.contracts.config import EngineConfig
        from pagedserve.contracts.errors import ExecutorError
        from pagedserve.gpu.executor_factory import create_executor
        try:
            create_executor(EngineConfig.from_options(executor="ray", load_format="dummy"))
        except ExecutorError as e:
            print("refused:", e)
        assert "ray" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused: the Ray executor needs Ray: pip install 'pagedserve[ray]'" in r.stdout


@pytest.mark.slow
def test_default_model_tensor_parallel_3_on_ray_equals_single_process():
    """The default model in fp32 (9 query / 3 kv heads: 3 ranks split it, 2 cannot)."""
    from pagedserve.engine.llm import LLM
    from tests.gpu.test_mp_equivalence import DEFAULT_GREEDY, DEFAULT_PROMPTS, token_ids

    single = LLM(dtype="float32", executor="inproc", kv_cache_memory=0.25)
    try:
        ref = single.generate(DEFAULT_PROMPTS, DEFAULT_GREEDY, use_tqdm=False)
    finally:
        single.shutdown()
    assert ref[0].outputs[0].text.startswith(" Paris.")
    tp = LLM(dtype="float32", tensor_parallel_size=3, distributed_executor_backend="ray",
             kv_cache_memory=0.25)
    executor = tp.parts.executor
    try:
        out = tp.generate(DEFAULT_PROMPTS, DEFAULT_GREEDY, use_tqdm=False)
    finally:
        tp.shutdown()
    assert_released(executor)
    assert token_ids(out) == token_ids(ref)


def test_three_ranks_on_a_two_core_box_start_their_own_sized_ray():
    """tp=3 with no Ray running: the local instance the executor starts is sized for 3 one-CPU
    bundles although Ray counts 2 CPUs (pinned to 2 here, this project's box), serves a step
    on all 3 ranks and is stopped again on shutdown. In a fresh process that finds no running Ray
    (not this module's instance, nor another process's)."""
    code = textwrap.dedent(f"""
        import ray, ray._private.services, ray._private.utils
        ray._private.utils.get_num_cpus = lambda *a, **k: 2  # a 2-core box, whatever runs this
        # No Ray found on this machine (other test processes may run theirs): start our own.
        def no_gcs():
            return []
        no_gcs.cache_clear = lambda: None
        ray._private.services.find_gcs_addresses = no_gcs
        ray._private.services.find_bootstrap_address = lambda temp_dir: None
        from pagedserve.contracts.config import EngineConfig
        from pagedserve.gpu.executor_factory import create_ray_executor
        from tests.gpu.test_mp_executor import _step
        config = EngineConfig.from_options(tensor_parallel_size=3, distributed_executor_backend="ray",
                                           num_gpu_blocks_override=77)
        ex = create_ray_executor(config, runner_factory={FAKE!r}, startup_timeout=120)
        try:
            print("cpus", ray.cluster_resources()["CPU"], "ranks", len(ex.worker_pids))
            out = ex.execute(_step(1, [5, 6], new=[5, 6]))
            print("tokens", out.token_ids.tolist())
        finally:
            ex.shutdown()
        print("ray still running", ray.is_initialized())
    """)
    # No RAY_ADDRESS (ray.init set it for this module's instance); a failed placement says so
    # within 30 s instead of the default 120.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), PAGEDSERVE_RAY_PLACEMENT_TIMEOUT="30")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cpus 3.0 ranks 3" in r.stdout
    assert "tokens [5003, 6003]" in r.stdout
    assert "ray still running False" in r.stdout
