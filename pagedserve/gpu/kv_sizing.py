"""How big a runner's paged KV cache is and where it lives: bytes per block, the block count from
the budget (CPU: --kv-cache-memory; CUDA: --gpu-memory-utilization less the weights and a profile
forward's peak), the caches themselves and the host swap pool.

A part of ``gpu.model_runner.ModelRunner`` (its base class) kept apart because it is start-up
arithmetic, not the step; it reads the runner's model, config, device, dtypes and draft runner.
"""
from __future__ import annotations

import logging

import torch

from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.kv_alloc import zeroed_tensor

logger = logging.getLogger(__name__)


class KVCacheSizing:
    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.drafter is not None:  # the draft's cache has as many blocks, out of the same budget
            per_block += self.drafter.bytes_per_block(self.block_size, self.kv_dtype)
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget(cache.gpu_memory_utilization)
        else:
            # On CPU the KV budget is configured directly (like VLLM_CPU_KVCACHE_SPACE).
            budget = int(cache.kv_cache_memory_gib * (1 << 30))
        blocks = budget // per_block
        if blocks < 2:
            flag = "--gpu-memory-utilization" if self.device.type == "cuda" else "--kv-cache-memory"
            raise MemoryError(f"KV cache budget {budget / 2**30:.2f} GiB holds no blocks "
                              f"({per_block} bytes each): raise {flag}")
        return int(blocks)

    def _cuda_kv_budget(self, utilization: float) -> int:
        """Device memory left for KV after weights and the peak of a profile forward (gpu/device.py
        kv_cache_budget), out of this process's share of the GPU."""
        from pagedserve.gpu.device import kv_cache_budget

        torch.cuda.synchronize(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_forward()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        if self._cuda_free_at_start is not None:
            free = self._cuda_free_at_start
        else:  # no initialize(): what is free now plus what this process's allocator holds
            free += torch.cuda.memory_reserved(self.device)
        return kv_cache_budget(free, total, utilization, weights, peak - weights)

    def profile_forward(self):
        """One forward of ``max_num_batched_tokens`` tokens without a KV cache (the whole batch as
        one causal sequence), for the peak activation memory on CUDA; the same code on any device.
        Positions wrap at the model's position table (a budget may exceed it: GPT-2's 1024 < 2048),
        and a pipeline stage without the embedding starts from zero activations, as if received."""
        n = self.config.scheduler.max_num_batched_tokens
        model = self.model
        positions = torch.arange(n, device=self.device) % model.max_positions
        intermediate = None if model.stage.first else model.profile_activations(n, self.dtype, self.device)
        with torch.inference_mode(), forward_context(None, []):
            return model(torch.zeros(n, dtype=torch.long, device=self.device), positions, intermediate)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        # Zeros, not empty: masked-out slots must hold finite numbers (0 * NaN is NaN).
        self.kv_caches = [(zeroed_tensor(shape, self.kv_dtype, self.device),
                           zeroed_tensor(shape, self.kv_dtype, self.device))
                          for _ in range(m.num_layers)]
        if self.drafter is not None:
            self.drafter.allocate(num_blocks, self.block_size, self.kv_dtype, self.device)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s)", num_blocks, self.block_size,
                    num_blocks * self.block_size, num_blocks * self.kv_bytes_per_block() / 2**30,
                    str(self.kv_dtype).removeprefix("torch."))

    def _allocate_swap_pool(self) -> None:
        from pagedserve.gpu.kv_swap import HostSwapPool, num_swap_blocks

        n = num_swap_blocks(self.config, self.kv_bytes_per_block())
        if n > 0:
            self.swap_pool = HostSwapPool(self.kv_caches, n)
            logger.info("swap pool: %d host blocks, %.2f GiB", n, self.swap_pool.nbytes / 2**30)
        self.num_swap_blocks = n
