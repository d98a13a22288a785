"""Pipeline stages and data-parallel replicas on the Ray executor, on the bounded local Ray
instance of tests/gpu/test_ray_executor.py (its module fixture, imported here, so this module
gets its own instance the same way).

- pp=2 (world = tp x pp actors) gives the single process's greedy tokens on both step
  transports (the shared-memory ring; Ray actor calls, forced by PAGEDSERVE_RAY_TRANSPORT), with
  chunked prefill, preemption and two steps in flight, offline (LLM) and under the server's
  engine loop (AsyncEngine); kill -9 of either stage's actor fails the in-flight request (no
  hang) and the placement group is removed.
- --data-parallel-size 2 with the Ray executor: each replica its own placement group while
  serving, the same greedy tokens as one engine, both groups removed on shutdown.
"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.needs import require

ray = require("ray")

from pagedserve.engine.errors import EngineDeadError  # noqa: E402
from pagedserve.contracts.config import EngineConfig  # noqa: E402
from tests.gpu.test_mp_equivalence import GREEDY, prompts, token_ids  # noqa: E402
from tests.gpu.test_pipeline import one_thread  # noqa: E402
from tests.gpu.test_ray_executor import (  # noqa: E402,F401  (local_ray, tiny_checkpoint, transport: fixtures)
    EXECUTOR_CLASS, assert_released, local_ray, placement_states, tiny_checkpoint, transport)

# 64-token steps split the longer prompts (up to 89 tokens): chunked prefill.
CHUNKED = {"dtype": "float32", "max_num_batched_tokens": 64, "enable_prefix_caching": False}
# A hang must fail the test, not hold the suite: far above what any step here takes.
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def options(tiny_checkpoint) -> dict:
    return {"model": tiny_checkpoint, "kv_cache_memory": 1 / 16, **CHUNKED}


@pytest.fixture(scope="module")
def reference(options) -> list[list[int]]:
    """The in-process greedy tokens, on one torch thread like each actor here."""
    from pagedserve.engine.llm import LLM

    assert max(len(p) for p in prompts()) > CHUNKED["max_num_batched_tokens"]
    single = LLM(executor="inproc", **options)
    try:
        with one_thread():
            ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()
    assert len({tuple(t) for t in ref}) == len(ref) and all(len(set(t)) > 1 for t in ref)
    return ref


def test_pp2_on_ray_equals_single_process_with_preemption(transport, options, reference):
    """Offline engine: 14 blocks of 16 tokens cannot hold the 16 requests at once, so some are
    preempted and recomputed; two steps are in flight at once, never more."""
    from pagedserve.engine.llm import LLM

    small_cache = {**{k: v for k, v in options.items() if k != "kv_cache_memory"},
                   "num_gpu_blocks_override": 14, "block_size": 16}
    llm = LLM(pipeline_parallel_size=2, distributed_executor_backend="ray", **small_cache)
    ex = llm.parts.executor
    try:
        assert type(ex).__name__ == EXECUTOR_CLASS[transport] and len(ex.worker_pids) == 2
        in_flight_at_send: list[int] = []
        send = ex.submit

        def counting_submit(step):
            in_flight_at_send.append(len(llm.core._in_flight))
            send(step)
        ex.submit = counting_submit
        out = token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
        assert llm.core.stats().num_preemptions > 0
        assert max(in_flight_at_send) == 1
    finally:
        llm.shutdown()
    assert_released(ex)
    assert out == reference


async def _stream_tokens(engine, prompt, params, request_id: str, on_token=None) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, params, request_id):
        tokens += out.outputs[0].token_ids
        if on_token is not None:
            on_token(len(tokens))
    return tokens


@pytest.mark.parametrize("stage", [0, 1])
def test_pp2_engine_loop_on_ray_serves_then_a_killed_stage_fails_in_flight(transport, stage, options,
                                                                           reference):
    """The server's engine loop (submit/collect, two steps in flight) gives the reference tokens;
    then kill -9 of one stage's actor mid-stream ends the stream with EngineDeadError (with
    stage 0 killed, stage 1 is left blocked in a receive from it: still no hang), the engine
    reports itself dead and shutdown removes the placement group."""
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.sampling_params import SamplingParams

    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)

    async def run():
        config = EngineConfig.from_options(pipeline_parallel_size=2, distributed_executor_backend="ray",
                                           **options)
        engine = AsyncEngine(config)
        await engine.start()
        ex = engine.parts.executor
        try:
            assert type(ex).__name__ == EXECUTOR_CLASS[transport] and ex.max_in_flight == 2
            async with asyncio.timeout(HANG_GUARD_S):
                served = await asyncio.gather(*(_stream_tokens(engine, p, GREEDY, f"r{i}")
                                                for i, p in enumerate(prompts())))
            killed = []

            def kill_after_three(n: int) -> None:
                if n >= 3 and not killed:
                    os.kill(ex.worker_pids[stage], signal.SIGKILL)
                    killed.append(n)
            with pytest.raises(EngineDeadError) as err:
                async with asyncio.timeout(HANG_GUARD_S):
                    await _stream_tokens(engine, prompts()[0], long, "victim", kill_after_three)
            assert killed and engine.health_status() == "dead"
        finally:
            await engine.shutdown()
        return ex, served, str(err.value)

    ex, served, error = asyncio.run(run())
    assert served == reference
    assert f"worker {stage}" in error, error
    assert_released(ex)


def test_two_replicas_on_ray_each_get_their_own_placement_group(options, reference):
    from pagedserve.engine.replicas import ReplicatedEngine

    before = {pg for pg, state in placement_states().items() if state != "REMOVED"}

    async def run():
        config = EngineConfig.from_options(distributed_executor_backend="ray", worker_threads=1, **options)
        engine = ReplicatedEngine(config, 2)
        await engine.start()
        executors = [r.parts.executor for r in engine.replicas]
        try:
            groups = [ex._placed.pg.id.hex() for ex in executors]
            async with asyncio.timeout(HANG_GUARD_S):
                outs = await asyncio.gather(*(_stream_tokens(engine, p, GREEDY, f"r{i}")
                                              for i, p in enumerate(prompts())))
            live = {pg for pg, state in placement_states().items() if state == "CREATED"} - before
            routed = list(engine.num_routed)
        finally:
            await engine.shutdown()
        return executors, groups, live, outs, routed

    executors, groups, live, outs, routed = asyncio.run(run())
    assert [type(ex).__name__ for ex in executors] == ["RayRingExecutor"] * 2
    assert len(set(groups)) == 2 and live == set(groups)  # one group each, both placed while serving
    assert min(routed) >= 1  # both replicas served
    assert outs == reference
    states = placement_states()
    assert all(states[g] == "REMOVED" for g in groups)
    for ex in executors:
        assert_released(ex)
