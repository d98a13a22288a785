"""What prefix-aware routing buys: prefix-cache hit rate of N data-parallel replicas when requests
share a few system prompts, routed prefix-aware (the default) and by load alone.

Real engines end to end except HTTP: ReplicatedEngine over AsyncEngines running the tiny
random-weight model (loadtest/local_server.TINY_CONFIG) in worker processes, so the figure is the engine's
own prefix_cache_hits / prefix_cache_queries, not a model of it. Hit rates do not depend on speed.

    python -m pagedserve.loadtest.micro.dp_prefix_hits --replicas 2 --prefixes 4 --requests 64
"""
from __future__ import annotations

import argparse
import asyncio
import random

from pagedserve.engine.replicas import ReplicatedEngine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.config import EngineConfig, default_model_path
from pagedserve.loadtest.tiny_model import TINY_CONFIG


def _config(num_blocks: int) -> EngineConfig:
    return EngineConfig.from_options(
        model=default_model_path(), load_format="dummy", hf_config=dict(TINY_CONFIG), dtype="float32",
        max_model_len=2048, num_gpu_blocks_override=num_blocks, executor="mp")


async def _run(replicas: int, prefix_aware: bool, prompts: list[list[int]], concurrency: int,
               num_blocks: int) -> dict:
    engine = ReplicatedEngine(_config(num_blocks), replicas, prefix_aware=prefix_aware)
    await engine.start()
    try:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: list[int]) -> None:
            async with gate:
                async for _ in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                                      ignore_eos=True), f"q{i}"):
                    pass

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        s = engine.stats()
        return {"hit_rate": s.prefix_cache_hits / max(1, s.prefix_cache_queries),
                "computed_prompt_tokens": s.prefix_cache_queries - s.prefix_cache_hits,
                "routed": list(engine.num_routed)}
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prefixes", type=int, default=4, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    prompts = [rng.choice(systems) + [rng.randrange(100, 40000) for _ in range(args.suffix_len)]
               for _ in range(args.requests)]
    for aware in (True, False):
        r = asyncio.run(_run(args.replicas, aware, prompts, args.concurrency, args.num_blocks))
        print(f"replicas={args.replicas} prefixes={args.prefixes} requests={args.requests} "
              f"{'prefix-aware' if aware else 'load only   '}: hit rate {r['hit_rate']:.3f}  "
              f"prompt tokens computed {r['computed_prompt_tokens']}  routed {r['routed']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
