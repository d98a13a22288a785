"""A mixture-of-experts model against its dense equivalent (the same active parameters a token),
random weights: decode tokens/s for one stream and for 16 at once.

    python -m pagedserve.loadtest.micro.bench_moe [--quantization int4] [--layers 12]

Why: a 30B-A3B model is run on CPUs because a token reads ~3B parameters; the MoE layer should
cost about what a dense MLP of the active size costs (routing, grouping and one matmul per
active expert on top). The MoE config is Qwen3-MoE-shaped (top-k of many small experts); the dense
one replaces each expert MLP by a dense MLP of top_k x the expert size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def configs(layers: int, hidden: int, experts: int, top_k: int, expert_size: int) -> dict[str, dict]:
    base = dict(vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                num_key_value_heads=max(1, hidden // 256), head_dim=64, max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    moe = dict(base, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
               num_experts_per_tok=top_k, moe_intermediate_size=expert_size, intermediate_size=expert_size * top_k,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    dense = dict(base, architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=expert_size * top_k)
    return {"moe": moe, "dense": dense}


def measure(hf_config: dict, quantization: str, streams: int, output_len: int, iters: int) -> float:
    """Median decode tokens/s over ``iters`` runs of ``streams`` requests decoding together."""
    from pagedserve.contracts.config import default_model_path
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    llm = LLM(model=default_model_path(), load_format="dummy", hf_config=hf_config, dtype="float32",
              quantization=quantization, kv_cache_memory=1.0)
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        prompts = [{"prompt_token_ids": [1000 + 37 * s + i for i in range(32)]} for s in range(streams)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        rates = []
        for _ in range(iters):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        return statistics.median(rates)
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    rows = {}
    for name, cfg in configs(args.layers, args.hidden, args.experts, args.top_k, args.expert_size).items():
        for streams in (1, 16):
            rows[f"{name} c={streams}"] = round(measure(cfg, args.quantization, streams, args.output_len,
                                                        args.iters), 1)
            print(f"{name} c={streams}: {rows[f'{name} c={streams}']} tok/s", flush=True)
    print(json.dumps({"args": vars(args), "tokens_per_s": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
