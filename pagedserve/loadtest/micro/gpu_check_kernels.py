"""The GPU check's ``kernels`` phase (loadtest/micro/gpu_check.py): the Triton attention kernels and
the KV write against the torch reference and a float64 one, and a CUDA graph replayed after its
tables change in place."""
from __future__ import annotations

import os
import random

from pagedserve.loadtest.micro.gpu_check_common import Ctx, Report, Skip, synchronize


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
        from pagedserve.kernels import triton_attention as ta
    except ImportError as e:
        raise Skip(f"triton is not importable: {e}") from None
    from pagedserve.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch
    from pagedserve.loadtest.micro.paged_batch import make_batch

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
