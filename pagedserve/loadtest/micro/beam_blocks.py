"""KV blocks held by beam search against independent requests (issue 13's figure).

Runs the engine with the tiny random model (block accounting does not depend on the weights) on
one 1,000-token prompt: beam search at width k, then k independent greedy requests with and
without prefix caching; prints the peak number of blocks held during each run.

    python -m pagedserve.loadtest.micro.beam_blocks [--k 4] [--prompt-tokens 1000] [--max-tokens 16]
"""
from __future__ import annotations

import argparse


def peak_blocks(llm, add) -> int:
    core = llm.core
    add(core)
    bm = core.block_manager
    peak = 0
    while core.has_unfinished():
        scheduled = core.schedule()
        if scheduled is None:
            continue
        peak = max(peak, bm.num_usable_blocks - bm.num_free_blocks)
        core.process(scheduled, core.executor.execute(scheduled.step_input))
    return peak


def main() -> None:
    from pagedserve.engine.sampling_params import BeamSearchParams
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.contracts.config import default_model_path
    from pagedserve.loadtest.tiny_model import TINY_CONFIG

    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    prompt = [1000 + (i * 7919) % 30000 for i in range(args.prompt_tokens)]
    opts = {"model": default_model_path(), "load_format": "dummy", "hf_config": TINY_CONFIG, "dtype": "float32",
            "kv_cache_memory": 1 / 8, "max_num_batched_tokens": 2048}
    runs = {
        f"beam search k={args.k}": (True, lambda core: core.add_request(
            "b", None, prompt, BeamSearchParams(beam_width=args.k, max_tokens=args.max_tokens, ignore_eos=True))),
    }
    for caching in (False, True):
        runs[f"{args.k} independent requests, prefix caching {'on' if caching else 'off'}"] = (caching, (
            lambda core: [core.add_request(f"r{i}", None, prompt, SamplingParams(
                temperature=0, max_tokens=args.max_tokens, ignore_eos=True)) for i in range(args.k)]))
    block = None
    for name, (caching, add) in runs.items():
        llm = LLM(**opts, enable_prefix_caching=caching)
        try:
            block = llm.core.block_manager.block_size
            print(f"{name}: peak {peak_blocks(llm, add)} blocks")
        finally:
            llm.shutdown()
    print(f"(block size {block}; prompt {args.prompt_tokens} tokens = {-(-args.prompt_tokens // block)} blocks; "
          f"max_tokens {args.max_tokens})")


if __name__ == "__main__":
    main()
