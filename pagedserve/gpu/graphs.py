"""Decode-step graph runner: pad a decode batch to a captured size and run it from static buffers.

On CUDA each capture size gets a ``torch.cuda.CUDAGraph`` (one shared memory pool) that is
replayed after the step's inputs are copied into the static buffers, so a decode step costs a
handful of copies and one launch. On CPU there is nothing to capture; the same padded
static-buffer path runs eagerly, which keeps the padding logic covered by the tests here.

Padding rows compute a harmless 1-token sequence: token 0 at position 0, seq_len 1, block table
of zeros, and slot -1 so nothing is written to the cache; their outputs are dropped.

Under --enable-lora every step (adapter rows or none) runs over the adapter slots in static
buffers (gpu/models/lora_layers.py StaticLoRABatch, k = max_loras), so the LoRA delta is part of
each captured graph and the step's slot choice lives only in the buffers' contents; padding rows
and base-only steps read mask 0, slot -1. Slot loads copy into the same A/B tensors in place, so
the graphs keep reading the current adapters.
"""
from __future__ import annotations

import bisect
import logging

import torch

from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.models.lora_layers import LoRABatch, StaticLoRABatch
from pagedserve.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    def __init__(self, model, kv_caches, capture_sizes: list[int], max_blocks_per_seq: int,
                 device: torch.device, max_model_len: int, max_loras: int = 0, mask_dtype=None):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(set(capture_sizes))
        self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.max_model_len = max_model_len
        S = self.max_size
        self.input_ids = torch.zeros(S, dtype=torch.long, device=device)
        self.positions = torch.zeros(S, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((S,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(S, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((S, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(S + 1, dtype=torch.int32, device=device)
        self.token_request = torch.arange(S, dtype=torch.int32, device=device)  # decode rows: token t is request t
        # the adapter slots' static form when LoRA is on (max_loras > 0); mask_dtype: the model's
        self.lora = StaticLoRABatch(S, max_loras, mask_dtype, device) if max_loras else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (meta.num_decodes == meta.num_requests and meta.num_requests <= self.max_size
                and meta.block_tables.shape[1] <= self.max_blocks)

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy the step into the static buffers, pad up to the capture size; returns that size."""
        n = meta.num_requests
        size = self.padded_size(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        # Reset the padding rows (earlier, larger steps may have left data there).
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[n:size].zero_()
        return size

    def _static_meta(self, size: int, width: int, seq_lens_host: list[int], max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size, :width],
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_host=list(range(size + 1)),
            seq_lens_host=seq_lens_host,
            token_request=self.token_request[:size],
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora: LoRABatch | None = None) -> torch.Tensor:
        """Hidden states of the n decode tokens, computed at the padded batch size. ``lora``: the
        step's LoRABatch (None: no adapter rows), written into the static slot buffers."""
        n = meta.num_requests
        size = self._fill(input_ids, positions, meta)
        static_lora = self.lora.fill(lora, n, size) if self.lora is not None else None
        if size in self.graphs:
            self.graphs[size].replay()
            return self.graph_outputs[size][:n]
        # Eager (CPU, or CUDA before capture): only the block-table columns in use are read.
        width = meta.block_tables.shape[1]
        padded_lens = meta.seq_lens_host + [1] * (size - n)
        static = self._static_meta(size, width, padded_lens, meta.max_seq_len)
        with forward_context(static, self.kv_caches, static_lora):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
        return hidden[:n]

    def capture(self) -> None:
        """CUDA only: capture one graph per size, largest first, sharing one memory pool."""
        if self.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._static_meta(size, self.max_blocks, [1] * size, self.max_model_len)
            static_lora = self.lora.view(size) if self.lora is not None else None
            with forward_context(meta, self.kv_caches, static_lora):
                self.model(self.input_ids[:size], self.positions[:size])  # warm-up (Triton autotune, allocs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.graph_outputs[size] = self.model(self.input_ids[:size], self.positions[:size])
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.sizes)
