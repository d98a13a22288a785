"""The default model's embeddings equal transformers' pooled hidden states after the final norm
(``last_hidden_state``), fp32, for each pooling type; also when the prompt is prefilled in
chunks and with Matryoshka truncation."""
from __future__ import annotations

import math
import os

import pytest
import torch

from pagedserve.engine.pooling_params import PoolingParams

TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 4,
]


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def hf_hidden(default_model_path):
    """Per text: its token ids and transformers' last_hidden_state [T, hidden] in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(default_model_path), os.path.basename(default_model_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text, return_tensors="pt").input_ids
            out.append((ids[0].tolist(), model.model(input_ids=ids).last_hidden_state[0]))
    return out


def hf_pooled(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]


@pytest.fixture(scope="module")
def llm():
    from pagedserve.engine.llm import LLM

    # Weights dequantized to fp32 as transformers loads them; chunks of 32 tokens per step.
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory=0.25, max_num_batched_tokens=32)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_embeddings_equal_transformers_pooled_hidden_states(llm, hf_hidden, kind):
    prompts = [{"prompt_token_ids": ids} for ids, _ in hf_hidden]
    assert len(hf_hidden[2][0]) > 2 * 32  # the long one is prefilled in several chunks
    raw = llm.embed(prompts, PoolingParams(pooling_type=kind, normalize=False))
    unit = llm.embed(prompts, PoolingParams(pooling_type=kind))
    for (ids, hidden), r, u in zip(hf_hidden, raw, unit):
        want = hf_pooled(hidden, kind)
        got = torch.tensor(r.outputs.embedding)
        assert cosine(got, want) > 0.9999, (kind, len(ids))
        assert abs(float(got.norm() / want.norm()) - 1) < 1e-3  # unnormalised: the same scale
        assert cosine(u.outputs.embedding, want) > 0.9999
        assert abs(math.fsum(x * x for x in u.outputs.embedding) - 1) < 1e-5


def test_text_prompts_and_dimensions(llm, hf_hidden):
    # the text is tokenized as transformers does; dimensions truncate then renormalise
    out = llm.embed(TEXTS[0], PoolingParams(dimensions=64))[0].outputs.embedding
    want = hf_pooled(hf_hidden[0][1], "last")[:64]
    assert len(out) == 64 and cosine(out, want) > 0.9999
    assert abs(math.fsum(x * x for x in out) - 1) < 1e-5


def test_related_texts_score_higher(llm):
    scores = [s.outputs.score for s in llm.score("The capital of France is Paris.",
                                                 ["Paris is the capital city of France.",
                                                  "def add(a, b): return a + b"])]
    assert scores[0] > scores[1]
