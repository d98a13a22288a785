"""Grammar engines compared on the default model's tokenizer: xgrammar vs llguidance.

Two figures decide the choice (issue 11): the compile time of a typical JSON schema (cold: no
cache) and the per-step cost of the token masks of a batch of 16 constrained rows. The step
benchmark walks 16 matchers through valid documents (the schemas' instances, tokenized by the
model's tokenizer), filling every row's bitmask each step (timed), then accepting the next token.

    python -m pagedserve.loadtest.micro.bench_grammar [--rounds 5] [--batch 16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from pagedserve.loadtest.micro.grammar_schemas import SCHEMAS


def _tokenizer():
    from pagedserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_model(None)


def _docs(tok) -> list[list[int]]:
    return [tok.encode(json.dumps(inst), add_special_tokens=False) for _, _, inst in SCHEMAS]


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        from pagedserve.engine.structured_output.xgrammar_backend import build_tokenizer_info
        import xgrammar as xgr

        self.xgr = xgr
        self.info = build_tokenizer_info(tok, tok.vocab_size)
        self.vocab = tok.vocab_size

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask, batch_matcher=None):
        if batch_matcher is not None:
            batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            return
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def batch(self):
        return self.xgr.BatchGrammarMatcher(max_threads=2)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=tok.vocab_size,
                                                eos_token=tok.eos_token_ids)
        self.vocab = tok.vocab_size

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_flexible": False, "item_separator": ", ",
                                           "key_separator": ": "})
        m = self.llg.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matchers, bitmask, executor=None):
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        if executor is not None:
            fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
            return
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, bitmask, i)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def batch(self):
        return self.llg.LLExecutor(num_threads=2)


def bench_compile(engine, rounds: int) -> list[float]:
    """Median cold compile time per schema (ms)."""
    out = []
    for _, schema, _ in SCHEMAS:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            engine.compile(schema)
            times.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(times))
    return out


def bench_steps(engine, docs: list[list[int]], batch: int, rounds: int, parallel: bool) -> float:
    """Median time (us) to fill the bitmasks of ``batch`` rows for one step."""
    compiled = [engine.compile(s) for _, s, _ in SCHEMAS]
    words = (engine.vocab + 31) // 32
    bitmask = np.zeros((batch, words), dtype=np.int32)
    helper = engine.batch() if parallel else None
    per_step = []
    for _ in range(rounds):
        rows = [i % len(SCHEMAS) for i in range(batch)]
        matchers = [engine.matcher(compiled[r]) for r in rows]
        steps = min(len(docs[r]) for r in rows)
        total = 0.0
        for t in range(steps):
            t0 = time.perf_counter()
            engine.fill(matchers, bitmask, helper)
            total += time.perf_counter() - t0
            for m, r in zip(matchers, rows):
                tok = docs[r][t]
                assert (bitmask[rows.index(r), tok // 32] >> (tok % 32)) & 1, "valid token masked out"
                if not engine.accept(m, tok):
                    raise AssertionError(f"{engine.name} refused token {t} of {SCHEMAS[r][0]}")
        per_step.append(total / steps * 1e6)
    return statistics.median(per_step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)
    tok = _tokenizer()
    docs = _docs(tok)
    print(f"vocab={tok.vocab_size} schemas={len(SCHEMAS)} batch={args.batch} "
          f"loadavg={tuple(round(x, 2) for x in os.getloadavg())}")
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        engine = cls(tok)
        setup = (time.perf_counter() - t0) * 1e3
        compile_ms = bench_compile(engine, args.rounds)
        seq = bench_steps(engine, docs, args.batch, args.rounds, parallel=False)
        par = bench_steps(engine, docs, args.batch, args.rounds, parallel=True)
        print(f"{engine.name:11s} tokenizer setup {setup:7.1f} ms | compile median {statistics.median(compile_ms):7.2f} ms "
              f"(max {max(compile_ms):7.2f}) | batch-{args.batch} mask fill per step: "
              f"sequential {seq:8.1f} us, 2 threads {par:8.1f} us")
        print("            per schema compile ms: " + ", ".join(
            f"{n}={c:.1f}" for (n, _, _), c in zip(SCHEMAS, compile_ms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
