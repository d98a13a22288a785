"""cache_salt end to end: the real engine (tiny random Llama) behind the real app, over HTTP/ASGI.

Equal prompts share prefix-cache blocks only when their salts are equal (or both absent); the
figure comes from the server's own /metrics (pagedserve:prefix_cache_hits_total)."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.app.server import build_app
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.contracts.config import EngineConfig, default_model_path
from tests.tiny import TINY_CONFIG

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several full blocks of 16 tokens


async def prefix_hits(c: httpx.AsyncClient) -> float:
    for family in text_string_to_metric_families((await c.get("/metrics")).text):
        for s in family.samples:
            if s.name == "pagedserve:prefix_cache_hits_total":
                return s.value
    raise AssertionError("no prefix_cache_hits_total in /metrics")


async def test_equal_prompts_hit_the_cache_only_with_equal_salts():
    config = EngineConfig.from_options(
        model=default_model_path(), load_format="dummy", hf_config=TINY_CONFIG, dtype="float32",
        max_model_len=512, num_gpu_blocks_override=128, served_model_name="tiny", executor="inproc")
    engine = AsyncEngine(config)
    await engine.start()
    try:
        app = build_app(engine, served_model_name="tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            async def run(salt: str | None, chat: bool = False) -> float:
                before = await prefix_hits(c)
                extra = {} if salt is None else {"cache_salt": salt}
                if chat:
                    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, **extra}
                    r = await c.post("/v1/chat/completions", json=body)
                else:
                    r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra})
                assert r.status_code == 200, r.text
                return await prefix_hits(c) - before

            assert await run("alice") == 0
            assert await run("bob") == 0  # same prompt, another tenant: nothing shared
            assert await run(None) == 0
            assert await run("alice") > 0
            assert await run("bob") > 0
            assert await run(None) > 0
            assert await run("carol", chat=True) == 0
            assert await run("alice", chat=True) == 0  # another prompt (the chat template)
            assert await run("carol", chat=True) > 0
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "cache_salt": ""})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    finally:
        await engine.shutdown()


def test_offline_llm_takes_cache_salt_in_the_prompt_dict():
    from pagedserve.engine.sampling_params import SamplingParams
    from tests.tiny import tiny_llm

    with tiny_llm(max_model_len=512) as llm:
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def cached(salt: str | None) -> int:
            prompt = {"prompt": PROMPT} if salt is None else {"prompt": PROMPT, "cache_salt": salt}
            return llm.generate(prompt, params)[0].num_cached_tokens

        assert [cached(s) for s in ("a", "b", None)] == [0, 0, 0]
        assert all(cached(s) > 0 for s in ("a", "b", None))
