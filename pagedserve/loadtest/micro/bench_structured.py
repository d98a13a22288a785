"""Cost of constrained decoding on the engine: per-step time of a batch of constrained rows vs
the same batch free, and one constrained stream vs one free stream (default model, in-process).

A step counts when every row of it is a decode (no prefill chunk), so both runs compare like
with like. Step cost is the process's CPU time (``time.process_time``, one torch thread by
default): on a machine shared with other work, wall time mostly measures the others. The engine-side mask build (ConstraintTracker.attach_masks) and the sampler-side
apply (TokenMask.apply) are timed on their own too. Runs alternate (free, constrained, ...)
so the machine's load hits both alike.

    python -m pagedserve.loadtest.micro.bench_structured [--batch 16] [--rounds 3] [--tokens 24]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedserve.loadtest.micro.grammar_schemas import SCHEMAS

_timers: dict[str, float] = {}


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            _timers[label] = _timers.get(label, 0.0) + time.process_time() - t0

    setattr(owner, name, wrapper)


def run(llm, prompts, params, batch: int) -> tuple[list[float], dict[str, float], int]:
    """Per-step times (s) of the all-decode steps with ``batch`` rows, the component timers
    summed over those steps, and the tokens generated."""
    core = llm.core
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(f"r{time.monotonic_ns()}-{i}", None, p, sp)
    times: list[float] = []
    comp: dict[str, float] = {}
    tokens = 0
    while core.has_unfinished():
        _timers.clear()
        t0 = time.process_time()
        scheduled = core.schedule()
        if scheduled is None:
            core.step()
            continue
        out = core.executor.execute(scheduled.step_input)
        deltas = core.process(scheduled, out)
        dt = time.process_time() - t0
        tokens += sum(len(c.token_ids) for d in deltas for c in d.outputs)
        if len(scheduled.seqs) == batch and all(n == 1 for n in scheduled.num_new_tokens):
            times.append(dt)
            for k, v in _timers.items():
                comp[k] = comp.get(k, 0.0) + v
    return times, comp, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)

    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from pagedserve.engine.structured_output.tracker import ConstraintTracker
    from pagedserve.gpu.sampling_mask import TokenMask

    import torch

    torch.set_num_threads(args.threads)
    _timed(ConstraintTracker, "attach_masks", "mask_build")
    _timed(TokenMask, "apply", "mask_apply")
    llm = LLM(dtype=args.dtype, executor="inproc")
    tok = llm.tokenizer
    print(f"batch={args.batch} tokens={args.tokens} torch threads={args.threads} dtype={llm.config.model.dtype} "
          f"loadavg={tuple(round(x, 2) for x in os.getloadavg())}")

    def chat(name: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": f"Give an example {name} as JSON."}])
        return tok.encode(text, add_special_tokens=False)

    rows = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.batch)]
    prompts = [chat(name) for name, _, _ in rows]
    free = [SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True) for _ in rows]
    constrained = [SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                  structured_outputs=StructuredOutputsParams(json=schema))
                   for _, schema, _ in rows]
    # Warm: xgrammar import, tokenizer info, every grammar compiled once (cached afterwards).
    run(llm, prompts[:len(SCHEMAS)], constrained[:len(SCHEMAS)], -1)

    res: dict[str, list[float]] = {"free": [], "constrained": []}
    comps: list[dict[str, float]] = []
    for _ in range(args.rounds):
        for label, params in (("free", free), ("constrained", constrained)):
            times, comp, _ = run(llm, prompts, params, args.batch)
            res[label].append(statistics.median(times) * 1e3)
            if label == "constrained":
                comps.append({k: v / len(times) * 1e3 for k, v in comp.items()})
    f, c = statistics.median(res["free"]), statistics.median(res["constrained"])
    print(f"batch {args.batch}, all-decode steps (CPU ms): free {f:.2f} ms/step, constrained {c:.2f} ms/step "
          f"-> overhead {100 * (c / f - 1):+.1f}%  (per round: free {[round(x, 2) for x in res['free']]}, "
          f"constrained {[round(x, 2) for x in res['constrained']]})")
    build = statistics.median(d.get("mask_build", 0.0) for d in comps)
    apply = statistics.median(d.get("mask_apply", 0.0) for d in comps)
    print(f"  of which mask build (engine) {build:.3f} ms/step, mask apply (sampler) {apply:.3f} ms/step")

    # One stream: a long constrained document vs free text of the same length.
    long_schema = {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}}
    p1 = [chat("list of people")]
    one: dict[str, list[float]] = {"free": [], "constrained": []}
    run(llm, p1, [SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        json=long_schema))], -1)
    for _ in range(args.rounds):
        for label, sp in (("free", SamplingParams(temperature=0, max_tokens=args.tokens * 2, ignore_eos=True)),
                          ("constrained", SamplingParams(temperature=0, max_tokens=args.tokens * 2, ignore_eos=True,
                                                         structured_outputs=StructuredOutputsParams(json=long_schema)))):
            times, _, _ = run(llm, p1, [sp], 1)
            one[label].append(1.0 / statistics.median(times))
    f1, c1 = statistics.median(one["free"]), statistics.median(one["constrained"])
    print(f"single stream: free {f1:.1f} tok/s, constrained {c1:.1f} tok/s -> {c1 / f1:.3f}x")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
