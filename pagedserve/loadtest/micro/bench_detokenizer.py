"""Per-token cost of incremental detokenization on the default model's tokenizer (not a test;
run by hand, on any revision: it uses only the detokenizer's public API).

    .venv/bin/python -m pagedserve.loadtest.micro.bench_detokenizer [--rounds 7]

One request's generated tokens are fed one at a time (add_token + take_delta, then flush), for
outputs of 256 and 2048 tokens of mixed English / accented / CJK / emoji text, without stop
strings and with two that never match (so the stop search and hold-back run every token).
Prints the median over rounds of process CPU time per token (steadier than wall time on a
shared machine) and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.tokenizer import Tokenizer

TEXT = ("The quick brown fox jumps over the lazy dog; naïve café, Straße — “quotes”… "
        "日本語のテキスト、中文字符。 emoji 😀🎉 and ∑∫√ symbols.\n")


def per_token_us(tok, prompt: list[int], ids: list[int], stop: list[str] | None) -> float:
    d = IncrementalDetokenizer(tok, prompt, stop=stop)
    c0 = time.process_time()
    for t in ids:
        d.add_token(t)
        d.take_delta()
    d.flush()
    d.take_delta()
    return (time.process_time() - c0) / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    tok = Tokenizer.from_model(None)
    prompt = tok.encode("<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n")
    ids_all = tok.encode(TEXT * 200, add_special_tokens=False)
    path = "DecodeStream" if getattr(IncrementalDetokenizer(tok, prompt), "_stream", None) else "Python"
    print(f"detokenizer path: {path}; load average {os.getloadavg()[0]:.2f}")
    for n in (256, 2048):
        ids = ids_all[:n]
        for stop in (None, ["<<never>>", "zz§"]):
            runs = [per_token_us(tok, prompt, ids, stop) for _ in range(args.rounds)]
            label = "no stop strings" if stop is None else "2 stop strings"
            print(f"{n:5d} tokens, {label:16s}: {statistics.median(runs):6.2f} us/token CPU "
                  f"(median of {args.rounds}; min {min(runs):.2f}, max {max(runs):.2f})")


if __name__ == "__main__":
    main()
