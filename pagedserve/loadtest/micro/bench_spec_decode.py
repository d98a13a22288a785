"""`pagedserve bench spec-decode`: ngram speculative decoding against plain decoding, in process.

Two engines of the same model (one with ``--speculative-config``, one without) run the same
requests, alternately, so a busy machine slows both alike:
  * single stream: each "quote" request (loadtest/workloads.py: repeat a passage) alone, greedy;
    decode tokens/s from the first token to the last, summed over the requests;
  * c=16 quote: 16 quote requests in one batch, output tokens/s;
  * c=16 random: 16 prompts of random words with ignore_eos (little for prompt lookup to find).
Greedy outputs must be identical token for token (checked, reported). Acceptance figures come
from the engine's spec_decode counters.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC, help="the engine with speculation")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--num-iters", type=int, default=3, help="alternating rounds (median reported)")
    parser.add_argument("--batch", type=int, default=16, help="requests of the batched runs")
    parser.add_argument("--kv-cache-memory", type=float, default=1.0)
    parser.add_argument("--runs", default="single,c_quote,c_random", help="which measurements, comma-separated")
    parser.add_argument("--json", action="store_true")


def _quote_prompts(llm, n: int) -> list[str]:
    from pagedserve.loadtest.workloads import QUOTE_INSTRUCTIONS, QUOTE_PASSAGES

    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": QUOTE_INSTRUCTIONS[i % 2] + QUOTE_PASSAGES[
        i % len(QUOTE_PASSAGES)]}]) for i in range(n)]


def _random_prompts(n: int) -> list[str]:
    from pagedserve.loadtest.workloads import _WORDS

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(64)) for _ in range(n)]


def _single(llm, prompts, params) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of each request alone (first token to last), over all of them."""
    tokens = seconds = 0.0
    outs = []
    for p in prompts:
        ids: list[int] = []
        first = None
        for delta in llm.stream(p, params):
            ids += delta.outputs[0].token_ids
            if first is None and ids:
                first = time.perf_counter()
        end = time.perf_counter()
        tokens += len(ids) - 1
        seconds += end - first
        outs.append(ids)
    return tokens / seconds, outs


def _batched(llm, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outs]
    return sum(len(i) for i in ids) / elapsed, ids


def run(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.loadtest.workloads import QUOTE_PASSAGES

    engines = {"off": LLM(model=args.model, kv_cache_memory=args.kv_cache_memory),
               "ngram": LLM(model=args.model, kv_cache_memory=args.kv_cache_memory,
                            speculative_config=args.speculative_config)}
    quote = _quote_prompts(engines["off"], len(QUOTE_PASSAGES))
    batch_quote = _quote_prompts(engines["off"], args.batch)
    batch_random = _random_prompts(args.batch)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len)
    forced = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    wanted = set(args.runs.split(","))
    runs = {name: {k: [] for k in ("single", "c_quote", "c_random") if k in wanted} for name in engines}
    outputs: dict[str, dict] = {name: {} for name in engines}
    try:
        for llm in engines.values():  # warm-up
            llm.generate(quote[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        spec_before = engines["ngram"].core.stats()
        measures = {"single": lambda llm: _single(llm, quote, greedy),
                    "c_quote": lambda llm: _batched(llm, batch_quote, greedy),
                    "c_random": lambda llm: _batched(llm, batch_random, forced)}
        for _ in range(args.num_iters):
            for what in runs["off"]:
                for name, llm in engines.items():
                    tps, outputs[name][what] = measures[what](llm)
                    runs[name][what].append(tps)
        s = engines["ngram"].core.stats()
    finally:
        for llm in engines.values():
            llm.shutdown()
    drafted = s.spec_decode_num_draft_tokens - spec_before.spec_decode_num_draft_tokens
    accepted = s.spec_decode_num_accepted_tokens - spec_before.spec_decode_num_accepted_tokens
    drafts = s.spec_decode_num_drafts - spec_before.spec_decode_num_drafts
    per_pos = [c - (spec_before.spec_decode_num_accepted_tokens_per_pos[i]
                    if i < len(spec_before.spec_decode_num_accepted_tokens_per_pos) else 0)
               for i, c in enumerate(s.spec_decode_num_accepted_tokens_per_pos)]
    med = {name: {k: round(statistics.median(v), 1) for k, v in r.items()} for name, r in runs.items()}
    result = {
        "speculative_config": json.loads(args.speculative_config),
        "output_len": args.output_len,
        "rounds": args.num_iters,
        "tokens_per_s": med,
        "speedup": {k: round(med["ngram"][k] / med["off"][k], 2) for k in med["off"]},
        "identical_greedy_output": {k: outputs["ngram"][k] == outputs["off"][k] for k in outputs["off"]},
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_accepted_per_draft_run": round(accepted / drafts, 2) if drafts else None,
        "acceptance_per_position": [round(c / drafts, 3) for c in per_pos] if drafts else [],
    }
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0
