"""Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE through the whole engine: greedy tokens (32 a prompt, 8 prompts
longer than the sliding window, sharing a prefix) equal transformers' greedy tokens, with
chunked prefill (a 24-token step budget) and prefix caching on, run twice so that the second
round's prompts hit the prefix cache."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.sampling_params import SamplingParams
from tests.gpu.test_model_families import FAMILIES
from tests.gpu.test_moe import MOE
from tests.gpu.test_models import save_hf_model

VOCAB, NEW_TOKENS = 256, 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]  # three 8-token blocks: prefix-cache hits
    return [(shared if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(9, 40))]
            for i in range(8)]


def reference_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, each from a full forward over the whole sequence (no cache)."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


CONFIGS = {**{k: FAMILIES[k] for k in ("gemma2", "gemma3", "phi3")}, "qwen3moe": MOE["qwen3moe"]}


def checkpoint(name: str, path) -> tuple[object, list[list[int]]]:
    """(the transformers model saved at ``path`` with a tokenizer, its greedy tokens per prompt)."""
    from pagedserve.engine.tokenizer import Tokenizer

    cfg = dict(CONFIGS[name], vocab_size=VOCAB)
    if "original_max_position_embeddings" in cfg:
        # Sequences stay within LongRoPE's original length: past it transformers re-rotates the whole
        # sequence with the long factors, which no KV cache does (test_model_families checks the table).
        cfg.update(max_position_embeddings=512, original_max_position_embeddings=128,
                   rope_parameters=dict(cfg["rope_parameters"], original_max_position_embeddings=128))
    ref = save_hf_model(cfg, path, seed=4)
    Tokenizer.from_model()._tok.save(str(path / "tokenizer.json"))
    want = [reference_greedy(ref, p) for p in prompts()]
    assert len({tuple(t) for t in want}) == len(want)  # distinct continuations: a real check
    return ref, want


ENGINE = dict(dtype="float32", kv_cache_memory=1 / 16, block_size=8, max_num_batched_tokens=24,
              enable_prefix_caching=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_greedy_equals_transformers(name, tmp_path):
    from pagedserve.engine.llm import LLM

    _, want = checkpoint(name, tmp_path)
    llm = LLM(model=str(tmp_path), executor="inproc", **ENGINE)
    try:
        for _ in range(2):
            got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
            assert got == want
        assert llm.core.stats().prefix_cache_hits > 0
    finally:
        llm.shutdown()


def test_tensor_parallel_2_engine_greedy_equals_transformers(tmp_path):
    """Gemma 2 (soft-caps, windows) on two worker processes, each with half the heads."""
    from pagedserve.engine.llm import LLM
    from tests.gpu.test_mp_equivalence import shutdown_clean

    _, want = checkpoint("gemma2", tmp_path)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, **ENGINE)
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        assert got == want
    finally:
        shutdown_clean(llm)
