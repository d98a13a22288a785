"""Multi-LoRA overhead as CPU time per generated token: base rows against adapter rows on one LoRA engine.

Why next to bench_lora: on a shared box wall-clock tok/s moved 5-30x between identical runs, and with
OpenMP's default active wait a descheduled partner thread makes whole steps stall. Process CPU time
(``time.process_time``, all threads) around each ``generate`` is far steadier; run it with
``OMP_NUM_THREADS=1`` (or ``OMP_WAIT_POLICY=PASSIVE`` at 2 threads so waiting threads sleep). The cases
alternate inside each round (c=16 base rows, c=16 with 4 adapters round-robin, 1 base stream, 1 adapter
stream), so a load change hits both sides of a ratio. Prefill is included, as in bench_lora.

    OMP_NUM_THREADS=1 python -m pagedserve.loadtest.micro.bench_lora_cpu --rank 16 --rounds 4
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M (Q4_1 GGUF)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--lora-dtype", default=None, help="the engine's --lora-dtype (default: auto)")
    parser.add_argument("--only", default=None, help="run one case alone (for perf record)")
    args = parser.parse_args()

    from pagedserve.engine.llm import LLM
    from pagedserve.engine.lora_request import LoRARequest
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.loadtest.micro.bench_lora import write_adapter

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    options = dict(model=args.model, kv_cache_memory=1.0, enable_prefix_caching=False, enable_lora=True,
                   max_loras=args.num_adapters, max_lora_rank=args.rank)
    if args.lora_dtype:
        options["lora_dtype"] = args.lora_dtype
    c = args.concurrency
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(**options)
        try:
            hf = llm.config.model.hf_config
            loras = [LoRARequest(f"r{i}", i + 1, str(write_adapter(Path(tmp) / f"r{i}", hf, args.rank, i)))
                     for i in range(args.num_adapters)]
            vocab = int(hf["vocab_size"])
            prompts = [{"prompt_token_ids": [(7 * j + 13 * k) % (vocab - 100) + 50 for k in range(args.prompt_len)]}
                       for j in range(c)]
            llm.generate(prompts[:len(loras)], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                         lora_request=loras)  # warm-up, adapters loaded
            cases = {f"c{c} base": (prompts, [None] * c),
                     f"c{c} lora": (prompts, [loras[j % len(loras)] for j in range(c)]),
                     "1 base": (prompts[:1], [None]), "1 lora": (prompts[:1], [loras[0]])}
            if args.only:
                cases = {args.only: cases[args.only]}
            results: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
            for _ in range(args.rounds):
                for name, (ps, ls) in cases.items():
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    outs = llm.generate(ps, params, use_tqdm=False, lora_request=ls)
                    cpu1, wall1 = time.process_time(), time.perf_counter()
                    n = sum(len(o.outputs[0].token_ids) for o in outs)
                    results[name].append(((cpu1 - cpu0) / n * 1e3, n / (wall1 - wall0)))
        finally:
            llm.shutdown()
    for name, runs in results.items():
        cpu = [r[0] for r in runs]
        print(f"{name:9s} cpu ms/token " + " ".join(f"{v:6.2f}" for v in cpu) + f" | median {statistics.median(cpu):6.2f}"
              + "   wall tok/s " + " ".join(f"{r[1]:6.1f}" for r in runs))
    for n in ([] if args.only else (f"c{c}", "1")):
        ratios = [lo[0] / b[0] for b, lo in zip(results[f"{n} base"], results[f"{n} lora"])]
        print(f"{n}: LoRA/base CPU per token, per round: " + " ".join(f"{x:.3f}" for x in ratios)
              + f"  median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
