"""Torch implementations of the paged-KV ops: the CPU path and the oracle for the Triton kernels.

Decodes (the first ``meta.num_decodes`` requests, one query token each) run as padded batches:
sorted by length and cut into chunks small enough to stay in cache, each chunk's blocks are
gathered into ``[b, L, Hkv, D]`` and attended with a length mask (two batched GEMMs in bf16, one
SDPA call in fp32; see ``_decode_bmm``). Prefill chunks run one request at a time through SDPA with
a causal mask shifted by the request's cached context.

Unwritten cache slots inside gathered blocks are masked out of the softmax, but their values
still meet a zero weight in ``P @ V``: allocate caches with ``torch.zeros`` (any finite garbage is
fine, NaN/Inf is not).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels.kv_cache_dtype import index_copy_rows, readable
from pagedserve.kernels.metadata import AttentionMetadata


def write_kv_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (-1 = skip)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    num_tokens = k.shape[0]
    slots = slot_mapping[:num_tokens].to(torch.int64)
    valid = slots >= 0
    if k.device.type == "cpu" and bool(valid.all()):
        # Common case (no padding): one contiguous row copy per token, no compaction.
        index_copy_rows(k_flat, slots, k.to(k_cache.dtype))
        index_copy_rows(v_flat, slots, v.to(v_cache.dtype))
        return
    keep = valid.nonzero().squeeze(1)
    index_copy_rows(k_flat, slots[keep], k[keep].to(k_cache.dtype))
    index_copy_rows(v_flat, slots[keep], v[keep].to(v_cache.dtype))


class _Workspace:
    """Reusable gather buffers, one per (name, device, dtype).

    Decode attention gathers every layer's K/V blocks into scratch memory of the same size;
    allocating it fresh each call costs page faults that dominate the CPU time, so the buffer
    is kept and only grows. Single-threaded use (one forward at a time per process).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (name, like.device, like.dtype)
        buf = self._buffers.get(key)
        # A buffer made under inference_mode cannot be written outside it (and the kernels run
        # both ways: the model runner in inference mode, tests and tools outside it).
        if buf is None or buf.numel() < numel or (buf.is_inference() and not torch.is_inference_mode_enabled()):
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:numel]

    def clear(self) -> None:
        self._buffers.clear()


_workspace = _Workspace()


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, scratch: str | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``cache[block_ids]`` for block ids of any shape ``S`` -> ``[*S, block_size, Hkv, D]``, in
    ``dtype`` when given (an fp8 cache is read in the queries' dtype)."""
    if dtype is not None and cache.dtype != dtype:
        return _gather_blocks(cache, block_ids).to(dtype)
    flat = block_ids.reshape(-1)
    if scratch is None:
        gathered = cache.index_select(0, flat)
    else:
        block_numel = cache[0].numel()
        out = _workspace.get(scratch, flat.numel() * block_numel, cache).view(-1, *cache.shape[1:])
        gathered = torch.index_select(cache, 0, flat, out=out)
    return gathered.view(*block_ids.shape, *cache.shape[1:])


def _decode_bias(seq_lens: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[B, 1, L]``: 0 for real positions, -inf past each request's length."""
    positions = torch.arange(length, device=seq_lens.device, dtype=seq_lens.dtype)
    beyond = positions[None, :] >= seq_lens[:, None]
    return torch.zeros(seq_lens.shape[0], 1, length, dtype=dtype, device=seq_lens.device).masked_fill_(
        beyond[:, None], float("-inf"))


def _decode_bmm(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """q ``[B, H, D]``, gathered keys/values ``[B, L, Hkv, D]`` -> ``[B, H, D]``.

    The gathered blocks stay in cache layout (no transpose copy). GQA is handled with a
    block-diagonal query: head h's vector sits in the D-wide slot of its KV head and zeros
    elsewhere, so ``Qbd @ K^T`` is one plain batched GEMM with H rows per request over
    ``[L, Hkv*D]``; ``P @ V`` gives every head against every KV head and the diagonal is kept.
    The Hkv-fold extra FLOPs are cheaper than SDPA's small per-head tiles in bf16 (not in fp32).
    ``bias`` is ``_decode_bias(seq_lens, L, q.dtype)``, passed in when the caller reuses it.
    """
    batch, num_heads, head_dim = q.shape
    length = keys.shape[1]
    group = num_heads // num_kv_heads
    width = num_kv_heads * head_dim
    if num_kv_heads == 1:
        q_wide = q * scale
    else:
        eye = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device) * scale
        q_wide = q.view(batch, num_kv_heads, group, 1, head_dim) * eye.view(1, num_kv_heads, 1, num_kv_heads, 1)
    q_wide = q_wide.reshape(batch, num_heads, width)
    if bias is None:
        bias = _decode_bias(seq_lens, length, q.dtype)
    scores = torch.baddbmm(bias.expand(batch, num_heads, length), q_wide, keys.view(batch, length, width).transpose(1, 2))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, values.view(batch, length, width))  # [B, H, Hkv*D]
    if num_kv_heads == 1:
        return out
    out = out.view(batch, num_kv_heads, group, num_kv_heads, head_dim)
    return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(batch, num_heads, head_dim)


def _decode_sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``_decode_bmm``, through one SDPA call on strided views.

    The G query heads sharing a KV head become G query rows of that head (no KV repeat).
    """
    batch, num_heads, head_dim = q.shape
    length = keys.shape[1]
    group = num_heads // num_kv_heads
    positions = torch.arange(length, device=q.device, dtype=seq_lens.dtype)
    mask = (positions[None, :] < seq_lens[:, None]).view(batch, 1, 1, length)
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, group, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


# Decodes are attended in chunks whose gathered K+V fit in about this many bytes, so the gather
# and the GEMMs that read it back work out of cache instead of main memory. Requests are sorted
# by length first, which also cuts padding. Measured on a 2-core EPYC (see tests/kernels/bench).
DECODE_CHUNK_BYTES = 8 << 20


def _decode_chunks(seq_lens: list[int], block_size: int, bytes_per_token: int) -> list[list[int]]:
    """Split request indices, sorted by length, into chunks under DECODE_CHUNK_BYTES."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    chunks: list[list[int]] = [[]]
    for i in order:
        padded = -(-seq_lens[i] // block_size) * block_size  # longest so far: order is ascending
        if chunks[-1] and (len(chunks[-1]) + 1) * padded * bytes_per_token > DECODE_CHUNK_BYTES:
            chunks.append([])
        chunks[-1].append(i)
    return chunks


def _pick_decode_kernel(dtype: torch.dtype, batch: int):
    """Measured: block-diagonal GEMMs win in bf16 from 2 requests on; SDPA wins in fp32 and for one."""
    if batch == 1:
        return _decode_single
    return _decode_bmm if dtype != torch.float32 else _decode_sdpa


def _decode_single(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor,
                   num_kv_heads: int, scale: float) -> torch.Tensor:
    """One request whose keys/values are cut to its exact length: SDPA with no mask at all
    (the single-stream decode path, where every avoided op shows in the token latency)."""
    _, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    out = F.scaled_dot_product_attention(
        q.view(1, num_kv_heads, group, head_dim), keys.transpose(1, 2), values.transpose(1, 2), scale=scale)
    return out.reshape(1, num_heads, head_dim)


class _DecodeChunk:
    """One chunk of decodes: which requests, their block tables cut to the chunk's longest
    request, their lengths, and (bf16 path) the additive length mask."""

    __slots__ = ("index", "tables", "lens", "num_blocks", "kernel", "bias", "exact_len")

    def __init__(self, index, tables, lens, num_blocks, kernel, bias, exact_len):
        self.index, self.tables, self.lens, self.num_blocks = index, tables, lens, num_blocks
        self.kernel, self.bias, self.exact_len = kernel, bias, exact_len


def _decode_plan(meta: AttentionMetadata, batch: int, block_size: int, bytes_per_token: int,
                 dtype: torch.dtype) -> list[_DecodeChunk]:
    """Chunks, index tensors and masks for this step's decodes; the same for every layer."""
    plan = meta.cpu_plan
    if plan is not None and plan[0] == (batch, dtype):
        return plan[1]
    seq_lens_host = meta.seq_lens_host
    chunk_ids = _decode_chunks(seq_lens_host[:batch], block_size, bytes_per_token)
    chunks = []
    for ids in chunk_ids:
        if len(chunk_ids) == 1:
            index, tables, lens = None, meta.block_tables[:batch], meta.seq_lens[:batch]
        else:
            index = torch.tensor(ids, dtype=torch.int64, device=meta.seq_lens.device)
            tables, lens = meta.block_tables[index], meta.seq_lens[index]
        num_blocks = -(-max(seq_lens_host[i] for i in ids) // block_size)
        tables = tables[:, :num_blocks]
        kernel = _pick_decode_kernel(dtype, len(ids))
        bias = _decode_bias(lens, num_blocks * block_size, dtype) if kernel is _decode_bmm else None
        exact_len = seq_lens_host[ids[0]] if kernel is _decode_single else None
        chunks.append(_DecodeChunk(index, tables, lens, num_blocks, kernel, bias, exact_len))
    meta.cpu_plan = ((batch, dtype), chunks)
    return chunks


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One query token per request: q ``[B, H, D]`` -> ``out [B, H, D]``."""
    batch = q.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    bytes_per_token = 2 * num_kv_heads * head_dim * k_cache.element_size()
    for chunk in _decode_plan(meta, batch, block_size, bytes_per_token, q.dtype):
        q_c = q if chunk.index is None else q[chunk.index]
        shape = (chunk.tables.shape[0], chunk.num_blocks * block_size, num_kv_heads, head_dim)
        keys = _gather_blocks(k_cache, chunk.tables, "k", q.dtype).view(shape)
        values = _gather_blocks(v_cache, chunk.tables, "v", q.dtype).view(shape)
        if chunk.exact_len is not None:
            keys, values = keys[:, : chunk.exact_len], values[:, : chunk.exact_len]
        if chunk.bias is not None:
            result = chunk.kernel(q_c, keys, values, chunk.lens, num_kv_heads, scale, chunk.bias)
        else:
            result = chunk.kernel(q_c, keys, values, chunk.lens, num_kv_heads, scale)
        if chunk.index is None:
            out.copy_(result)
        else:
            out.index_copy_(0, chunk.index, result)


def _prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One request's chunk: q ``[Q, H, D]`` are the last Q of ``seq_len`` tokens -> ``[Q, H, D]``."""
    query_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    keys = _gather_blocks(k_cache, block_table[:num_blocks], dtype=q.dtype).view(-1, num_kv_heads, head_dim)[:seq_len]
    values = _gather_blocks(v_cache, block_table[:num_blocks], dtype=q.dtype).view(-1, num_kv_heads, head_dim)[:seq_len]
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    keys = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
    values = values.transpose(0, 1).unsqueeze(0)
    context_len = seq_len - query_len
    if context_len == 0:
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    else:
        rows = torch.arange(query_len, device=q.device)[:, None] + context_len
        cols = torch.arange(seq_len, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=cols <= rows, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    return out[0].transpose(0, 1)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the flat batch ``q [T, H, D]`` over the paged cache -> ``[T, H, D]`` in q's dtype.

    Writes into ``out`` when given. Rows beyond ``meta.num_tokens`` (padding for static batch
    shapes) come back as zeros.
    """
    return split_decode_prefill(q, k_cache, v_cache, meta, scale, out, _decode_attention)


def split_decode_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None,
    decode: Callable[..., None],
) -> torch.Tensor:
    """The one place a CPU step's flat batch is split (the torch path and kernels.cpu_attention's
    C decode both go through it): the first ``meta.num_decodes`` requests have one query row each
    and go to ``decode(q[:n], k_cache, v_cache, meta, scale, out[:n])``; the requests after them
    are prefill chunks (``prefill_attention_torch``). Padding rows past ``meta.num_tokens`` are
    zeroed; ``out`` is allocated when None."""
    if not readable(k_cache.dtype, q.dtype):
        raise TypeError(f"KV cache dtype {k_cache.dtype} differs from query dtype {q.dtype}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k_cache.shape[2]} KV heads")
    num_tokens = meta.num_tokens
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] > num_tokens:
        out[num_tokens:].zero_()
    num_decodes = meta.num_decodes
    if num_decodes > 0:
        decode(q[:num_decodes], k_cache, v_cache, meta, scale, out[:num_decodes])
    prefill_attention_torch(q, k_cache, v_cache, meta, scale, out)
    return out


def prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The requests after the decodes (prefill chunks), one SDPA call each, into ``out``."""
    starts = meta.query_start_loc_host
    seq_lens = meta.seq_lens_host
    for r in range(meta.num_decodes, meta.num_requests):
        start, end = starts[r], starts[r + 1]
        if end == start:
            continue
        out[start:end] = _prefill_attention(
            q[start:end], k_cache, v_cache, meta.block_tables[r], seq_lens[r], scale
        )
