"""Accuracy of --quantization against the unquantized model: greedy token agreement over a fixed
prompt set and the perplexity of a fixed text.

    .venv/bin/python -m pagedserve.loadtest.micro.quant_accuracy [--modes auto int8 int4] [--dtype float32] [--tokens 32]
        [--text README.md] [--kv-cache-dtype fp8]

The reference is always ``--quantization none`` in fp32 (the file dequantized, as transformers
reads it); ``--dtype bfloat16`` runs the quantized modes with bf16 activations against it; ``--kv-cache-dtype
fp8`` runs them (``none`` included, listed in ``--modes``) over an fp8 KV cache.

Agreement is position by position over ``--tokens`` greedy tokens of each of the 16 prompts (a
divergence usually changes the rest of that continuation, so it is a strict measure); the mean
length of the common prefix is printed beside it.
"""
from __future__ import annotations

import argparse
import math
import time

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain photosynthesis in simple terms.",
    "List three uses of a paperclip:",
    "Once upon a time, in a small village,",
    "What is 17 times 23?",
    "Translate to French: Good morning, how are you?",
    "The most important invention of the twentieth century was",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "import numpy as np\n# compute the mean of an array\n",
    "Summarize the plot of Romeo and Juliet.",
    "The three laws of thermodynamics are",
    "Dear hiring manager,",
    "A haiku about autumn leaves:",
]


def greedy_tokens(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from pagedserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions with the same token, mean common-prefix fraction)."""
    same = total = 0
    prefix = 0.0
    for ref, out in zip(reference, other, strict=True):
        same += sum(a == b for a, b in zip(ref, out))
        total += len(ref)
        k = 0
        while k < min(len(ref), len(out)) and ref[k] == out[k]:
            k += 1
        prefix += k / max(1, len(ref))
    return same / max(1, total), prefix / max(1, len(reference))


def perplexity(llm, text: str, window: int = 512) -> float:
    """exp(mean negative log-likelihood) of ``text``'s tokens, in independent windows."""
    from pagedserve.engine.sampling_params import SamplingParams

    ids = llm.get_tokenizer().encode(text)
    chunks = [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], sp, use_tqdm=False)
    nll = count = 0
    for chunk, out in zip(chunks, outs):
        for tok, entry in zip(chunk[1:], out.prompt_logprobs[1:]):
            nll -= entry[tok].logprob
            count += 1
    return math.exp(nll / count)


def main() -> None:
    from pagedserve.engine.llm import LLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--modes", nargs="+", default=["auto", "int8", "int4"])
    parser.add_argument("--dtype", default="float32", help="activations of the quantized modes")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--text", default="README.md", help="text whose perplexity is measured")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache of the compared modes")
    args = parser.parse_args()
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    results = {}
    for mode in ["none", *args.modes]:
        t0 = time.perf_counter()
        first = "none" not in results
        dtype = "float32" if first else args.dtype
        llm = LLM(model=args.model, dtype=dtype, quantization=mode, kv_cache_memory=0.25,
                  kv_cache_dtype="auto" if first else args.kv_cache_dtype)
        try:
            toks = greedy_tokens(llm, PROMPTS, args.tokens)
            ppl = perplexity(llm, text)
        finally:
            llm.shutdown()
        results[mode if first else f"{mode}/{dtype}"] = toks
        kv = "" if first or args.kv_cache_dtype == "auto" else f" kv {args.kv_cache_dtype}"
        line = f"{mode:5s} {dtype:9s}{kv} perplexity({args.text}) {ppl:8.3f}"
        if not first:
            same, prefix = agreement(results["none"], toks)
            line += f"  greedy agreement {same:.3f} (mean common prefix {prefix:.3f}) over {len(PROMPTS)}x{args.tokens}"
        print(f"{line}  [{time.perf_counter() - t0:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
