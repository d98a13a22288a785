"""CPU paged attention: decodes through the C kernel in csrc/paged_attn.c, prefill chunks through
torch SDPA (kernels.torch_attention, which stays the oracle and the fall-back, and owns the split
of a step into decodes and prefill chunks: ``split_decode_prefill``).

Why a kernel: the torch decode path copies every block it reads into a scratch buffer and, in
bf16, spends Hkv times the FLOPs on a block-diagonal GQA query. The C kernel reads K/V rows where
they are in the cache, once for all the query heads of a KV head, with an online softmax
(figures in loadtest/PERF.md). Where the CPU has AMX, bf16 decodes run the AMX kernel instead
(kernels/attn_amx.py, csrc/paged_attn_amx.c; same arguments). ``PAGEDSERVE_CPU_ATTENTION=torch``
selects the torch path; a machine without a C compiler falls back to it with one warning. The
build (AVX-512 BF16, AVX-512, AVX2, scalar) is kernels/isa.py's choice.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pagedserve.contracts import env
from pagedserve.kernels import abi, attn_amx, cbuild
from pagedserve.kernels.isa import choose
from pagedserve.kernels.kv_cache_dtype import FP8, readable
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.torch_attention import paged_attention_torch, split_decode_prefill

logger = logging.getLogger(__name__)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many multiply-adds (tokens x heads x head_dim, Q.K and P.V) a decode call runs on
# one thread: an OpenMP region costs more than it saves, and on a busy box it waits for the
# second thread to be scheduled. 2^18 is one request of ~230 tokens of the default model (9 heads
# x 64): one request of 320 tokens in two halves took 14.6 us against ~22 us on one thread
# (loadtest/PERF.md, "decode attention: per-step arguments, even split").
PARALLEL_MIN_MACS = 1 << 18
# With fewer requests than this many per thread, split each request's tokens into parts
# (flash-decoding) so that every thread has work.
ITEMS_PER_THREAD = 4
MIN_PART_BLOCKS = 4  # a part is at least this many blocks (each part costs a combine)


@functools.cache
def library(level: str | None = None) -> ctypes.CDLL | None:
    """The decode kernel for this CPU, or its best build at or below ``level`` (tests pin a build
    so); None when it cannot be built."""
    choice = choose("paged_attn") if level is None else choose("paged_attn", cap=level)  # (scalar: never None)
    try:
        lib = cbuild.build_kernel("paged_attn", choice)
    except cbuild.KernelBuildError as e:
        logger.warning("CPU attention kernel unavailable, using the torch path: %s", e)
        return None
    abi.bind(lib, "paged_attn")
    logger.info("CPU attention kernel: %s build (%d fp32 lanes)", choice.level, lib.pa_width())
    return lib


def isa() -> str:
    """Which build runs here: 'avx512', 'avx2', 'scalar', or 'torch' (no kernel)."""
    lib = library()
    if lib is None:
        return "torch"
    return {4: "avx512bf16", 3: "avx512", 2: "avx2"}.get(lib.pa_isa(), "scalar")


def dtype_code(dtype: torch.dtype, k_cache: torch.Tensor) -> int:
    """The kernels' ``dtype`` argument: 0 fp32 / 1 bf16 queries and output, + 2 for fp8 caches;
    4 for bf16 caches under fp32 queries."""
    if k_cache.dtype == torch.bfloat16 and dtype == torch.float32:
        return 4
    return _DTYPES[dtype] | (2 if k_cache.dtype == FP8 else 0)


def _kernel_for(dtype: torch.dtype, num_heads: int, k_cache: torch.Tensor) -> ctypes.CDLL | None:
    """The library when the kernel handles these shapes and dtypes (queries fp32 or bf16, caches
    the same, fp8, or bf16 under fp32: kv_cache_dtype.readable) in host memory, else None (torch path). A cache on another device (CUDA
    without Triton) never reaches C: the kernel would read a device pointer on the host."""
    if (env.CPU_ATTENTION.get() == "torch" or dtype not in _DTYPES or not readable(k_cache.dtype, dtype)
            or k_cache.device.type != "cpu"):
        return None
    lib = library()
    if lib is None:
        return None
    head_dim = k_cache.shape[3]
    group = num_heads // k_cache.shape[2]
    width, max_head_dim, max_group = _limits(lib)
    if head_dim % width or head_dim > max_head_dim or group > max_group:
        return None
    return lib


@functools.cache
def _limits(lib: ctypes.CDLL) -> tuple[int, int, int]:
    """(vector width, largest head_dim, largest group) of a build, asked once (called every layer)."""
    return lib.pa_width(), lib.pa_max_head_dim(), lib.pa_max_group()


def _threads_and_parts(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                       block_size: int) -> tuple[int, int]:
    """(threads, tokens per part; 0 = no split) for one decode call.

    The kernel's work item is one request (all its KV heads) or one part of its tokens. With fewer
    than ITEMS_PER_THREAD requests per thread, every request is cut into ``parts`` pieces of whole
    blocks, ``parts`` chosen so that the items divide evenly among the threads (one request on two
    threads: two halves, not three thirds that leave one thread a third idle)."""
    threads = torch.get_num_threads()
    if threads <= 1 or 2 * sum(seq_lens) * num_heads * head_dim < PARALLEL_MIN_MACS:
        return 1, 0
    requests = len(seq_lens)
    if requests >= ITEMS_PER_THREAD * threads:
        return threads, 0
    parts = -(-threads // requests)
    while (requests * parts) % threads:
        parts += 1
    longest = max(seq_lens)
    part = -(-longest // parts)
    part = max(MIN_PART_BLOCKS * block_size, -(-part // block_size) * block_size)  # whole blocks, not tiny
    return threads, (part if part < longest else 0)


class _StepCall:
    """The arguments of the kernel call that are the same for every layer of a step (int32 block
    tables and lengths, thread count and split), built by the first layer's call."""

    __slots__ = ("tables", "seq_lens", "threads", "part", "tables_ptr", "tables_stride", "seq_lens_ptr", "decode")

    def __init__(self, meta: AttentionMetadata, threads: int, part: int, decode=None) -> None:
        self.threads, self.part = threads, part
        self.decode = decode  # the AMX kernel's entry point, or None: the library's pa_decode
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            tables = tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens
        if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        self.tables, self.seq_lens = tables, seq_lens  # kept alive: the kernel reads their memory
        self.tables_ptr, self.tables_stride = tables.data_ptr(), tables.stride(0)
        self.seq_lens_ptr = seq_lens.data_ptr()


def step_call(meta: AttentionMetadata, key: tuple, threads: int, part: int, decode=None) -> _StepCall:
    """Pin the thread count, split and kernel (``decode``: ``pam_decode`` of kernels.attn_amx, or
    None for the library's ``pa_decode``) of this step's decode calls (tests, benchmarks); ``key``
    as in decode_attention_c. Kept in ``meta.cpu_plan`` as (key, call), the torch path's form."""
    call = _StepCall(meta, threads, part, decode)
    meta.cpu_plan = (key, call)
    return call


def _plan(meta: AttentionMetadata, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int, dtype: torch.dtype) -> _StepCall:
    """This step's decode call (threads, split, kernel), made by its first layer and kept in meta."""
    plan = meta.cpu_plan
    key = ("c", batch, num_heads, num_kv_heads, head_dim, block_size)
    if plan is not None and plan[0] == key:
        return plan[1]
    threads, part = _threads_and_parts(meta.seq_lens_host[:batch], num_heads, num_kv_heads, head_dim, block_size)
    return step_call(meta, key, threads, part, attn_amx.decode_fn(dtype, num_heads, num_kv_heads, head_dim))


def decode_call_by_address(meta: AttentionMetadata, dtype: torch.dtype, num_heads: int, k_cache: torch.Tensor,
                           v_cache: torch.Tensor) -> tuple[int, _StepCall] | None:
    """(kernel address, step call) for a C caller that runs this step's decodes itself (the fused
    decode stack, gpu/models/fast_decode.py), or None where paged_attention_cpu would not take them
    to the C kernel (torch path, shapes, dtypes, strided caches)."""
    lib = _kernel_for(dtype, num_heads, k_cache)
    if lib is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    call = _plan(meta, meta.num_decodes, num_heads, num_kv_heads, head_dim, block_size, dtype)
    return ctypes.cast(call.decode or lib.pa_decode, ctypes.c_void_p).value, call


def decode_attention_c(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """The first ``meta.num_decodes`` requests (one query row each): q ``[B, H, D]`` -> ``out``."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q_strides = q.stride()
    if q_strides[2] != 1 or q_strides[1] != head_dim:
        q = q.contiguous()
    target = out
    out_strides = out.stride()
    if out_strides[2] != 1 or out_strides[1] != head_dim:
        target = torch.empty_like(q)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the CPU attention kernel needs contiguous KV caches")
    call = _plan(meta, batch, num_heads, num_kv_heads, head_dim, block_size, q.dtype)
    kernel = call.decode or lib.pa_decode
    rc = kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), call.tables_ptr,
                call.tables_stride, call.seq_lens_ptr, batch, num_heads, num_kv_heads, head_dim, block_size, scale,
                target.data_ptr(), target.stride(0), dtype_code(q.dtype, k_cache), call.part, call.threads)
    if rc != 0:
        raise RuntimeError(f"paged attention kernel rejected its arguments (B={batch} H={num_heads} "
                           f"Hkv={num_kv_heads} D={head_dim} block={block_size}) or ran out of memory")
    if target is not out:
        out.copy_(target)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention_torch``; decodes through the C kernel when it applies."""
    lib = _kernel_for(q.dtype, q.shape[1], k_cache) if q.device.type == "cpu" else None
    if lib is None or meta.num_decodes == 0:
        return paged_attention_torch(q, k_cache, v_cache, meta, scale, out)
    return split_decode_prefill(q, k_cache, v_cache, meta, scale, out, _decode_with(lib))


@functools.cache
def _decode_with(lib: ctypes.CDLL):
    """decode_attention_c bound to ``lib``, made once rather than on every layer's call."""
    return functools.partial(decode_attention_c, lib)


if __name__ == "__main__":  # `python -m pagedserve.kernels.cpu_attention`: build now (install step), print the path taken
    logging.basicConfig(level=logging.INFO)
    amx = " + AMX for bf16 decodes" if attn_amx.library() is not None else ""
    print(f"CPU attention kernel ready: {isa()} build{amx}")
