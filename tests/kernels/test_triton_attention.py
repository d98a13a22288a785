"""Triton kernels vs the torch implementation, run on CPU by the Triton interpreter.

``triton.jit`` decides at decoration time whether a function is interpreted, for our kernels and
for triton.language's own jit helpers (tl.max, tl.sum, ...), so TRITON_INTERPRET=1 must be set
before triton is first imported in the process, and again while kernels run. This module sets it
for its import and for each of its tests only. If triton was already imported (by some other
test module) the in-process tests are skipped and one test reruns this file in a subprocess.
"""
from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.needs import on_x86_64, require_installed
import torch

from pagedserve.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch
from tests.kernels.paged_batch import make_batch, naive_attention

require_installed("triton", in_test_extra=on_x86_64())

_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"


def _import_interpreted():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if "pagedserve.kernels.triton_keys" in sys.modules:
            importlib.reload(sys.modules["pagedserve.kernels.triton_keys"])
        if "pagedserve.kernels.triton_prefill" in sys.modules:
            importlib.reload(sys.modules["pagedserve.kernels.triton_prefill"])
        if "pagedserve.kernels.triton_attention" in sys.modules:
            return importlib.reload(sys.modules["pagedserve.kernels.triton_attention"])
        return importlib.import_module("pagedserve.kernels.triton_attention")
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


triton_attention = None if _PREIMPORTED else _import_interpreted()
in_process = pytest.mark.skipif(_PREIMPORTED, reason="triton imported before TRITON_INTERPRET; see subprocess test")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.skipif(not _PREIMPORTED, reason="ran in process")
def test_in_subprocess() -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _triton(batch, scale: float) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    result = triton_attention.paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=out)
    assert result.data_ptr() == out.data_ptr()
    return out


def _torch(batch, scale: float) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    return paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=out)


@in_process
def test_kernels_are_interpreted() -> None:
    assert type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"
    assert type(triton_attention._write_kv_cache_kernel).__name__ == "InterpretedFunction"
    from pagedserve.kernels import triton_prefill

    assert type(triton_prefill._prefill_attention_kernel).__name__ == "InterpretedFunction"


@in_process
def test_dispatch_uses_torch_for_cpu_tensors(monkeypatch) -> None:
    from pagedserve.kernels import attention

    def fail(*args, **kwargs):
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(triton_attention, "paged_attention_triton", fail)
    monkeypatch.setattr(triton_attention, "write_kv_cache_triton", fail)
    batch = make_batch([(5, 1), (0, 3)], 4, 2, 16, 8, seed=1)
    got = attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(got, _torch(batch, 0.25))
    attention.write_kv_cache(batch.q[:, :2], batch.q[:, :2], batch.k_cache, batch.v_cache, batch.meta.slot_mapping)


@in_process
@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,head_dim",
    [(8, 4, 4, 16), (16, 6, 2, 32), (32, 8, 2, 16), (8, 9, 3, 24)],
)
def test_mixed_batch_matches_torch(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    rng = random.Random(block_size + num_heads)
    reqs = [(rng.randint(0, 2 * block_size), 1) for _ in range(2)]  # decodes first
    reqs += [(0, rng.randint(2, 6)), (rng.randint(1, 2 * block_size), rng.randint(2, 5))]
    batch = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, seed=block_size, pad_tokens=2)
    scale = head_dim**-0.5
    got = _triton(batch, scale)
    want = _torch(batch, scale)
    assert not got.isnan().any()
    assert (got[batch.meta.num_tokens :] == 0).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    n = batch.meta.num_tokens
    torch.testing.assert_close(got[:n], naive_attention(batch, scale).float()[:n], atol=2e-5, rtol=1e-4)


@in_process
def test_block_boundaries_and_long_context() -> None:
    # Keys span several BLOCK_N tiles and cache blocks; queries sit on both sides of boundaries.
    reqs = [(15, 1), (16, 1), (70, 1), (31, 3)]
    batch = make_batch(reqs, 4, 2, 16, 16, seed=4)
    torch.testing.assert_close(_triton(batch, 0.25), _torch(batch, 0.25), atol=2e-5, rtol=1e-4)


@in_process
def test_strided_query_matches_torch() -> None:
    batch = make_batch([(10, 1), (0, 4), (6, 3)], 4, 2, 16, 8, seed=6)
    num_tokens = batch.q.shape[0]
    fused = torch.randn(num_tokens, 4 * 16 + 32)
    fused[:, : 4 * 16] = batch.q.reshape(num_tokens, -1)
    q = fused[:, : 4 * 16].view(num_tokens, 4, 16)
    out = torch.full_like(batch.q, float("nan"))
    triton_attention.paged_attention_triton(q, batch.k_cache, batch.v_cache, batch.meta, 0.25, out=out)
    torch.testing.assert_close(out, _torch(batch, 0.25), atol=2e-5, rtol=1e-4)


@in_process
def test_bf16_matches_torch() -> None:
    batch = make_batch([(20, 1), (9, 4)], 6, 2, 32, 8, dtype=torch.bfloat16, seed=2)
    got = _triton(batch, 0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _torch(batch, 0.2).float(), atol=2e-2, rtol=2e-2)


@in_process
def test_write_kv_cache_matches_torch_and_skips_minus_one() -> None:
    gen = torch.Generator().manual_seed(1)
    shape = (5, 8, 3, 24)
    slots = torch.tensor([3, -1, 39, 8, -1, 17], dtype=torch.int64)
    # k is a strided view (as when split out of a fused qkv projection).
    qkv = torch.randn(6, 2 * 3 * 24 + 5, generator=gen)
    k = qkv[:, : 3 * 24].view(6, 3, 24)
    v = qkv[:, 3 * 24 : 6 * 24].view(6, 3, 24)
    caches = [torch.full(shape, float("nan")) for _ in range(4)]
    triton_attention.write_kv_cache_triton(k, v, caches[0], caches[1], slots)
    write_kv_cache_torch(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert (~caches[0].isnan()).all(-1).all(-1).sum() == 4
    assert torch.equal(caches[0].view(-1, 3, 24)[39], k[2])


@in_process
@pytest.mark.parametrize("seed", range(3))
def test_random_batches_match_torch(seed: int) -> None:
    rng = random.Random(2000 + seed)
    num_kv_heads = rng.choice([1, 2])
    num_heads = num_kv_heads * rng.choice([1, 3, 4])
    block_size = rng.choice([8, 16, 32])
    reqs = [(rng.randint(0, 40), 1) for _ in range(rng.randint(0, 3))]
    reqs += [(rng.choice([0, rng.randint(1, 40)]), rng.randint(2, 5)) for _ in range(rng.randint(1, 2))]
    batch = make_batch(reqs, num_heads, num_kv_heads, 16, block_size, seed=seed, pad_tokens=1)
    torch.testing.assert_close(_triton(batch, 0.3), _torch(batch, 0.3), atol=2e-5, rtol=1e-4)


@in_process
@pytest.mark.parametrize("splits,block_n", [(2, 64), (4, 16), (16, 64), (2, 128)])
def test_context_splits_match_one_split_and_torch(splits: int, block_n: int) -> None:
    """Split-K decode: every share of the context merged equals the whole context at once; shares
    that get no keys (short contexts, more splits than tiles) and padding tokens stay exact. Tiles
    of 16 to 128 keys over 16-slot blocks (a tile spans blocks)."""
    reqs = [(0, 1), (5, 1), (70, 1), (130, 1), (31, 3), (0, 4)]  # decodes (one with no past), prefills
    batch = make_batch(reqs, 9, 3, 24, 16, seed=splits, pad_tokens=2)
    scale = 24 ** -0.5
    one = torch.full_like(batch.q, float("nan"))
    triton_attention.paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=one,
                                            num_splits=1, block_n=16)
    many = torch.full_like(batch.q, float("nan"))
    triton_attention.paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=many,
                                            num_splits=splits, block_n=block_n)
    assert not many.isnan().any() and (many[batch.meta.num_tokens:] == 0).all()
    torch.testing.assert_close(many, one, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(many, _torch(batch, scale), atol=2e-5, rtol=1e-4)


@in_process
def test_split_count_depends_on_tokens_and_device_only() -> None:
    assert triton_attention.choose_splits(1, 3, torch.device("cpu")) == 1
    # an H100's 132 SMs: batch-1 decode of the default model (3 KV heads) -> 16 splits; 16 requests
    # -> 8; 64 requests x 8 KV heads already fill the GPU -> 1
    assert [triton_attention.splits_for(p, 132) for p in (3, 48, 512, 0)] == [16, 8, 1, 16]
    with pytest.raises(ValueError, match="power of two"):
        batch = make_batch([(5, 1)], 4, 2, 16, 8, seed=1)
        triton_attention.paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25,
                                                num_splits=3)


@in_process
def test_prefill_in_query_tiles_matches_torch() -> None:
    """Prefill chunks longer than a tile (16 tokens), after cached context and from position 0,
    beside decodes and padding: the tiled prefill kernel with the per-token decode kernel."""
    reqs = [(9, 1), (0, 1), (30, 40), (0, 17), (5, 2)]
    batch = make_batch(reqs, 9, 3, 24, 8, seed=11, pad_tokens=3)
    from pagedserve.kernels.triton_prefill import prefill_tiles

    tiles = prefill_tiles(batch.meta)
    # request 2: 40 tokens from position 30 -> tiles of 16, 16, 8; request 3: 16 + 1; request 4: 2
    assert [(r, n, p) for r, _, n, p in tiles] == [(2, 16, 30), (2, 16, 46), (2, 8, 62), (3, 16, 0), (3, 1, 16),
                                                    (4, 2, 5)]
    scale = 24 ** -0.5
    got = _triton(batch, scale)
    assert (got[batch.meta.num_tokens:] == 0).all()
    torch.testing.assert_close(got, _torch(batch, scale), atol=2e-5, rtol=1e-4)
    n = batch.meta.num_tokens
    torch.testing.assert_close(got[:n], naive_attention(batch, scale).float()[:n], atol=2e-5, rtol=1e-4)


@in_process
def test_the_token_to_request_map_is_derived_once_a_step(monkeypatch) -> None:
    """Every layer of a step shares one map: the first call derives it (one searchsorted) and keeps
    it in the metadata, later calls reuse it; a map given up front (the graph runner's arange for
    decode rows) is used as is. Outputs equal torch's either way, for a mixed step too."""
    from pagedserve.gpu.graphs import DecodeGraphRunner

    calls = []
    real = torch.searchsorted
    monkeypatch.setattr(triton_attention.torch, "searchsorted", lambda *a, **k: calls.append(1) or real(*a, **k))
    for reqs in ([(7, 1), (30, 1), (0, 1)], [(9, 1), (0, 1), (30, 20), (5, 3)]):
        batch = make_batch(reqs, 9, 3, 16, 16, seed=4, pad_tokens=2)
        calls.clear()
        first = _triton(batch, 0.25)
        kept = batch.meta.token_request
        second = _triton(batch, 0.25)
        assert len(calls) == 1 and batch.meta.token_request is kept
        assert torch.equal(first, second)
        torch.testing.assert_close(first, _torch(batch, 0.25), atol=2e-5, rtol=1e-4)
    runner = DecodeGraphRunner(None, [], [1, 4, 8], 4, torch.device("cpu"), 64)
    static = runner._static_meta(4, 2, [3, 5, 1, 1], 5)
    assert static.token_request.tolist() == [0, 1, 2, 3]
    decode = make_batch([(3, 1), (5, 1), (0, 1), (2, 1)], 9, 3, 16, 16, seed=5)
    given = torch.arange(decode.meta.num_tokens, dtype=torch.int32)
    calls.clear()
    out = torch.empty_like(decode.q)
    decode.meta.token_request = given
    triton_attention.paged_attention_triton(decode.q, decode.k_cache, decode.v_cache, decode.meta, 0.25, out=out)
    assert not calls
    torch.testing.assert_close(out, _torch(decode, 0.25), atol=2e-5, rtol=1e-4)
