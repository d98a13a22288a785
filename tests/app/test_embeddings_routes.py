"""POST /v1/embeddings and /v1/score, /score against the fake engine: OpenAI's request shapes
and response body, base64 = float32 little-endian bytes, dimensions, usage, and the errors."""
from __future__ import annotations

import base64
import struct

import httpx
import pytest

from pagedserve.app.server import build_app
from pagedserve.engine.pooling_params import PoolingParams
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine


def vector(ids: list[int], **params) -> list[float]:
    return FakeAsyncEngine.fake_vector(ids, PoolingParams(**params))


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-6 for x, y in zip(a, b))


async def test_one_string_gives_one_float_embedding_and_usage(client, engine):
    r = await client.post("/v1/embeddings", json={"input": "hello", "model": "fake-model"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "fake-model" and body["id"].startswith("embd-")
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    [item] = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    assert close(item["embedding"], vector(list(b"hello")))
    [call] = engine.calls
    assert call.params == PoolingParams() and call.prompt == "hello"


@pytest.mark.parametrize("inp, expected_ids", [
    (["ab", "cde"], [list(b"ab"), list(b"cde")]),
    ([104, 105], [[104, 105]]),
    ([[104], [105, 106, 107.0]], [[104], [105, 106, 107]]),
])
async def test_input_shapes(client, engine, inp, expected_ids):
    r = await client.post("/v1/embeddings", json={"input": inp})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(expected_ids)))
    for d, ids in zip(data, expected_ids):
        assert close(d["embedding"], vector(ids))
    assert [c.prompt_token_ids for c in engine.calls] == expected_ids
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, expected_ids))


async def test_base64_is_float32_little_endian(client):
    r = await client.post("/v1/embeddings", json={"input": ["hi", "there"], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    for d, text in zip(r.json()["data"], ["hi", "there"]):
        raw = base64.b64decode(d["embedding"])
        values = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert close(values, vector(list(text.encode())))


async def test_dimensions_and_pooling_options_reach_the_engine(client, engine):
    r = await client.post("/v1/embeddings", json={"input": "hello", "dimensions": 3, "pooling_type": "mean"})
    assert r.status_code == 200, r.text
    emb = r.json()["data"][0]["embedding"]
    assert len(emb) == 3 and abs(sum(v * v for v in emb) - 1) < 1e-6
    assert engine.calls[0].params == PoolingParams(pooling_type="mean", dimensions=3)
    r = await client.post("/v1/embeddings", json={"input": "hello", "normalize": False})
    assert engine.calls[1].params == PoolingParams(normalize=False)
    assert close(r.json()["data"][0]["embedding"], vector(list(b"hello"), normalize=False))


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [""]}, "input"),
    ({"input": [[]]}, "input"), ({"input": [300]}, "input"), ({"input": 5}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "dimensions": "3"}, "dimensions"),
    ({"input": "x", "pooling_type": "max"}, "pooling_type"), ({}, "input"),
])
async def test_bad_bodies_are_400s_naming_the_field(client, engine, body, param):
    assert_openai_error(await client.post("/v1/embeddings", json=body), 400, param)
    assert engine.calls == []


async def test_input_over_the_context_is_a_400(client, engine):
    # the fake engine's context is 128 tokens; one byte is one token; an input may use it all
    assert (await client.post("/v1/embeddings", json={"input": "x" * 128})).status_code == 200
    err = assert_openai_error(await client.post("/v1/embeddings", json={"input": ["ok", "x" * 129]}),
                              400, "input")
    assert err["code"] == "context_length_exceeded" and "129 tokens" in err["message"]
    assert len(engine.calls) == 1  # nothing of the refused request was submitted


async def test_unknown_model_is_a_404_after_the_body(client):
    assert_openai_error(await client.post("/v1/embeddings", json={"input": "x", "model": "other"}), 404, "model")
    assert_openai_error(await client.post("/v1/embeddings", json={"input": "", "model": "other"}), 400, "input")


async def test_refusals_and_engine_errors(client, engine):
    engine.overloaded = True
    r = await client.post("/v1/embeddings", json={"input": "x"})
    assert_openai_error(r, 503)
    assert "retry-after" in r.headers
    engine.overloaded = False
    engine.reject = "dimensions is 9 but the model's embeddings have 8 values"
    assert_openai_error(await client.post("/v1/embeddings", json={"input": "x", "dimensions": 9}), 400)
    engine.reject = None
    engine.pool_error = "worker failed"
    err = assert_openai_error(await client.post("/v1/embeddings", json={"input": "x"}), 500)
    assert err["code"] == "engine_error" and "worker failed" in err["message"]


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
async def test_score_one_against_many_is_the_embedding_cosine(client, path):
    r = await client.post(path, json={"text_1": "abc", "text_2": ["abc", "xyz", "ab"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    q = vector(list(b"abc"))
    expected = [sum(x * y for x, y in zip(q, vector(list(t)))) for t in (b"abc", b"xyz", b"ab")]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in body["data"])
    assert all(abs(d["score"] - e) < 1e-5 for d, e in zip(body["data"], expected))
    assert abs(body["data"][0]["score"] - 1.0) < 1e-5
    assert body["usage"]["prompt_tokens"] == 3 + 3 + 3 + 2


async def test_score_pairs_and_bad_pairs(client):
    r = await client.post("/v1/score", json={"text_1": ["ab", "cd"], "text_2": ["ab", "ef"]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    assert abs(r.json()["data"][0]["score"] - 1.0) < 1e-5
    r = await client.post("/v1/score", json={"text_1": "x", "text_2": "x"})
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    assert_openai_error(await client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
                        400, "text_2")
    assert_openai_error(await client.post("/v1/score", json={"text_1": "", "text_2": "a"}), 400, "text_1")
    assert_openai_error(await client.post("/v1/score", json={"text_1": "a"}), 400, "text_2")


async def test_score_is_behind_the_api_key():
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", api_key="sk-x")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        for path in ("/score", "/v1/score", "/v1/embeddings"):
            assert (await c.post(path, json={"text_1": "a", "text_2": "b", "input": "a"})).status_code == 401
            ok = await c.post(path, json={"text_1": "a", "text_2": "b", "input": "a"},
                              headers={"Authorization": "Bearer sk-x"})
            assert ok.status_code == 200, ok.text
