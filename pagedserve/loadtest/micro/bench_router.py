"""Cost of one data-parallel routing decision (engine/replicas.py ReplicatedEngine.route):
reading each replica's load, hashing the prompt's prefix blocks and looking them up in each
replica's block manager and the router's record, choosing. No model: stand-in replicas hold a
real BlockManager with a cached shared prefix and a few hundred requests' worth of load.

    python -m pagedserve.loadtest.micro.bench_router --replicas 2 --prompt-len 1024

Prints the median and p99 per decision in microseconds, for a prompt that misses every cache
and one whose first ``--prefix-len`` tokens are cached on one replica. Compare with a step time
(ITL of `pagedserve bench serve`): the issue asks for well under 1 % of a step.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

from pagedserve.engine.kv_blocks import BlockManager
from pagedserve.engine.replicas import ReplicatedEngine


class _Replica:
    """Just what the router reads of an AsyncEngine."""

    def __init__(self, config, restart_policy=None, block_size=16, num_blocks=4096, num_requests=64):
        self.config = config
        self.num_deaths = self.num_worker_restarts = 0
        self._queues: dict = {}
        bm = BlockManager(num_blocks, block_size, True, b"bench")
        self.core = SimpleNamespace(requests={i: None for i in range(num_requests)}, block_manager=bm)

    def health_status(self) -> str:
        return "ok"


def _cache(bm: BlockManager, tokens: list[int]) -> None:
    seq = SimpleNamespace(seq_id=10**9, token_ids=tokens, block_hashes=[], cache_salt=None)
    bm.allocate_new(seq, [], len(tokens))
    bm.register_computed(seq, len(tokens))
    bm.free(seq.seq_id)


def measure(replicas: int, prompt_len: int, prefix_len: int, runs: int) -> dict[str, tuple[float, float]]:
    from pagedserve.contracts.config import EngineConfig

    engine = ReplicatedEngine(EngineConfig(), replicas, engine_factory=lambda c, p: _Replica(c))
    engine._build_prefix_index()
    rng = random.Random(0)
    shared = [rng.randrange(49152) for _ in range(prefix_len)]
    _cache(engine.replicas[-1].core.block_manager, shared + [1])
    out = {}
    for name, make in (("miss", lambda: [rng.randrange(49152) for _ in range(prompt_len)]),
                       ("prefix hit", lambda: shared + [rng.randrange(49152) for _ in range(prompt_len - prefix_len)])):
        times = []
        for _ in range(runs):
            prompt = make()
            t0 = time.perf_counter_ns()
            engine.route(prompt, None)
            times.append(time.perf_counter_ns() - t0)
        times.sort()
        out[name] = (statistics.median(times) / 1000, times[int(0.99 * (len(times) - 1))] / 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--runs", type=int, default=2000)
    args = p.parse_args(argv)
    for name, (median, p99) in measure(args.replicas, args.prompt_len, args.prefix_len, args.runs).items():
        print(f"replicas={args.replicas} prompt={args.prompt_len} tokens {name:>10}: "
              f"median {median:7.1f} us   p99 {p99:7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
