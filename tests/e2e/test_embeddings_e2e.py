"""/v1/embeddings and /v1/score on a real `pagedserve serve` process (tiny random model), driven by
the official openai client (base64 by default) and raw HTTP; embeddings alongside a streaming
generation leave its tokens unchanged."""
from __future__ import annotations

import base64
import math
import struct
import threading

import httpx
import pytest

from tests.e2e.test_server_e2e import MAX_MODEL_LEN, ServerProcess


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.stop() == 0, s.output()


def test_openai_client_embeddings_round_trip(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b"]
    r = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1] and r.model == "tiny"
    floats = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"},
                        timeout=60).json()
    for got, want in zip(r.data, floats["data"]):
        assert len(got.embedding) == len(want["embedding"]) == 64
        assert all(abs(a - b) < 1e-6 for a, b in zip(got.embedding, want["embedding"]))
        assert abs(math.fsum(x * x for x in got.embedding) - 1) < 1e-4
    assert r.usage.prompt_tokens == floats["usage"]["prompt_tokens"] == r.usage.total_tokens > 0

    raw = httpx.post(server.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"},
                     timeout=60).json()["data"][0]["embedding"]
    data = base64.b64decode(raw)
    values = struct.unpack(f"<{len(data) // 4}f", data)
    assert all(abs(a - b) < 1e-6 for a, b in zip(values, floats["data"][0]["embedding"]))

    short = client.embeddings.create(model="tiny", input=texts[0], dimensions=8, encoding_format="float")
    assert len(short.data[0].embedding) == 8
    ids = client.embeddings.create(model="tiny", input=[[100, 200, 300], [5]])
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 4


def test_errors_are_openai_errors(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input=[[100] * (MAX_MODEL_LEN + 1)])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input="x", dimensions=65)  # the model has 64
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    assert httpx.post(server.url + "/v1/embeddings", json={"input": [[100] * MAX_MODEL_LEN]},
                      timeout=60).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_score_routes(server):
    for path in ("/v1/score", "/score"):
        r = httpx.post(server.url + path, json={"model": "tiny", "text_1": "hello there",
                                                "text_2": ["hello there", "goodbye"]}, timeout=60)
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in r.json()["data"]]
        assert abs(scores[0] - 1) < 1e-4 and -1 <= scores[1] < scores[0]


def test_embeddings_beside_a_streaming_generation(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=48, temperature=0)
    alone = client.completions.create(**kw).choices[0].text
    stop = threading.Event()
    vectors = []

    def embed_loop():
        while not stop.is_set():
            vectors.append(client.embeddings.create(model="tiny", input=["some text to embed " * 20] * 4))

    t = threading.Thread(target=embed_loop)
    t.start()
    try:
        text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    finally:
        stop.set()
        t.join(60)
    assert text == alone
    assert vectors and all(len(v.data) == 4 for v in vectors)
