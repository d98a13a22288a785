"""Attention metadata for one flat batch that mixes decodes and prefill chunks.

A step's batch is R requests laid out back to back in a flat token dimension of T tokens.
Request r owns query tokens ``query_start_loc[r] : query_start_loc[r + 1]`` (its ``query_len``
new tokens), which are the *last* ``query_len`` of its ``seq_len`` tokens; the K/V of all
``seq_len`` tokens (the new ones included, written just before attention by
``write_kv_cache``) live in the paged cache at the blocks of ``block_tables[r]``. Query token i
of request r sits at position ``seq_len - query_len + i`` and attends causally to keys
``0 ..= that position``.

Requests are ordered decodes first: the first ``num_decodes`` requests have query_len == 1, so
the CPU path can run them as one padded batch and the prefill chunks one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R + 1] int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [R] int32, tokens in context including this step's new tokens
    block_tables: torch.Tensor  # [R, max_blocks_per_req] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1 = do not write)
    num_decodes: int  # the first num_decodes requests have query_len == 1
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens (lists), so the CPU path never syncs.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # Per-step work the CPU kernels derive from the metadata (decode chunks, masks). Built by
    # the first layer's call and reused by every other layer of the same forward.
    cpu_plan: object | None = None
    # Each query token's request index ([T] int32, on the device) for the Triton decode kernel:
    # given by the graph runner (a decode-only batch: token t is request t), else derived by the
    # first layer's call (an arange and a searchsorted, two kernels) and reused by the others.
    token_request: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]
