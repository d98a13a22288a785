"""Swap against recompute: how long a preempted request with a long context takes to resume.

One engine per preemption mode (the default model unless --model, prefix caching off: recompute
is the case where the victim's blocks were evicted). For each repeat: a request with a
``--context``-token prompt is prefilled and decodes a few tokens, is preempted, and the clock runs
from the next step until it has its next token: the swap-out + swap-in copies and one decode for
swap, the prefill of the whole context again for recompute. Modes are interleaved and the median
is printed; so is a plain decode step, and the copies alone (host pool, all layers). Swap must
give the tokens of an unpreempted run (it restores the K/V bit for bit), which is checked; for
recompute the run says whether they matched: the context comes back through a prefill instead
of the decodes that wrote it, equal only up to rounding outside fp32.

    python -m pagedserve.loadtest.micro.bench_swap --context 2000 --repeats 7
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def build(mode: str, args):
    from pagedserve.engine.llm import LLM

    return LLM(model=args.model, preemption_mode=mode, swap_space=args.swap_space,
               enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.context + 64),
               dtype=args.dtype)


def one_run(llm, prompt_ids: list[int], preempt: bool, decode_before: int = 3) -> tuple[float, float, list[int]]:
    """(resume seconds, a plain decode step's seconds, generated tokens)."""
    from pagedserve.engine.sampling_params import SamplingParams

    core = llm.core
    core.add_request("r", None, prompt_ids, SamplingParams(max_tokens=decode_before + 3, temperature=0,
                                                           ignore_eos=True))
    seq = core.requests["r"].seqs[0]
    tokens: list[int] = []

    def step():
        for out in core.step():
            tokens.extend(out.outputs[0].token_ids)

    while seq.num_output_tokens < decode_before:
        step()
    t0 = time.perf_counter()
    step()
    decode_s = time.perf_counter() - t0
    resume_s = 0.0
    if preempt:
        core.scheduler._preempt(seq)
        before = seq.num_output_tokens
        t0 = time.perf_counter()
        while seq.num_output_tokens == before:
            step()
        resume_s = time.perf_counter() - t0
    while core.has_unfinished():
        step()
    return resume_s, decode_s, tokens


def copies_alone(llm, context: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the swap-out and of the swap-in copies of ``context`` tokens' blocks."""
    runner = llm.parts.executor.runner
    pool = runner.swap_pool
    n = -(-context // runner.block_size)
    dev = list(range(1, n + 1))
    host = list(range(n))
    outs, ins = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool.swap_out(runner.kv_caches, list(zip(dev, host)))
        outs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pool.swap_in(runner.kv_caches, list(zip(host, dev)))
        ins.append(time.perf_counter() - t0)
    return statistics.median(outs), statistics.median(ins)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--swap-space", type=float, default=1.0)
    args = p.parse_args(argv)

    engines = {mode: build(mode, args) for mode in ("swap", "recompute")}
    try:
        vocab = engines["swap"].tokenizer.vocab_size
        rng = random.Random(0)
        prompt_ids = [rng.randrange(100, vocab - 100) for _ in range(args.context)]
        _, _, reference = one_run(engines["swap"], prompt_ids, preempt=False)
        resume = {m: [] for m in engines}
        same = {m: 0 for m in engines}
        decode = []
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                r, d, tokens = one_run(llm, prompt_ids, preempt=True)
                same[mode] += tokens == reference
                assert mode != "swap" or tokens == reference, "swap changed the greedy tokens"
                resume[mode].append(r)
                decode.append(d)
        out_s, in_s = copies_alone(engines["swap"], args.context, args.repeats)
        runner = engines["swap"].parts.executor.runner
        mib = -(-args.context // runner.block_size) * runner.kv_bytes_per_block() / 2**20
        print(f"context {args.context} tokens, dtype {runner.dtype}, KV to move {mib:.1f} MiB, "
              f"{args.repeats} repeats (medians)")
        for mode, times in resume.items():
            print(f"  resume after preemption, {mode:9s}: {statistics.median(times) * 1e3:8.1f} ms  "
                  f"(all: {', '.join(f'{t * 1e3:.0f}' for t in times)}; "
                  f"tokens as unpreempted in {same[mode]}/{args.repeats})")
        print(f"  plain decode step:                  {statistics.median(decode) * 1e3:8.1f} ms")
        print(f"  copies alone: swap-out {out_s * 1e3:.1f} ms, swap-in {in_s * 1e3:.1f} ms")
        print(f"  recompute / swap: {statistics.median(resume['recompute']) / statistics.median(resume['swap']):.1f}x")
    finally:
        for llm in engines.values():
            llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
