"""The engine loop and structured outputs: a running stream keeps getting tokens while another
request's grammar compiles, and the finished compile wakes the loop itself (the idle health
check is pushed out of reach, so nothing else could)."""
from __future__ import annotations

import asyncio
import json
import threading

import jsonschema

from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.tiny import TINY_CONFIG

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


async def test_compile_runs_beside_a_stream_and_wakes_the_loop(monkeypatch):
    import pagedserve.engine.engine_loop as loop_module
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.contracts.config import EngineConfig, default_model_path

    monkeypatch.setattr(loop_module, "IDLE_HEALTH_CHECK_S", 3600.0)
    config = EngineConfig.from_options(model=default_model_path(), load_format="dummy",
                                       hf_config=TINY_CONFIG, dtype="float32",
                                       kv_cache_memory=1 / 16, executor="inproc",
                                       grammar_compile_timeout=120)  # held on purpose; a busy box is slow
    engine = AsyncEngine(config)
    await engine.start()
    try:
        backend = engine.core.constraints.manager.backend
        release = threading.Event()
        real_compile = backend.compile

        def slow_compile(grammar):
            assert release.wait(60)
            return real_compile(grammar)

        backend.compile = slow_compile
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
        # Off the loop; the spec is valid, and the check waits (within --grammar-compile-timeout)
        # for the compile, which is held until the free stream has run.
        checking = asyncio.create_task(engine.check_constraint(params))
        free = engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "free")
        constrained = engine.generate([1, 4, 5], params, "json")
        got = 0
        async for out in free:  # the whole free stream runs while the grammar is still compiling
            got += len(out.outputs[0].token_ids)
        assert got == 6 and engine.core.constraints.compiling
        assert not checking.done()
        release.set()  # from now on only the compile's own wake-up can restart the idle loop
        text, finish = "", None
        async with asyncio.timeout(60):
            async for out in constrained:
                text += out.outputs[0].text
                finish = out.outputs[0].finish_reason or finish
        assert finish == "stop"
        await checking
        jsonschema.validate(json.loads(text), SCHEMA)
        backend.compile = real_compile
    finally:
        await engine.shutdown()
