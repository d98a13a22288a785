"""Multi-LoRA overhead, in process: decode throughput with adapters against the base model.

Random PEFT-layout adapters (every q/k/v/o/gate/up/down of every layer, B != 0) are written for
the model under test, then the same greedy workload runs base-only and with adapters: single
stream (one adapter) and ``--concurrency`` streams with ``--num-adapters`` adapters mixed
round-robin, at each ``--ranks`` (one engine per rank: the slots are max_lora_rank wide); base rows
run on the LoRA engine too ("single base row": what --enable-lora costs requests without an
adapter). Every engine stays up and the cases run in ``--rounds`` rounds, each round every case of
every engine in turn, so a change of the box's speed hits all of them alike; each figure is the
median of its rounds, each percentage the median of the per-round ratios to the base engine's
figure of the same round. To see how much of the cost is leaving the fused C decode path, run it
once more with ``PAGEDSERVE_FAST_DECODE=0 ... --ranks`` (nothing given after it: the base only).

    python -m pagedserve.loadtest.micro.bench_lora --ranks 8 16 64 --concurrency 16 --num-adapters 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: Path, hf_config: dict, rank: int, seed: int, std: float = 0.02) -> Path:
    """A random adapter in PEFT's file layout (numpy + safetensors: no model needed); ``std``: of
    A and B (larger moves greedy tokens of a random model: loadtest/micro/gpu_check_lora.py)."""
    import numpy as np
    from safetensors.numpy import save_file

    from pagedserve.contracts.lora import module_shapes

    dims = module_shapes(hf_config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(int(hf_config["num_hidden_layers"])):
        for m, block in MODULES.items():
            fan_in, fan_out = dims[m]
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * std).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * std).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}))
    return path


def _tokens_per_s(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M (Q4_1 GGUF)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 16, 64])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every case of every engine (medians)")
    parser.add_argument("--lora-dtype", default=None,
                        help="the engine's --lora-dtype (default: the engine's own default, auto)")
    args = parser.parse_args()

    from pagedserve.engine.llm import LLM
    from pagedserve.engine.lora_request import LoRARequest
    from pagedserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines: dict[str, tuple] = {}  # label -> (LLM, {case: (prompts, loras)})
    c_name = f"c={args.concurrency}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for rank in [0, *args.ranks]:
                # One engine per rank (the slots are max_lora_rank wide); base rows on the LoRA engine
                # are measured too: that is what a server with --enable-lora does for base requests.
                options = dict(model=args.model, kv_cache_memory=1.0, enable_prefix_caching=False)
                if rank:
                    options.update(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=rank)
                    if args.lora_dtype:
                        options["lora_dtype"] = args.lora_dtype
                llm = LLM(**options)
                engines["base" if not rank else f"rank {rank}"] = (llm, None)
                hf = llm.config.model.hf_config
                loras = [LoRARequest(f"r{rank}-{i}", i + 1, str(write_adapter(Path(tmp) / f"r{rank}-{i}", hf, rank, i)))
                         for i in range(args.num_adapters)] if rank else []
                vocab = int(hf["vocab_size"])
                streams = [[(7 * j + 13 * k) % (vocab - 100) + 50 for k in range(args.prompt_len)]
                           for j in range(args.concurrency)]
                prompts = [{"prompt_token_ids": p} for p in streams]
                cases = {"single": ([prompts[0]], [loras[0] if loras else None]),
                         c_name: (prompts, [loras[j % len(loras)] if loras else None for j in range(args.concurrency)])}
                if rank:
                    cases["single base row"] = ([prompts[0]], [None])
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                             lora_request=[loras[0], None] if loras else None)  # warm-up, adapters loaded
                engines["base" if not rank else f"rank {rank}"] = (llm, cases)
            runs: dict[str, dict[str, list[float]]] = {label: {} for label in engines}
            for _ in range(args.rounds):
                for label, (llm, cases) in engines.items():
                    for name, (ps, ls) in cases.items():
                        runs[label].setdefault(name, []).append(_tokens_per_s(llm, ps, params, ls))
        finally:
            for llm, _ in engines.values():
                llm.shutdown()
    print(summary(runs))


def summary(runs: dict[str, dict[str, list[float]]]) -> str:
    """A table: per engine and case the median tok/s of its rounds and the median of its per-round
    ratios to the base engine's same-round figure (a base row: to the base's single stream)."""
    base = runs["base"]
    lines = [f"{'':10s}" + "".join(f"{k:>26s}" for k in base)]
    for label, row in runs.items():
        cells = []
        for name, values in row.items():
            ref = base.get(name) or base["single"]
            change = statistics.median(v / r for v, r in zip(values, ref)) - 1
            cells.append(f"{statistics.median(values):9.1f} tok/s ({100 * change:+5.1f} %)")
        lines.append(f"{label:10s}" + "".join(f"{c:>26s}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
