"""The prepared GPU check (issue 24): proves the CUDA path on a lent GPU in one call.

    python -m loadtest.micro.gpu_check [--out $OUT/gpu_check.json] [--only kernels,serve]
    python -m loadtest.micro.gpu_check --dry-run      # here, on the CPU, small shapes (the test)

How to run it on the lent machine (the wheels and the tokenizer it carries, the exact call):
docs/gpu-check.md. Each phase runs in its own subprocess under its own timeout; its record (status
pass / fail / skip, the reason, its checks and figures) is appended to the JSON file after it
ends, and a failing, hanging or crashing phase never stops the next. All phases together stay
under 9 minutes on a bare H100; no network is used.

| phase | on the GPU | in --dry-run (CPU) |
|---|---|---|
| kernels | Triton decode / prefill / prefix-cached attention and the KV write vs the torch reference and a float64 one: head_dim 64/80/128, GQA 9/3 and 32/8, blocks 8/16/32, fp32/bf16/fp16, contexts to 3000, NaN in unowned slots; a CUDA graph replayed after its tables change in place | the same under TRITON_INTERPRET=1 on two small cases; the graph part eager in place of the replay (no CUDA) |
| model | a random Llama (head_dim 64, the default vocabulary) in fp32: prompt logprobs vs transformers (<= 1e-4) with chunked prefill; greedy 48 tokens x 8 prompts, eager and with graphs, equal to generate(do_sample=False); bf16 agreement reported | the same, 12 tokens x 3 prompts, graphs = the padded static-buffer path |
| graphs | greedy equality eager vs graphs at batch 1, 3, 8, 37, 64, 200, 256, 300; start-up time and memory of capture; decode step time and LLM tokens/s both ways | batch 1, 3, 8 |
| serve | a real `serve` on a random model: greedy equals offline, a streamed chat ends with [DONE], 64 concurrent requests, /metrics, SIGTERM exits 0 | the same on the CPU |
| lora | tiny model, 2 random adapters, fp32: greedy tokens with graphs equal eager, row for row: both adapters and base rows in a batch padded to a capture size, one adapter on every row, then base-only steps; the adapter steps replayed graphs | the same, the padded static-buffer path |
| decode_1b | a ~1B random Llama (hidden 2048, 16 layers, 32/8 heads, bf16): decode step time with graphs (and eager) at batch 1/16/64/256 vs (weights + KV bytes) / measured copy bandwidth; LLM tokens/s | a small model, batch 1 and 4 |
| refusals | fp8 KV and int8 / int4 on CUDA refused cleanly; a model whose position table is below max_num_batched_tokens starts (the profile forward); a sampling step of each common kind reads the GPU once (loadtest/micro/gpu_check_sampler.py) | the refusal checks on a CUDA device name; the profile forward on the CPU; the sampler's read count |
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from loadtest.micro.gpu_check_common import (as_inputs, first_difference, greedy, random_prompts, tiny_options,
                                             token_ids)
from loadtest.micro.gpu_check_lora import phase_lora
from loadtest.tiny_model import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[2]
# (phase, seconds it may take on a bare H100): 480 s in all (the 8 minutes), inside the call's 540 s.
PHASES = {"kernels": 100, "model": 75, "graphs": 80, "lora": 35, "serve": 70, "decode_1b": 85, "refusals": 35}
DRY_RUN_TIMEOUT_S = 60  # per phase in --dry-run (the test's whole budget is 2 minutes)


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


# ---- shared pieces ----------------------------------------------------------------------------


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


# ---- phase: kernels ---------------------------------------------------------------------------


def _poison_unowned(batch, value: float):
    """Copies of the batch's caches with every slot no request owns set to ``value``."""
    import torch

    k, v = batch.k_cache.clone(), batch.v_cache.clone()
    owned = torch.zeros(k.shape[0] * k.shape[1], dtype=torch.bool)
    for slots in batch.slots:
        owned[torch.tensor(slots, dtype=torch.long)] = True
    owned = owned.view(k.shape[0], k.shape[1])
    k[~owned] = value
    v[~owned] = value
    return k, v


def _meta_to(meta, device: str):
    from dataclasses import replace

    return replace(meta, query_start_loc=meta.query_start_loc.to(device), seq_lens=meta.seq_lens.to(device),
                   block_tables=meta.block_tables.to(device), slot_mapping=meta.slot_mapping.to(device))


def _rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


KERNEL_TOL = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 4e-3}  # ||out - ref|| / ||ref||


def _kernel_cases(dry_run: bool):
    """(head_dim, heads, kv_heads, block_size, dtype, requests): every head_dim, GQA shape, block
    size and dtype at least once; requests (context, new tokens), decodes first: long decodes,
    prefix-cached prefill chunks (context > 0) and a fresh prefill."""
    if dry_run:
        reqs = [(37, 1), (3, 1), (20, 5), (0, 7)]
        return [(64, 9, 3, 8, "float32", reqs), (80, 4, 2, 16, "bfloat16", reqs)]
    reqs = [(2999, 1), (1, 1), (700, 1), (1500, 37), (33, 200), (0, 300)]
    return [(64, 9, 3, 16, "float32", reqs), (80, 9, 3, 8, "bfloat16", reqs), (128, 32, 8, 32, "float16", reqs),
            (64, 32, 8, 8, "bfloat16", reqs), (80, 32, 8, 16, "float32", reqs), (128, 9, 3, 8, "float32", reqs),
            (64, 9, 3, 32, "float16", reqs), (128, 32, 8, 16, "bfloat16", reqs)]


def phase_kernels(ctx: Ctx, rep: Report) -> None:
    import torch

    if ctx.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip("TRITON_INTERPRET=1 was not set before triton was imported")
    try:
        from kernels import triton_attention as ta
    except ImportError as e:
        raise Skip(f"triton is not importable: {e}") from None
    from kernels.torch_attention import paged_attention_torch, write_kv_cache_torch
    from loadtest.micro.paged_batch import make_batch

    dev = ctx.device
    for case_no, (hd, h, hkv, bs, dtype_name, reqs) in enumerate(_kernel_cases(ctx.dry_run)):
        dtype = getattr(torch, dtype_name)
        name = f"d{hd} {h}/{hkv} block{bs} {dtype_name}"
        batch = make_batch(reqs, h, hkv, hd, bs, dtype=dtype, seed=100 + case_no, pad_tokens=2)
        meta = _meta_to(batch.meta, dev)
        scale = hd ** -0.5
        k_nan, v_nan = (t.to(dev) for t in _poison_unowned(batch, float("nan")))
        q = batch.q.to(dev)
        out = torch.full_like(q, float("nan"))
        ta.paged_attention_triton(q, k_nan, v_nan, meta, scale, out=out)
        synchronize(dev)
        n = batch.meta.num_tokens
        ref = paged_attention_torch(q, batch.k_cache.to(dev), batch.v_cache.to(dev), meta, scale)
        ref64 = paged_attention_torch(q.double(), batch.k_cache.double().to(dev), batch.v_cache.double().to(dev),
                                      meta, scale)
        err_ref, err_64 = _rel_err(out[:n], ref[:n]), _rel_err(out[:n], ref64[:n])
        tol = KERNEL_TOL[dtype_name]
        rep.check(f"attention {name}", not out[:n].isnan().any().item() and bool((out[n:] == 0).all())
                  and err_64 <= tol and err_ref <= 2 * tol, rel_err_vs_torch=err_ref, rel_err_vs_float64=err_64,
                  tol=tol)
        # KV write: the new tokens' K/V into NaN-filled caches, slot -1 skipped; vs the torch write.
        gen = torch.Generator().manual_seed(case_no)
        k_new = torch.randn(q.shape[0], hkv, hd, generator=gen).to(dtype).to(dev)
        v_new = torch.randn(q.shape[0], hkv, hd, generator=gen).to(dtype).to(dev)
        caches = [torch.full_like(k_nan, float("nan")) for _ in range(4)]
        ta.write_kv_cache_triton(k_new, v_new, caches[0], caches[1], meta.slot_mapping)
        write_kv_cache_torch(k_new, v_new, caches[2], caches[3], meta.slot_mapping)
        synchronize(dev)
        same = all(torch.equal(caches[i].nan_to_num(7.0), caches[i + 2].nan_to_num(7.0)) for i in (0, 1))
        written = int((~caches[0].isnan()).all(-1).all(-1).sum().item())
        rep.check(f"kv write {name}", same and written == n, slots_written=written, new_tokens=n)
    _graph_replay(rep, ta, paged_attention_torch, write_kv_cache_torch, make_batch, dev)


def _graph_replay(rep: Report, ta, paged_attention_torch, write_kv_cache_torch, make_batch, dev: str) -> None:
    """Capture KV write + decode attention once; replay after the batch's tables, lengths, query
    and cache change in place; compare with the torch reference of the new state. Without CUDA
    (dry run) the same steps run eagerly in place of the replay, which checks the reference."""
    import torch
    from dataclasses import replace

    if dev == "cuda":
        reqs, (h, hkv, hd, bs) = [(900, 1), (37, 1), (2047, 1), (5, 1), (300, 1)], (32, 8, 128, 16)
    else:
        reqs, (h, hkv, hd, bs) = [(40, 1), (3, 1), (17, 1)], (9, 3, 64, 8)
    dtype = torch.bfloat16
    first = make_batch(reqs, h, hkv, hd, bs, dtype=dtype, seed=1)
    static = {"q": first.q.to(dev), "k": first.k_cache.to(dev), "v": first.v_cache.to(dev),
              "k_new": torch.randn(len(reqs), hkv, hd, dtype=dtype).to(dev),
              "v_new": torch.randn(len(reqs), hkv, hd, dtype=dtype).to(dev)}
    meta = _meta_to(first.meta, dev)
    out = torch.empty_like(static["q"])

    def step():
        ta.write_kv_cache_triton(static["k_new"], static["v_new"], static["k"], static["v"], meta.slot_mapping)
        ta.paged_attention_triton(static["q"], static["k"], static["v"], meta, hd ** -0.5, out=out)

    step()  # warm-up: compile outside the capture
    synchronize(dev)
    if dev == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = graph.replay
    else:
        rep.skip("cuda graph capture", "no CUDA device (dry run): the steps run eagerly in place of the replay")
        replay = step
    errors = []
    for seed in (2, 3, 4):
        nxt = make_batch(reqs, h, hkv, hd, bs, dtype=dtype, seed=seed)  # same shapes, other tables/data
        rng = random.Random(seed)
        lens = [rng.randint(1, s) for s in nxt.meta.seq_lens_host]  # shorter contexts, same tables
        slots = [nxt.slots[r][n - 1] for r, n in enumerate(lens)]
        new_meta = replace(nxt.meta, seq_lens=torch.tensor(lens, dtype=torch.int32), seq_lens_host=lens,
                           slot_mapping=torch.tensor(slots, dtype=torch.int64), max_seq_len=max(lens))
        for name, src in (("q", nxt.q), ("k", nxt.k_cache), ("v", nxt.v_cache)):
            static[name].copy_(src)
        static["k_new"].normal_()
        static["v_new"].normal_()
        meta.block_tables.copy_(new_meta.block_tables)
        meta.seq_lens.copy_(new_meta.seq_lens)
        meta.slot_mapping.copy_(new_meta.slot_mapping)
        k_ref, v_ref = nxt.k_cache.to(dev), nxt.v_cache.to(dev)
        write_kv_cache_torch(static["k_new"], static["v_new"], k_ref, v_ref, meta.slot_mapping)
        ref = paged_attention_torch(static["q"].clone(), k_ref, v_ref, _meta_to(new_meta, dev), hd ** -0.5)
        out.fill_(float("nan"))
        replay()
        synchronize(dev)
        errors.append(_rel_err(out, ref))
    rep.check(f"{'cuda graph replay' if dev == 'cuda' else 'eager stand-in'} after in-place table changes",
              max(errors) <= KERNEL_TOL["bfloat16"], rel_errs=errors)


# ---- phase: model vs transformers ---------------------------------------------------------------


def _save_hf_llama(path: Path, cfg: dict, tokenizer_dir: str, seed: int = 0):
    """A transformers Llama with random weights (norms randomised too) saved as safetensors beside
    the carried tokenizer; returns it in fp32 eval mode."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), path / name)
    model.generation_config.eos_token_id = None  # ours ignores EOS: so does the reference
    model.generation_config.pad_token_id = 0
    return model


def phase_model(ctx: Ctx, rep: Report) -> None:
    import torch

    from engine.llm import LLM

    dry = ctx.dry_run
    n_prompts, n_tokens = (3, 12) if dry else (8, 48)
    cfg = {**TINY_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2 if dry else 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    prompts = random_prompts(n_prompts, 20, 90, seed=7)
    with tempfile.TemporaryDirectory(prefix="gpu-check-llama-") as tmp:
        ref = _save_hf_llama(Path(tmp), cfg, ctx.model_dir).to(ctx.device)
        with torch.inference_mode():
            ref_logprobs = [ref(torch.tensor([p], device=ctx.device)).logits[0].float().log_softmax(-1).cpu()
                            for p in prompts]
            want = [ref.generate(torch.tensor([p], device=ctx.device), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long, device=ctx.device), do_sample=False, max_new_tokens=n_tokens,
                                 min_new_tokens=n_tokens)[0, len(p):].tolist() for p in prompts]
        del ref
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
        common = {"model": tmp, "device": ctx.device, "num_gpu_blocks_override": 512, "max_num_batched_tokens": 32,
                  "cuda_graph_batch_sizes": [1, 2, 4, 8]}
        # Eager, fp32: prompt logprobs with prefill in chunks of 32 tokens, then greedy tokens.
        with LLM(dtype="float32", enforce_eager=True, **common) as llm:
            outs = llm.generate(as_inputs(prompts), greedy(1, prompt_logprobs=5))
            worst = 0.0
            for out, want_lp in zip(outs, ref_logprobs):
                for pos, entry in enumerate(out.prompt_logprobs or []):
                    if entry is None:
                        continue
                    for tok, lp in entry.items():
                        worst = max(worst, abs(lp.logprob - want_lp[pos - 1, tok].item()))
            rep.check("prompt logprobs vs transformers, fp32, chunked prefill (32-token chunks)", worst <= 1e-4,
                      max_abs_diff=worst, prompt_lens=[len(p) for p in prompts])
            eager = token_ids(llm.generate(as_inputs(prompts), greedy(n_tokens)))
        rep.check(f"greedy {n_tokens} tokens x {n_prompts} prompts, eager, fp32 == transformers generate",
                  eager == want, first_difference=first_difference(eager, want))
        with LLM(dtype="float32", enforce_eager=False, **common) as llm:
            graphs = token_ids(llm.generate(as_inputs(prompts), greedy(n_tokens)))
        rep.check(f"greedy {n_tokens} tokens x {n_prompts} prompts, graphs{' (CPU: padded path)' if dry else ''}, "
                  "fp32 == transformers generate", graphs == want, first_difference=first_difference(graphs, want))
        with LLM(dtype="bfloat16", enforce_eager=ctx.device != "cuda", **common) as llm:
            bf16 = token_ids(llm.generate(as_inputs(prompts), greedy(n_tokens)))
        same = sum(a == b for x, y in zip(bf16, want) for a, b in zip(x, y))
        prefix = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(bf16, want)]
        rep.figure("bf16 agreement with fp32 transformers", {"equal_positions": same / (n_prompts * n_tokens),
                                                            "equal_prefix_lengths": prefix})


# ---- phase: graphs on/off -----------------------------------------------------------------------


def phase_graphs(ctx: Ctx, rep: Report) -> None:
    import torch

    from engine.llm import LLM

    dry = ctx.dry_run
    batches = [1, 3, 8] if dry else [1, 3, 8, 37, 64, 200, 256, 300]
    max_tokens = 4 if dry else 8
    prompts = {b: random_prompts(b, 4, 40, seed=b) for b in batches}
    bench_batch, bench_tokens = (8, 8) if dry else (64, 64)
    bench_prompts = random_prompts(bench_batch, 16, 16, seed=99)
    results, timing = {}, {}
    if ctx.device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context first: neither start-up time counts it
    for mode in ("eager", "graphs"):
        if ctx.device == "cuda":
            import gc

            gc.collect()  # the previous engine's tensors, so its memory is not counted as this one's
            torch.cuda.empty_cache()
        before = gpu_memory()
        t0 = time.perf_counter()
        with LLM(**tiny_options(ctx, enforce_eager=mode == "eager", num_gpu_blocks_override=4096)) as llm:
            start_s = time.perf_counter() - t0
            after = gpu_memory()
            results[mode] = {b: token_ids(llm.generate(as_inputs(prompts[b]), greedy(max_tokens))) for b in batches}
            run = decode_run(llm, bench_prompts, bench_tokens)
        timing[mode] = {"start_s": start_s, **run,
                        **{f"{k}_delta": after[k] - before[k] for k in after}}
    for b in batches:
        rep.check(f"graphs == eager at batch {b}", results["graphs"][b] == results["eager"][b],
                  first_difference=first_difference(results["graphs"][b], results["eager"][b]))
    rep.figure("eager", timing["eager"])
    rep.figure("graphs", timing["graphs"])
    rep.figure("capture cost (graphs - eager start)", {
        "seconds": timing["graphs"]["start_s"] - timing["eager"]["start_s"],
        "reserved_mib": timing["graphs"].get("reserved_mib_delta", 0) - timing["eager"].get("reserved_mib_delta", 0)})
    rep.figure("decode speed-up with graphs", timing["eager"]["median_step_ms"] / timing["graphs"]["median_step_ms"])


# ---- phase: serve smoke -------------------------------------------------------------------------


def _serve_args(options: dict) -> list[str]:
    return ["--model", options["model"], "--load-format", "dummy", "--hf-config", json.dumps(options["hf_config"]),
            "--dtype", options["dtype"], "--device", options["device"], "--num-gpu-blocks-override",
            str(options["num_gpu_blocks_override"]), "--max-model-len", "2048"]


async def _concurrent(url: str, model: str, n: int) -> list[bool]:
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i):
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": f"Request {i}: count to ten.", "max_tokens": 16, "temperature": 0.8,
                "seed": i})
            return r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str)
        return await asyncio.gather(*(one(i) for i in range(n)))


def phase_serve(ctx: Ctx, rep: Report) -> None:
    import httpx

    from engine.llm import LLM
    from loadtest.local_server import LocalServer

    options = tiny_options(ctx)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    with LLM(**options) as llm:
        offline = [o.outputs[0].text for o in llm.generate(texts, greedy(16))]
    server = LocalServer(_serve_args(options), log_prefix="gpu-check-serve-")
    code = None
    try:
        url = server.url
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        served = []
        for t in texts:
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": t, "max_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
            served.append(r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}")
        rep.check("served greedy == offline", served == offline, served=served, offline=offline)
        chunks, last = 0, None
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = line[len("data: "):]
                    chunks += last != "[DONE]"
        rep.check("streamed chat ends with [DONE]", last == "[DONE]" and chunks > 0, chunks=chunks, last=last)
        ok = asyncio.run(_concurrent(url, model, 64))
        rep.check("64 concurrent completions", all(ok), succeeded=sum(ok))
        r = httpx.get(url + "/metrics", timeout=30)
        rep.check("/metrics", r.status_code == 200 and "# TYPE" in r.text, status=r.status_code, bytes=len(r.text))
    finally:
        code = server.stop()
        if code != 0:
            print(server.output()[-3000:], flush=True)
    rep.check("SIGTERM: exit code 0", code == 0, exit_code=code)


# ---- phase: 1B decode vs the physical limit -------------------------------------------------------


def _copy_bandwidth(device: str) -> float:
    """Bytes read plus written per second by a large device-to-device copy (median of 10)."""
    import torch

    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times[2:])


def _decode_meta(batch: int, context: int, block_size: int, device: str):
    import torch

    from kernels.metadata import AttentionMetadata

    per = -(-context // block_size)
    tables = torch.arange(1, 1 + batch * per, dtype=torch.int32).view(batch, per)
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    starts = list(range(batch + 1))
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=slots.to(device), num_decodes=batch, max_query_len=1,
        max_seq_len=context, query_start_loc_host=starts, seq_lens_host=[context] * batch)


def _time_ms(fn, device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# The ~1.2B Llama of the decode phase (and of loadtest/micro/gpu_profile_decode.py).
CONFIG_1B = {**TINY_CONFIG, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}


def phase_decode_1b(ctx: Ctx, rep: Report) -> None:
    import torch

    from engine.llm import LLM
    from gpu.forward_context import forward_context

    dry = ctx.dry_run
    if dry:
        cfg = {**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
        batches, context, dtype, repeats = [1, 4], 64, "float32", 5
    else:
        cfg = CONFIG_1B
        batches, context, dtype, repeats = [1, 16, 64, 256], 1024, "bfloat16", 30
    bandwidth = _copy_bandwidth(ctx.device)
    rep.figure("copy bandwidth GB/s (read + write)", bandwidth / 1e9)
    blocks = max(batches) * -(-context // 16) + 64
    options = tiny_options(ctx, hf_config=cfg, dtype=dtype, enforce_eager=False, cuda_graph_batch_sizes=batches,
                           num_gpu_blocks_override=blocks, max_model_len=2048)
    with LLM(**options) as llm:
        runner = llm.parts.executor.runner
        model, gr = runner.model, runner.graph_runner
        weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                           if "embed" not in name and "lm_head" not in name)
        kv_per_token = runner.kv_bytes_per_block() // runner.block_size
        rep.figure("model", {"parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype,
                             "layer_weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
                             "context": context})
        rows = []
        for b in batches:
            meta = _decode_meta(b, context, runner.block_size, ctx.device)
            ids = torch.randint(100, 40000, (b,), device=ctx.device)
            pos = torch.full((b,), context - 1, dtype=torch.long, device=ctx.device)
            size = gr._fill(ids, pos, meta)
            static = gr._static_meta(size, meta.block_tables.shape[1], meta.seq_lens_host, context)
            graph = gr.graphs.get(size)

            def eager():
                with torch.inference_mode(), forward_context(static, runner.kv_caches):
                    model(gr.input_ids[:size], gr.positions[:size])

            eager_ms = _time_ms(eager, ctx.device, repeats)
            graph_ms = _time_ms(graph.replay, ctx.device, repeats) if graph is not None else None
            floor_ms = (weight_bytes + b * context * kv_per_token) / bandwidth * 1e3
            best = graph_ms if graph_ms is not None else eager_ms
            rows.append({"batch": b, "graph_ms": graph_ms, "eager_ms": eager_ms, "floor_ms": floor_ms,
                         "floor_fraction": floor_ms / best, "tokens_per_s": b / best * 1e3})
            rep.figure(f"decode step batch {b}", rows[-1])
        if not dry:
            rep.check("every batch size has a captured graph", all(r["graph_ms"] is not None for r in rows))
            rep.figure("targets (reported, not gating)", {
                "batch1_at_70pct_of_floor": rows[0]["floor_fraction"] >= 0.7,
                "graphs_2x_eager_at_batch1": rows[0]["eager_ms"] >= 2 * rows[0]["graph_ms"],
                "batch64_within_1.5x_of_floor": rows[2]["floor_fraction"] >= 1 / 1.5})
        else:
            rep.skip("graph timings", "no CUDA device (dry run): the padded eager path is timed")
        n = max(batches[-1] // 4, 1) if not dry else 4
        first = decode_run(llm, random_prompts(n, 128, 128, seed=3), 16 if dry else 64)
        rep.figure("LLM decode run, first (its first prefill compiles the Triton prefill kernel)", first)
        run = decode_run(llm, random_prompts(n, 128, 128, seed=4), 16 if dry else 64)
        rep.figure("LLM decode run", run)


# ---- phase: refusals ----------------------------------------------------------------------------


def phase_refusals(ctx: Ctx, rep: Report) -> None:
    from engine.llm import LLM
    from loadtest.micro.gpu_check_sampler import check_sampler_syncs

    check_sampler_syncs(rep, ctx.device)

    cases = [("kv_cache_dtype", "fp8", "kv-cache-dtype"), ("quantization", "int8", "int8"),
             ("quantization", "int4", "int4")]
    for option, value, word in cases:
        error = None
        try:
            if ctx.device == "cuda":
                with LLM(**tiny_options(ctx, **{option: value})):
                    pass
            elif option == "kv_cache_dtype":
                import torch

                from kernels.kv_cache_dtype import resolve

                resolve(value, torch.float32, "cuda")  # the check LLM makes; needs no GPU
            else:
                from gpu.models.loader import resolve_quantization

                resolve_quantization(value, "cuda")
        except Exception as e:  # noqa: BLE001 - any type, but it must say why, and not be a CUDA crash
            error = e
        message = f"{type(error).__name__}: {error}" if error is not None else None
        rep.check(f"{option}={value} on CUDA refused cleanly", error is not None and word in str(error).lower()
                  and "cuda error" not in str(error).lower(), error=message)
    # Fault 1: a position table (256) below max_num_batched_tokens (2048) must start: the profile
    # forward wraps its positions. On the GPU the KV budget comes from that forward (no override).
    small = {**TINY_CONFIG, "max_position_embeddings": 256}
    options = tiny_options(ctx, hf_config=small, max_model_len=256, max_num_batched_tokens=2048)
    if ctx.device == "cuda":
        options.pop("num_gpu_blocks_override")
        # 1 % of an H100 (0.8 GiB) is ~200k blocks of this tiny model: enough, and quick to set up.
        options["gpu_memory_utilization"] = 0.01
    with LLM(**options) as llm:
        out = token_ids(llm.generate(as_inputs(random_prompts(2, 10, 20, seed=5)), greedy(8)))
        runner = llm.parts.executor.runner
        hidden = runner.profile_forward()
        finite = bool(hidden.float().isfinite().all().item()) if hasattr(hidden, "float") else True
    rep.check("max_position_embeddings 256 < max_num_batched_tokens 2048 starts and generates",
              all(len(t) == 8 for t in out) and finite, blocks=runner.num_blocks)


# ---- the runner -----------------------------------------------------------------------------------

PHASE_FUNCTIONS = {"kernels": phase_kernels, "model": phase_model, "graphs": phase_graphs, "lora": phase_lora,
                   "serve": phase_serve, "decode_1b": phase_decode_1b, "refusals": phase_refusals}


def run_phase(name: str, ctx: Ctx, result_path: str) -> int:
    """In the phase's own process: run it, write its record."""
    rep = Report()
    record = {"phase": name, "status": "pass", "reason": None}
    t0 = time.perf_counter()
    try:
        PHASE_FUNCTIONS[name](ctx, rep)
        failed = [c["name"] for c in rep.checks if not c["ok"]]
        if failed:
            record.update(status="fail", reason="failed: " + "; ".join(failed))
        elif not rep.checks and not rep.figures:
            record.update(status="skip", reason="nothing ran")
    except Skip as e:
        record.update(status="skip", reason=str(e))
    except Exception as e:  # noqa: BLE001 - the record says what broke; the next phase still runs
        traceback.print_exc()
        record.update(status="fail", reason=f"{type(e).__name__}: {e}"[:2000])
    record.update(seconds=round(time.perf_counter() - t0, 2), checks=rep.checks, figures=rep.figures,
                  skipped_parts=rep.skipped)
    Path(result_path).write_text(json.dumps(record, default=str, indent=1))
    return 0


def run_with_timeout(cmd: list[str], env: dict, timeout: float) -> tuple[str, int | None]:
    """Run a phase in a process group of its own; past the timeout, kill the whole group (a
    server the phase started too, so it holds no GPU memory into the next phase). -> (output,
    exit code or None on timeout)."""
    import signal

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the phase left running in its group
    except ProcessLookupError:
        pass
    return output, code


def _device_info(dry_run: bool) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "dry_run": dry_run}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count)
    import importlib.metadata

    packages = {}  # what the server imports, carried or the image's: a version, or why not
    for name in ("triton", "transformers", "tokenizers", "starlette", "uvicorn", "sse-starlette", "anyio", "orjson",
                 "pydantic", "msgspec", "httptools", "gguf", "xgrammar", "httpx", "uvloop", "prometheus-client"):
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = "MISSING"
    info["packages"] = packages
    return info


def _model_dir(assets: str, dry_run: bool) -> str:
    carried = Path(assets) / "model"
    if (carried / "tokenizer.json").is_file():
        return str(carried.resolve())
    if not dry_run:
        raise SystemExit(f"{carried} is missing: run `python -m loadtest.micro.gpu_check_prepare` here first "
                         "and carry .gpu_check (docs/gpu-check.md)")
    from loadtest.micro.gpu_check_prepare import export_model_dir

    made = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    export_model_dir(made)  # from the default model's GGUF, present where the suite runs
    return str(made)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run here on the CPU, small shapes (the test)")
    parser.add_argument("--out", default=None, help="JSON file of the phase records (default $OUT/gpu_check.json, "
                                                    "else ./gpu_check.json)")
    parser.add_argument("--only", default=None, help="comma-separated phases (default all): " + ", ".join(PHASES))
    parser.add_argument("--assets", default=str(ROOT / ".gpu_check"), help="the prepared folder (model/, wheels/)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase in this process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        return run_phase(args.phase, Ctx(args.dry_run, args.model_dir), args.result)

    names = args.only.split(",") if args.only else list(PHASES)
    unknown = set(names) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            from gpu.device import cuda_unavailable_reason

            raise SystemExit(f"no CUDA device: {cuda_unavailable_reason()} (use --dry-run on a CPU)")
    out = Path(args.out or os.path.join(os.environ.get("OUT") or ".", "gpu_check.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    model_dir = _model_dir(args.assets, args.dry_run)
    report = {"device": _device_info(args.dry_run), "phases": []}
    print(json.dumps(report["device"]), flush=True)
    out.write_text(json.dumps(report, indent=1))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with open(log, "w") as log_file, tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in names:
            timeout = DRY_RUN_TIMEOUT_S if args.dry_run else PHASES[name]
            result = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "loadtest.micro.gpu_check", "--phase", name, "--result", str(result),
                   "--model-dir", model_dir] + (["--dry-run"] if args.dry_run else [])
            phase_env = dict(env, TRITON_INTERPRET="1") if args.dry_run and name == "kernels" else env
            print(f"== {name} (timeout {timeout} s)", flush=True)
            log_file.write(f"== {name}\n")
            log_file.flush()
            t0 = time.perf_counter()
            output, code = run_with_timeout(cmd, phase_env, timeout)
            log_file.write(output)
            log_file.flush()
            sys.stdout.write(output[-3000:])
            if result.is_file():
                record = json.loads(result.read_text())
            else:
                why = f"timed out after {timeout} s" if code is None else f"its process exited with {code}"
                record = {"phase": name, "status": "fail", "reason": f"{why}; output tail: {output[-1500:]}",
                          "seconds": round(time.perf_counter() - t0, 2), "checks": [], "figures": {}}
            report["phases"].append(record)
            out.write_text(json.dumps(report, default=str, indent=1))
    print(f"\n{'phase':10s} {'status':6s} {'seconds':>8s}  reason")
    for r in report["phases"]:
        print(f"{r['phase']:10s} {r['status']:6s} {r['seconds']:8.1f}  {(r.get('reason') or '')[:150]}")
    print(f"records: {out}; log: {log}")
    return 1 if any(r["status"] == "fail" for r in report["phases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
