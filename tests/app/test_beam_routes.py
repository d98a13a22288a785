"""use_beam_search over HTTP, on a real AsyncEngine with a tiny random model: the choices are the
beams LLM.beam_search finds (best first, n of best_of), on /v1/completions and
/v1/chat/completions; streaming and the fields beam search cannot honour are 400s."""
from __future__ import annotations

import httpx
import pytest

from pagedserve.app.server import build_app
from pagedserve.engine.sampling_params import BeamSearchParams
from tests.app.conftest import assert_openai_error
from tests.tiny import TINY_CONFIG

PROMPT = "The quick brown fox"


def tiny_options() -> dict:
    from pagedserve.contracts.config import default_model_path

    return {"model": default_model_path(), "load_format": "dummy", "hf_config": TINY_CONFIG, "dtype": "float32",
            "kv_cache_memory": 1 / 16, "executor": "inproc"}


@pytest.fixture(scope="module")
def expected():
    from pagedserve.engine.llm import LLM

    llm = LLM(**{k: v for k, v in tiny_options().items() if k != "model"}, model=tiny_options()["model"])
    try:
        out = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
        chat_prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
        chat = llm.beam_search([{"prompt": chat_prompt, "add_special_tokens": False}],
                               BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))[0]
    finally:
        llm.shutdown()
    return out, chat


@pytest.fixture
async def client():
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.contracts.config import EngineConfig

    engine = AsyncEngine(EngineConfig.from_options(**tiny_options()))
    await engine.start()
    app = build_app(engine, served_model_name="tiny", max_body_bytes=1 << 16)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c, engine
    finally:
        await engine.shutdown()


async def test_completions_and_chat_return_the_best_beams(client, expected):
    c, engine = client
    out, chat = expected
    r = await c.post("/v1/completions", json={"prompt": PROMPT, "use_beam_search": True, "n": 2, "best_of": 3,
                                              "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert [ch["text"] for ch in body["choices"]] == [s.output_text for s in out.sequences[:2]]
    assert all(ch["finish_reason"] == "length" for ch in body["choices"])
    assert body["usage"]["completion_tokens"] == 12
    r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                   "use_beam_search": True, "n": 2, "max_tokens": 5,
                                                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [ch["message"]["content"] for ch in r.json()["choices"]] == [s.output_text for s in chat.sequences]
    bm = engine.core.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
    ({"top_p": 0.5}, "top_p"), ({"n": 3, "best_of": 2}, "best_of"),
])
async def test_what_beam_search_cannot_honour_is_a_400(extra, param):
    from tests.app.fake_engine import FakeAsyncEngine

    engine = FakeAsyncEngine()
    app = build_app(engine, served_model_name="fake-model", max_body_bytes=4096)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "use_beam_search": True, **extra})
    assert_openai_error(r, 400, param)
    assert engine.calls == []
