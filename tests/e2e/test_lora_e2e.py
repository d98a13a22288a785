"""Multi-LoRA through the server: the real engine (a tiny random Llama and peft-made adapters)
behind the real app, driven by the official openai client over ASGI (no port)."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.app.lora_adapters import LoRAModule
from pagedserve.app.server import build_app
from pagedserve.contracts.config import ConfigError, EngineConfig
from pagedserve.engine.async_engine import AsyncEngine
from tests.lora_fixtures import peft_model, reference_greedy, save_adapter, save_base

KEY = "sekret"
PROMPT = [1, 520, 3311, 42, 9001, 77, 1204, 5, 88, 301]
N = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    base = save_base(root / "base")
    a = save_adapter(base, root / "ada", r=8, alpha=16, seed=5)
    b = save_adapter(base, root / "adb", r=4, alpha=8, seed=6, targets=["q_proj", "down_proj"])
    refs = {"tiny": reference_greedy(base, PROMPT, N)[0], "ada": reference_greedy(peft_model(base, a), PROMPT, N)[0],
            "adb": reference_greedy(peft_model(base, b), PROMPT, N)[0]}
    return root, refs


async def _engine(root) -> AsyncEngine:
    config = EngineConfig.from_options(model=str(root / "base"), dtype="float32", max_model_len=2048,
                                       num_gpu_blocks_override=128, served_model_name="tiny", executor="inproc",
                                       enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = AsyncEngine(config)
    await engine.start()
    return engine


def _client(app, key: str | None = KEY) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key=key or "none", http_client=http, max_retries=0)


async def _tokens(client, model: str) -> list[int]:
    r = await client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                        logprobs=0)
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


async def test_adapters_by_model_name_listing_and_runtime_load_unload(files):
    root, refs = files
    engine = await _engine(root)
    try:
        app = build_app(engine, served_model_name="tiny", api_key=KEY, allow_runtime_lora_updating=True,
                        lora_roots=[str(root)], lora_modules=[LoRAModule("ada", str(root / "ada"))])
        client = _client(app)
        from openapi_spec_validator import validate as validate_openapi

        doc = (await httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
               .get("/openapi.json")).json()
        validate_openapi(doc)
        assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(doc["paths"])
        cards = {m.id: m for m in (await client.models.list()).data}
        assert set(cards) == {"tiny", "ada"}
        assert cards["ada"].parent == "tiny" and cards["tiny"].parent is None
        assert await _tokens(client, "tiny") == refs["tiny"]
        assert await _tokens(client, "ada") == refs["ada"]
        with pytest.raises(openai.NotFoundError) as e:
            await _tokens(client, "adb")
        assert e.value.body["code"] == "model_not_found"

        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"lora_name": "adb", "lora_path": str(root / "adb")}
        assert (await raw.post("/v1/load_lora_adapter", json=body)).status_code == 401  # behind --api-key
        r = await raw.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert (await raw.post("/v1/load_lora_adapter", json=body, headers=auth)).status_code == 400  # loaded
        assert await _tokens(client, "adb") == refs["adb"]
        assert {m.id for m in (await client.models.list()).data} == {"tiny", "ada", "adb"}

        r = await raw.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "base")},
                           headers=auth)
        # one answer for every refused path (which rule it broke is in the server log only)
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_path_refused"
        r = await raw.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=auth)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and set(r.json()["error"]) == {
            "message", "type", "param", "code"}

        # In use: unloading is refused while a request of the adapter runs, which is unharmed. (The
        # request is started on the engine itself: httpx's ASGI transport reads whole responses.)
        from pagedserve.engine.sampling_params import SamplingParams

        lora = app.state.server.checks.adapters.by_name["adb"]
        stream = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), "busy",
                                 lora_request=lora)
        r = await raw.post("/v1/unload_lora_adapter", json={"lora_name": "adb"}, headers=auth)
        assert r.status_code == 409 and "in use by 1 request" in r.json()["error"]["message"]
        info = [s for f in text_string_to_metric_families((await raw.get("/metrics")).text) for s in f.samples
                if s.name == "pagedserve:lora_requests_info"]
        assert len(info) == 1 and info[0].labels["max_lora"] == "2"
        assert "adb" in info[0].labels["running_lora_adapters"] + info[0].labels["waiting_lora_adapters"]
        tokens = [t async for out in stream for t in out.outputs[0].token_ids]
        assert tokens == refs["adb"]

        r = await raw.post("/v1/unload_lora_adapter", json={"lora_name": "adb"}, headers=auth)
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            await _tokens(client, "adb")
        assert await _tokens(client, "ada") == refs["ada"]  # the other adapter is untouched
        await raw.aclose()
    finally:
        await engine.shutdown()


async def test_runtime_updates_off_by_default_and_bad_modules_refused_at_start(files):
    root, _ = files
    engine = await _engine(root)
    try:
        app = build_app(engine, served_model_name="tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as raw:
            r = await raw.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "ada")})
            assert r.status_code == 404 and r.json()["error"]["message"] == "Not found: /v1/load_lora_adapter"
            assert "/v1/load_lora_adapter" not in (await raw.get("/openapi.json")).json()["paths"]
        with pytest.raises(ConfigError, match="--lora-modules gone: .*not a directory"):
            build_app(engine, served_model_name="tiny", lora_modules=[LoRAModule("gone", str(root / "nowhere"))])
    finally:
        await engine.shutdown()


def test_lora_modules_parse_both_forms():
    from pagedserve.app.lora_adapters import parse_lora_module

    assert parse_lora_module("a=/x/y") == LoRAModule("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == LoRAModule("a", "/x", "m")
    for bad in ("a", '{"name": 1, "path": "/x"}', '{"name": "a", "path": "/x", "rank": 2}', "{oops"):
        with pytest.raises(ConfigError, match="--lora-modules"):
            parse_lora_module(bad)
