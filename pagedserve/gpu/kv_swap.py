"""The host swap pool of one worker: where preempted sequences' K/V wait (--preemption-mode swap).

One host tensor per layer for K and one for V, shaped like that worker's device cache
(``[num_swap_blocks, block_size, num_kv_heads (this rank's shard), head_dim]``), so under tensor
parallelism each rank swaps its own shard. Pinned memory on CUDA (fast, asynchronous copies); on
CPU a separate host pool still saves recomputing a long context. The engine's block manager
decides which block goes where (engine/swap_space.py); the worker only copies, before the
forward of the step that carries the pairs, swap-outs first (contracts/messages.py says why).
"""
from __future__ import annotations

import logging

import torch

from pagedserve.gpu.kv_alloc import zeroed_tensor
from pagedserve.kernels.kv_cache_dtype import index_copy_rows
from pagedserve.contracts.messages import StepInput

logger = logging.getLogger(__name__)


def num_swap_blocks(config, bytes_per_block: int) -> int:
    """Host blocks for this worker: 0 unless swap mode; the fixed count, or the GiB budget."""
    if config.scheduler.preemption_mode != "swap":
        return 0
    cache = config.cache
    if cache.num_swap_blocks is not None:
        return max(0, int(cache.num_swap_blocks))
    return max(0, int(cache.swap_space * (1 << 30)) // bytes_per_block)


def owned_layers(device_caches: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (K, V) caches this worker holds: a pipeline stage's list has None for other stages' layers."""
    return [c for c in device_caches if c is not None]


class HostSwapPool:
    def __init__(self, device_caches: list[tuple[torch.Tensor, torch.Tensor] | None], num_blocks: int):
        self.num_blocks = num_blocks
        owned = owned_layers(device_caches)
        self.device = owned[0][0].device if owned else torch.device("cpu")
        pin = self.device.type == "cuda"
        self.caches = [(self._alloc(k, num_blocks, pin), self._alloc(v, num_blocks, pin)) for k, v in owned]

    @staticmethod
    def _alloc(like: torch.Tensor, num_blocks: int, pin: bool) -> torch.Tensor:
        shape = (num_blocks, *like.shape[1:])
        if pin:
            return torch.zeros(shape, dtype=like.dtype, pin_memory=True)
        return zeroed_tensor(shape, like.dtype, torch.device("cpu"))  # pages cost nothing until used

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    def apply(self, step: StepInput, device_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Carry out a step's swaps: device -> host, then host -> device."""
        if step.blocks_to_swap_out_buf:
            self.swap_out(device_caches, step.blocks_to_swap_out)
        if step.blocks_to_swap_in_buf:
            self.swap_in(device_caches, step.blocks_to_swap_in)

    def swap_out(self, device_caches, pairs: list[tuple[int, int]]) -> None:
        dev_idx = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=self.device)
        host_idx = torch.tensor([h for _, h in pairs], dtype=torch.long)
        for (dk, dv), (hk, hv) in zip(owned_layers(device_caches), self.caches):
            index_copy_rows(hk, host_idx, dk.index_select(0, dev_idx).to("cpu"))
            index_copy_rows(hv, host_idx, dv.index_select(0, dev_idx).to("cpu"))

    def swap_in(self, device_caches, pairs: list[tuple[int, int]]) -> None:
        host_idx = torch.tensor([h for h, _ in pairs], dtype=torch.long)
        dev_idx = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        non_blocking = self.device.type == "cuda"
        for (dk, dv), (hk, hv) in zip(owned_layers(device_caches), self.caches):
            index_copy_rows(dk, dev_idx, hk.index_select(0, host_idx).to(self.device, non_blocking=non_blocking))
            index_copy_rows(dv, dev_idx, hv.index_select(0, host_idx).to(self.device, non_blocking=non_blocking))
