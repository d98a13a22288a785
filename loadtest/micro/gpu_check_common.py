"""Pieces the GPU check's phases share (loadtest/micro/gpu_check.py and the phases kept in modules of
their own, so those import no circle through the runner): greedy params, random prompts, options
of the tiny random model, comparing token lists."""
from __future__ import annotations

import random

from loadtest.tiny_model import TINY_CONFIG


def greedy(max_tokens: int, **extra):
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def tiny_options(ctx, **over) -> dict:
    """LLM / serve options for a random-weight model over the carried tokenizer (``ctx``: the phase's Ctx)."""
    return {"model": ctx.model_dir, "load_format": "dummy", "hf_config": TINY_CONFIG, "dtype": "float32",
            "device": ctx.device, "num_gpu_blocks_override": 1024, **over}


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return {"prompt": i, "position": at, "got": x[at:at + 4], "want": y[at:at + 4]}
    return None if len(a) == len(b) else {"lengths": [len(a), len(b)]}
