"""The GPU check's ``model`` and ``graphs`` phases (loadtest/micro/gpu_check.py): a random Llama
against transformers, and greedy tokens with CUDA graphs against eager at many batch sizes."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from pagedserve.loadtest.micro.gpu_check_common import (Ctx, Report, as_inputs, decode_run, first_difference, gpu_memory,
                                             greedy, random_prompts, tiny_options, token_ids)
from pagedserve.loadtest.tiny_model import TINY_CONFIG


def _save_hf_llama(path: Path, cfg: dict, tokenizer_dir: str, seed: int = 0):
    """A transformers Llama with random weights (norms randomised too) saved as safetensors beside
    the carried tokenizer; returns it in fp32 eval mode."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), path / name)
    model.generation_config.eos_token_id = None  # ours ignores EOS: so does the reference
    model.generation_config.pad_token_id = 0
    return model


def phase_model(ctx: Ctx, rep: Report) -> None:
    import torch

    from pagedserve.engine.llm import LLM

    dry = ctx.dry_run
    n_prompts, n_tokens = (3, 12) if dry else (8, 48)
    cfg = {**TINY_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2 if dry else 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    prompts = random_prompts(n_prompts, 20, 90, seed=7)
    with tempfile.TemporaryDirectory(prefix="gpu-check-llama-") as tmp:
        ref = _save_hf_llama(Path(tmp), cfg, ctx.model_dir).to(ctx.device)
        with torch.inference_mode():
            ref_logprobs = [ref(torch.tensor([p], device=ctx.device)).logits[0].float().log_softmax(-1).cpu()
                            for p in prompts]
            want = [ref.generate(torch.tensor([p], device=ctx.device), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long, device=ctx.device), do_sample=False, max_new_tokens=n_tokens,
                                 min_new_tokens=n_tokens)[0, len(p):].tolist() for p in prompts]
        del ref
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
        common = {"model": tmp, "device": ctx.device, "num_gpu_blocks_override": 512, "max_num_batched_tokens": 32,
                  "cuda_graph_batch_sizes": [1, 2, 4, 8]}
        # Eager, fp32: prompt logprobs with prefill in chunks of 32 tokens, then greedy tokens.
        with LLM(dtype="float32", enforce_eager=True, **common) as llm:
            outs = llm.generate(as_inputs(prompts), greedy(1, prompt_logprobs=5))
            worst = 0.0
            for out, want_lp in zip(outs, ref_logprobs):
                for pos, entry in enumerate(out.prompt_logprobs or []):
                    if entry is None:
                        continue
                    for tok, lp in entry.items():
                        worst = max(worst, abs(lp.logprob - want_lp[pos - 1, tok].item()))
            rep.check("prompt logprobs vs transformers, fp32, chunked prefill (32-token chunks)", worst <= 1e-4,
                      max_abs_diff=worst, prompt_lens=[len(p) for p in prompts])
            eager = token_ids(llm.generate(as_inputs(prompts), greedy(n_tokens)))
        rep.check(f"greedy {n_tokens} tokens x {n_prompts} prompts, eager, fp32 == transformers generate",
                  eager == want, first_difference=first_difference(eager, want))
        with LLM(dtype="float32", enforce_eager=False, **common) as llm:
            graphs = token_ids(llm.generate(as_inputs(prompts), greedy(n_tokens)))
        rep.check(f"greedy {n_tokens} tokens x {n_prompts} prompts, graphs{' (CPU: padded path)' if dry else ''}, "
                  "fp32 == transformers generate", graphs == want, first_difference=first_difference(graphs, want))
        with LLM(dtype="bfloat16", enforce_eager=ctx.device != "cuda", **common) as llm:
            bf16 = token_ids(llm.generate(as_inputs(prompts), greedy(n_tokens)))
        same = sum(a == b for x, y in zip(bf16, want) for a, b in zip(x, y))
        prefix = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(bf16, want)]
        rep.figure("bf16 agreement with fp32 transformers", {"equal_positions": same / (n_prompts * n_tokens),
                                                            "equal_prefix_lengths": prefix})


# ---- phase: graphs on/off -----------------------------------------------------------------------


def phase_graphs(ctx: Ctx, rep: Report) -> None:
    import torch

    from pagedserve.engine.llm import LLM

    dry = ctx.dry_run
    batches = [1, 3, 8] if dry else [1, 3, 8, 37, 64, 200, 256, 300]
    max_tokens = 4 if dry else 8
    prompts = {b: random_prompts(b, 4, 40, seed=b) for b in batches}
    bench_batch, bench_tokens = (8, 8) if dry else (64, 64)
    bench_prompts = random_prompts(bench_batch, 16, 16, seed=99)
    results, timing = {}, {}
    if ctx.device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context first: neither start-up time counts it
    for mode in ("eager", "graphs"):
        if ctx.device == "cuda":
            import gc

            gc.collect()  # the previous engine's tensors, so its memory is not counted as this one's
            torch.cuda.empty_cache()
        before = gpu_memory()
        t0 = time.perf_counter()
        with LLM(**tiny_options(ctx, enforce_eager=mode == "eager", num_gpu_blocks_override=4096)) as llm:
            start_s = time.perf_counter() - t0
            after = gpu_memory()
            results[mode] = {b: token_ids(llm.generate(as_inputs(prompts[b]), greedy(max_tokens))) for b in batches}
            run = decode_run(llm, bench_prompts, bench_tokens)
        timing[mode] = {"start_s": start_s, **run,
                        **{f"{k}_delta": after[k] - before[k] for k in after}}
    for b in batches:
        rep.check(f"graphs == eager at batch {b}", results["graphs"][b] == results["eager"][b],
                  first_difference=first_difference(results["graphs"][b], results["eager"][b]))
    rep.figure("eager", timing["eager"])
    rep.figure("graphs", timing["graphs"])
    rep.figure("capture cost (graphs - eager start)", {
        "seconds": timing["graphs"]["start_s"] - timing["eager"]["start_s"],
        "reserved_mib": timing["graphs"].get("reserved_mib_delta", 0) - timing["eager"].get("reserved_mib_delta", 0)})
    rep.figure("decode speed-up with graphs", timing["eager"]["median_step_ms"] / timing["graphs"]["median_step_ms"])
