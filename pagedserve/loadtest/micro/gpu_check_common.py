"""Pieces the GPU check's phases share (the runner, loadtest/micro/gpu_check.py, and each phase's
module, which import no circle through it): a phase's Report and Ctx, greedy params, random
prompts, options of the tiny random model, comparing token lists, an engine decode run."""
from __future__ import annotations

import json
import random
import statistics
import time

from pagedserve.loadtest.tiny_model import TINY_CONFIG


def greedy(max_tokens: int, **extra):
    from pagedserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def tiny_options(ctx, **over) -> dict:
    """LLM / serve options for a random-weight model over the carried tokenizer (``ctx``: the phase's Ctx)."""
    return {"model": ctx.model_dir, "load_format": "dummy", "hf_config": TINY_CONFIG, "dtype": "float32",
            "device": ctx.device, "num_gpu_blocks_override": 1024, **over}


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return {"prompt": i, "position": at, "got": x[at:at + 4], "want": y[at:at + 4]}
    return None if len(a) == len(b) else {"lengths": [len(a), len(b)]}


class Skip(Exception):
    """The phase (or the part of it named) does not apply here: the message says why."""


class Report:
    """One phase's checks (name -> passed and figures), figures and skipped parts."""

    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.figures: dict[str, object] = {}
        self.skipped: dict[str, str] = {}

    def check(self, name: str, ok: bool, **info) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), **info})
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {json.dumps(info, default=str)[:300]}", flush=True)
        return bool(ok)

    def figure(self, name: str, value) -> None:
        self.figures[name] = value
        print(f"  {name}: {json.dumps(value, default=str)[:300]}", flush=True)

    def skip(self, part: str, reason: str) -> None:
        self.skipped[part] = reason
        print(f"  skip {part}: {reason}", flush=True)


class Ctx:
    def __init__(self, dry_run: bool, model_dir: str) -> None:
        self.dry_run = dry_run
        self.model_dir = model_dir
        self.device = "cpu" if dry_run else "cuda"


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def gpu_memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"allocated_mib": torch.cuda.memory_allocated() / 2**20,
            "reserved_mib": torch.cuda.memory_reserved() / 2**20}


def decode_run(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once through the engine core, one step at a time: the median decode step
    (steps where no prompt is prefilled) and generated tokens per second over the whole run."""
    core = llm.core
    ids = [f"gpu-check-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        core.add_request(rid, None, p, greedy(max_tokens))
    steps, tokens = [], 0
    t_start = time.perf_counter()
    while core.has_unfinished():
        t0 = time.perf_counter()
        outs = core.step()
        steps.append(time.perf_counter() - t0)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - t_start
    decode = steps[len(steps) - max_tokens + 2:] or steps  # the last max_tokens - 2: pure decode
    return {"batch": len(prompts), "max_tokens": max_tokens, "median_step_ms": statistics.median(decode) * 1e3,
            "tokens_per_s": tokens / elapsed, "steps": len(steps),
            "first_steps_ms": [round(s * 1e3, 2) for s in steps[:6]]}
