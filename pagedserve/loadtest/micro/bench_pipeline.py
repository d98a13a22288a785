"""Offline throughput of pipeline stages: 32 prompts x 64 greedy tokens, default model, fp32, mp executor.

Usage: python -m pagedserve.loadtest.micro.bench_pipeline PP   (PP = --pipeline-parallel-size; 1 = one worker)"""
import sys, time
from pagedserve.engine.llm import LLM
from pagedserve.engine.sampling_params import SamplingParams
if __name__ == "__main__":
    pp = int(sys.argv[1])
    llm = LLM(dtype="float32", executor="mp", pipeline_parallel_size=pp, kv_cache_memory=0.5)
    ps = [f"Write a short story about the number {i} and a" for i in range(32)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(ps[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    res = []
    for _ in range(3):
        t = time.perf_counter(); out = llm.generate(ps, sp, use_tqdm=False); dt = time.perf_counter() - t
        res.append(sum(len(o.outputs[0].token_ids) for o in out) / dt)
    print(f"pp={pp} tok/s runs={[round(r,1) for r in res]} median={sorted(res)[1]:.1f}")
    llm.shutdown()
