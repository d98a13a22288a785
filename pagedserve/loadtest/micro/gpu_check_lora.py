"""The GPU check's ``lora`` phase (loadtest/micro/gpu_check.py): multi-LoRA decode steps under CUDA graphs.

A step with adapter rows replays the captured decode graph with its slots written into static
buffers (gpu/models/lora_layers.py StaticLoRABatch), so the check is that greedy tokens with graphs
equal eager ones, row for row, in fp32 on the tiny random model with two random PEFT-layout
adapters: a batch mixing both adapters and base rows padded to a capture size, one adapter on
every row (no mask), then base-only steps at the same size (the buffers reset), and one stream.
It also checks that those steps took the graph runner (and on CUDA, replayed graphs) and that the
adapters do move the tokens (else equality would prove nothing). One engine serves both passes
(its graph runner set aside for the eager one): one start-up, and the same weights and adapters.
In --dry-run the same runs on the CPU, graphs being the padded static-buffer path.
"""
from __future__ import annotations

import tempfile
from pathlib import Path


def _count_graph_steps(llm, counts: dict) -> None:
    """Count the graph runner's steps (``run``) and, on CUDA, its replays, on this LLM's runner."""
    gr = llm.parts.executor.runner.graph_runner
    if gr is None:
        return
    real_run = gr.run

    def run(input_ids, positions, meta, lora=None):
        counts["steps"] += 1
        counts["lora_steps"] += lora is not None
        size = gr.padded_size(meta.num_requests)
        counts["replays"] += size in gr.graphs
        return real_run(input_ids, positions, meta, lora)

    gr.run = run


def phase_lora(ctx, rep) -> None:
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.lora_request import LoRARequest
    from pagedserve.loadtest.micro.bench_lora import write_adapter
    from pagedserve.loadtest.micro.gpu_check_common import (as_inputs, first_difference, greedy, random_prompts, tiny_options,
                                                 token_ids)
    from pagedserve.loadtest.tiny_model import TINY_CONFIG

    dry = ctx.dry_run
    max_tokens = 4 if dry else 8
    sizes = [1, 2, 4, 8] if dry else [1, 2, 4, 8, 16]
    n_mixed = 5 if dry else 13  # pads to 8 / 16
    with tempfile.TemporaryDirectory(prefix="gpu-check-lora-") as tmp:
        a, b = (LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", TINY_CONFIG, 8, seed=i, std=0.2)))
                for i in range(2))
        workloads = {  # name -> (prompts, one adapter or None per prompt)
            "mixed": (random_prompts(n_mixed, 4, 30, seed=11), [[a, b, None][i % 3] for i in range(n_mixed)]),
            "one adapter on every row": (random_prompts(3, 4, 30, seed=12), [a] * 3),
            "base only after adapters": (random_prompts(3, 4, 30, seed=12), [None] * 3),
            "single stream": (random_prompts(1, 4, 30, seed=13), [b]),
        }
        # One engine (one start-up): "eager" runs with its graph runner set aside, so each step takes
        # the eager forward; no prefix cache, so both passes compute the same prompts the same way.
        options = tiny_options(ctx, enforce_eager=False, kv_cache_dtype="float32", enable_lora=True, max_loras=2,
                               max_lora_rank=8, cuda_graph_batch_sizes=sizes, enable_prefix_caching=False)
        results, steps = {}, {"steps": 0, "lora_steps": 0, "replays": 0}
        with LLM(**options) as llm:
            runner = llm.parts.executor.runner
            graph_runner = runner.graph_runner
            _count_graph_steps(llm, steps)
            for mode in ("eager", "graphs"):
                runner.graph_runner = graph_runner if mode == "graphs" else None
                results[mode] = {name: token_ids(llm.generate(as_inputs(prompts), greedy(max_tokens),
                                                              lora_request=loras))
                                 for name, (prompts, loras) in workloads.items()}
    for name in workloads:
        got, want = results["graphs"][name], results["eager"][name]
        rep.check(f"LoRA greedy tokens, graphs == eager: {name}", got == want,
                  first_difference=first_difference(got, want))
    # every decode step of every workload but the base-only one carries adapter rows
    want_lora_steps = (len(workloads) - 1) * (max_tokens - 1)
    rep.check("LoRA decode steps took the graph runner" + ("" if dry else " and replayed graphs"),
              steps["lora_steps"] >= want_lora_steps and (dry or steps["replays"] >= steps["steps"] > 0),
              want_lora_steps=want_lora_steps, **steps)
    base = results["eager"]["base only after adapters"]
    moved = results["eager"]["one adapter on every row"]
    rep.check("the adapters move greedy tokens (same prompts, base vs adapter a)", moved != base)
