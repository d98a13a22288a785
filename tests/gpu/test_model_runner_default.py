"""The default model driven by hand through the model runner (prefill, then decode steps over the
paged cache) generates exactly what Hugging Face transformers generates, greedy, fp32."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve.contracts.config import EngineConfig
from pagedserve.gpu.batch import BatchRequest
from pagedserve.gpu.model_runner import ModelRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
]
NEW_TOKENS = 32
BLOCK = 16


@pytest.fixture(scope="module")
def hf_reference(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(default_model_path), os.path.basename(default_model_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def runner(default_model_path):
    from pagedserve.engine.bootstrap import resolve_config

    config, _ = resolve_config(EngineConfig.from_options(
        model=default_model_path, dtype="float32", quantization="none", num_gpu_blocks_override=64, block_size=BLOCK,
        enforce_eager=True))  # unpacked: the chunking checks compare exact fp32 arithmetic
    r = ModelRunner(config)
    r.initialize()
    return r


def hf_greedy(tok, model, prompt: str) -> tuple[list[int], list[int]]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()  # ends early at EOS


def test_greedy_matches_transformers_token_for_token(runner, hf_reference):
    tok, model = hf_reference
    refs = [hf_greedy(tok, model, p) for p in PROMPTS]

    # Hand-made block tables: each sequence gets its own blocks, enough for prompt + output.
    next_block = 1
    tables = []
    for prompt_ids, _ in refs:
        need = -(-(len(prompt_ids) + NEW_TOKENS) // BLOCK)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need

    # Prefill all prompts in one mixed batch; then decode all sequences together.
    logits = runner.forward([BatchRequest(p, 0, t) for (p, _), t in zip(refs, tables)])
    generated = [[int(x)] for x in logits.argmax(-1)]
    for step in range(NEW_TOKENS - 1):
        batch = [BatchRequest([g[-1]], len(p) + len(g) - 1, t) for (p, _), g, t in zip(refs, generated, tables)]
        for g, token in zip(generated, runner.forward(batch).argmax(-1).tolist()):
            g.append(token)

    for (prompt_ids, expected), got, text in zip(refs, generated, PROMPTS):
        got = got[:len(expected)]  # HF stops at EOS; we decoded on past it
        assert got == expected, f"prompt {text!r}: ours {tok.decode(got)!r} vs HF {tok.decode(expected)!r}"
    assert tok.decode(generated[0]).startswith(" Paris.")


def test_two_chunk_prefill_equals_one_chunk(runner, hf_reference):
    tok, _ = hf_reference
    ids = tok("A long prompt that will be processed in two chunks across a block boundary, "
              "so the second chunk reads the first chunk's keys from the paged cache.").input_ids
    table = [40, 41, 42, 43]
    whole = runner.forward([BatchRequest(ids, 0, table)])
    cut = 13
    runner.forward([BatchRequest(ids[:cut], 0, [50, 51, 52, 53])])
    chunked = runner.forward([BatchRequest(ids[cut:], cut, [50, 51, 52, 53])])
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
