"""The GPU check's second call (issue 41, ``python -m pagedserve.loadtest.micro.gpu_check --set sizes``): the
decode step at the size GPU users serve, in bf16 and in FP8.

- ``decode_8b``: the Llama 3.1 8B shape (hidden 4096, 32 layers, 32/8 heads, head_dim 128, MLP
  14336, rope_theta 500000) with random bf16 weights (~15 GB of layer weights): the decode step with
  graphs and eager at batch 1/16/64/256 and context 1,024 against (layer weights + K/V bytes) /
  the copy bandwidth measured there.
- ``fp8_8b``: the same model under ``--quantization fp8`` (gpu/models/fp8.py: e4m3 weights per
  channel, activations per token, torch._scaled_mm): the same steps against its own floor (the
  layer weights at one byte each: about half the bf16 one), and greedy agreement with bf16 (the
  same random weights: same seed) over 8 prompts x 32 tokens, with the first position that
  differs; gating: every step ran, graphs captured, every decoder linear fp8, agreement >= 0.2 (a
  random model's logits are flat, so agreement is low even when right — 0.56 on the dry run's
  model — while a broken path agrees on ~0 of 49,152 tokens: a guard, not an accuracy claim).
The vocabulary is the carried tokenizer's (49,152, not Llama 3's 128,256): only the head and the
embedding differ, and neither is in the floor. In ``--dry-run`` (the CPU) both run a small model;
the fp8 one through the CPU's own torch._scaled_mm, the device check stood in for.
"""
from __future__ import annotations

import time

from pagedserve.loadtest.micro.gpu_check_common import (Ctx, Report, as_inputs, first_difference, greedy, random_prompts,
                                             tiny_options, token_ids)
from pagedserve.loadtest.micro.gpu_check_decode import _copy_bandwidth, layer_weight_bytes, time_decode_steps
from pagedserve.loadtest.tiny_model import TINY_CONFIG

# Llama 3.1 8B (meta-llama/Llama-3.1-8B config.json) but the carried tokenizer's vocabulary.
CONFIG_8B = {**TINY_CONFIG, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
             "max_position_embeddings": 131072}
DRY_CONFIG = {**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
AGREEMENT_FLOOR = 0.2


def _shape(ctx: Ctx) -> tuple[dict, list[int], int, str, int, int, int]:
    """(config, batches, context, dtype, repeats, prompts, tokens) for this run."""
    if ctx.dry_run:
        return DRY_CONFIG, [1, 4], 64, "bfloat16", 3, 4, 8
    return CONFIG_8B, [1, 16, 64, 256], 1024, "bfloat16", 20, 8, 32


def _options(ctx: Ctx, **over) -> dict:
    cfg, batches, context, dtype, *_ = _shape(ctx)
    blocks = max(batches) * -(-context // 16) + 64
    return {**tiny_options(ctx, hf_config=cfg, dtype=dtype, enforce_eager=False, cuda_graph_batch_sizes=batches,
                           num_gpu_blocks_override=blocks, max_model_len=2048), **over}


def _measure(ctx: Ctx, rep: Report, label: str, **over) -> tuple[list[list[int]], int]:
    """Load, time the decode steps against the floor; -> (greedy tokens of the fixed prompts, the
    number of fp8 layers)."""
    from pagedserve.engine.llm import LLM

    _, batches, context, dtype, repeats, n, tokens = _shape(ctx)
    bandwidth = _copy_bandwidth(ctx.device)
    rep.figure("copy bandwidth GB/s (read + write)", bandwidth / 1e9)
    t0 = time.perf_counter()
    with LLM(**_options(ctx, **over)) as llm:
        rep.figure(f"{label} start-up s (random weights, graphs)", time.perf_counter() - t0)
        runner = llm.parts.executor.runner
        model = runner.model
        weight_bytes = layer_weight_bytes(model)
        fp8_layers = sum(getattr(getattr(m, "qweight", None), "mode", None) == "fp8" for m in model.modules())
        rep.figure(f"{label} model", {"dtype": dtype, "layer_weight_bytes": weight_bytes, "fp8_layers": fp8_layers,
                                      "kv_bytes_per_token": runner.kv_bytes_per_block() // runner.block_size,
                                      "context": context})
        rows = time_decode_steps(ctx, rep, llm, batches, context, repeats, bandwidth, weight_bytes,
                                 label=f"{label} decode step")
        if not ctx.dry_run:
            rep.check(f"{label}: every batch size has a captured graph", all(r["graph_ms"] is not None for r in rows))
        else:
            rep.skip(f"{label} graph timings", "no CUDA device (dry run): the padded eager path is timed")
        rep.check(f"{label}: every step timed", all(r["eager_ms"] > 0 for r in rows))
        out = token_ids(llm.generate(as_inputs(random_prompts(n, 16, 64, seed=41)), greedy(tokens)))
    return out, fp8_layers


def phase_decode_8b(ctx: Ctx, rep: Report) -> None:
    _measure(ctx, rep, "bf16")


def _stand_in_for_fp8_gpu() -> None:
    """The dry run's CPU computes the fp8 path with its own torch._scaled_mm; the refusal of a
    real CPU serve is the refusals phase's and the suite's."""
    from pagedserve.kernels import fp8_linear

    fp8_linear.check_device = lambda device, capability=None: None


def phase_fp8_8b(ctx: Ctx, rep: Report) -> None:
    if ctx.dry_run:
        _stand_in_for_fp8_gpu()
    else:
        import torch

        major, minor = torch.cuda.get_device_capability()
        rep.figure("compute capability", f"{major}.{minor}")
    fp8_tokens, fp8_layers = _measure(ctx, rep, "fp8", quantization="fp8")
    cfg = _shape(ctx)[0]
    rep.check("fp8: every decoder linear is fp8", fp8_layers == 4 * cfg["num_hidden_layers"], layers=fp8_layers)
    bf16_tokens, _ = _reference(ctx, rep)
    same = total = 0
    for a, b in zip(bf16_tokens, fp8_tokens):
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    agreement = same / max(total, 1)
    rep.figure("greedy agreement fp8 vs bf16", {"same_positions": agreement,
                                                "first_difference": first_difference(fp8_tokens, bf16_tokens)})
    rep.check(f"greedy agreement fp8 vs bf16 >= {AGREEMENT_FLOOR}", agreement >= AGREEMENT_FLOOR,
              agreement=agreement)


def _reference(ctx: Ctx, rep: Report):
    """The bf16 model's greedy tokens (same seed, so the same weights before quantization), eager:
    only the tokens are needed."""
    from pagedserve.engine.llm import LLM

    *_, n, tokens = _shape(ctx)
    t0 = time.perf_counter()
    with LLM(**_options(ctx, enforce_eager=True)) as llm:
        out = token_ids(llm.generate(as_inputs(random_prompts(n, 16, 64, seed=41)), greedy(tokens)))
    rep.figure("bf16 reference s", time.perf_counter() - t0)
    return out, None
