"""Speculative decoding over HTTP: the flag, a real AsyncEngine with ngram drafts (greedy text as
without them, metrics counted), beam search refused with a 400 in OpenAI's error format."""
from __future__ import annotations

import argparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
from pagedserve.app.server import build_app
from pagedserve.contracts.config import ConfigError
from tests.app.conftest import assert_openai_error
from tests.app.test_beam_routes import tiny_options
from tests.tiny import TINY_CONFIG

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PROMPT = [3, 4, 5, 6, 7] * 4  # token ids of a 16-token vocabulary: drafts are proposed at almost every step
SMALL = dict(TINY_CONFIG, vocab_size=16)


def small_options() -> dict:
    return dict(tiny_options(), hf_config=SMALL)


def parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_flag_takes_vllm_json():
    config = engine_config_from_args(parse(["--speculative-config", NGRAM]))
    spec = config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (
        "ngram", 3, 3, 1)
    assert engine_config_from_args(parse([])).speculative is None
    with pytest.raises(ConfigError, match="speculative-config"):
        engine_config_from_args(parse(["--speculative-config", '{"method": "medusa"}']))


@pytest.fixture
async def client():
    from pagedserve.contracts.config import EngineConfig
    from pagedserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig.from_options(**small_options(), speculative_config=NGRAM))
    await engine.start()
    app = build_app(engine, served_model_name="tiny", max_body_bytes=1 << 16)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c, engine
    finally:
        await engine.shutdown()


async def test_greedy_text_as_without_speculation_and_metrics(client):
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    c, engine = client
    # The special tokens' text (ids below 16) stands for the ids.
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    opts = small_options()
    llm = LLM(**{k: v for k, v in opts.items() if k != "model"}, model=opts["model"])
    try:
        want = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, skip_special_tokens=False), use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    assert len(want) > 40 and r.json()["choices"][0]["text"] == want
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    text = (await c.get("/metrics")).text
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    m = (("model_name", "tiny"),)
    assert values[("pagedserve:spec_decode_num_draft_tokens_total", m)] == stats.spec_decode_num_draft_tokens
    assert values[("pagedserve:spec_decode_num_accepted_tokens_total", m)] == stats.spec_decode_num_accepted_tokens
    assert values[("pagedserve:spec_decode_num_drafts_total", m)] == stats.spec_decode_num_drafts
    per_pos = [values.get(("pagedserve:spec_decode_num_accepted_tokens_per_pos_total",
                           (("model_name", "tiny"), ("position", str(p)))))
               for p in range(len(stats.spec_decode_num_accepted_tokens_per_pos))]
    assert per_pos == stats.spec_decode_num_accepted_tokens_per_pos


async def test_beam_search_with_speculation_is_a_400(client):
    c, engine = client
    r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, "n": 2})
    err = assert_openai_error(r, 400)
    assert "speculative decoding" in err["message"]
