"""The draft model of speculative decoding (method "draft_model"): a smaller model of the same
vocabulary, run by the same worker over a paged KV cache of its own, proposing each speculating
row's k tokens greedily (k draft forwards) before the target verifies them (gpu/spec_verify.py).

Its cache uses the target's block ids (one more cache tensor per draft layer, the same number of
blocks), so the scheduler's slots, rollback and trimming hold for both. What the draft has
computed is tracked per sequence and caught up lazily: a speculating row first runs the draft
over every token it has not seen (its whole context the first time, after a preemption or a
prefix-cache hit too, since blocks shared or swapped in carry no draft K/V one can trust), then
its k - 1 drafts. Draft K/V written for drafts the target rejects is simply not counted (the
draft's count is capped at the target's computed tokens). Greedy drafts are a point mass, which
is what makes the verification's sample-and-compare exact rejection sampling.
"""
from __future__ import annotations

import logging

import torch

from pagedserve.contracts.config import ConfigError, ModelConfig, SpeculativeConfig
from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.kv_alloc import zeroed_tensor

logger = logging.getLogger(__name__)


class DraftRunner:
    def __init__(self, spec: SpeculativeConfig, target_config: ModelConfig) -> None:
        self.spec = spec
        self.target_config = target_config
        self.model = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.computed: dict[int, int] = {}  # seq id -> leading tokens whose draft K/V is cached

    def load(self, device: torch.device, dtype: torch.dtype, target_vocab: int | None) -> None:
        from pagedserve.gpu.models.loader import load_model

        self.model = load_model(ModelConfig(model=self.spec.model, max_model_len=self.target_config.max_model_len),
                                device, dtype)
        vocab = (getattr(self.model, "config", None) or {}).get("vocab_size")
        if target_vocab is not None and vocab != target_vocab:
            raise ConfigError(f"--speculative-config: the draft model {self.spec.model} has a vocabulary of {vocab} "
                              f"tokens but the model has {target_vocab}: the draft must share the tokenizer")

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        m = self.model
        elem = torch.empty((), dtype=kv_dtype).element_size()
        return 2 * m.num_layers * block_size * m.num_kv_heads * m.head_dim * elem

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device) -> None:
        m = self.model
        shape = (num_blocks, block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [(zeroed_tensor(shape, kv_dtype, device), zeroed_tensor(shape, kv_dtype, device))
                          for _ in range(m.num_layers)]

    def begin_step(self, step) -> None:
        for seq_id in step.finished_seq_ids:
            self.computed.pop(seq_id, None)
        for new in step.new_seqs:
            self.computed[new.seq_id] = 0

    def propose(self, runner, seq_ids, states: list, drafts: list[list[int]]) -> None:
        """Replace each speculating row's placeholder drafts with the draft model's greedy tokens
        (before the target's forward: ``states`` still count the step's tokens as not computed)."""
        from pagedserve.gpu.batch import BatchRequest
        from pagedserve.gpu.sampler import greedy

        rows = [i for i, d in enumerate(drafts) if d]
        if not rows:
            return
        requests = []
        for i in rows:
            s = states[i]
            end = s.num_computed + 1  # through the row's last token
            start = min(self._computed(seq_ids[i], s), end - 1)
            requests.append(BatchRequest(s.token_ids[start:end], start, s.block_table))
        tokens = self._greedy_last(runner, requests, greedy)
        proposed = {i: [t] for i, t in zip(rows, tokens)}
        for j in range(1, max(len(drafts[i]) for i in rows)):
            live = [i for i in rows if len(drafts[i]) > j]
            requests = [BatchRequest([proposed[i][-1]], states[i].num_computed + j, states[i].block_table)
                        for i in live]
            for i, t in zip(live, self._greedy_last(runner, requests, greedy)):
                proposed[i].append(t)
        for i in rows:
            drafts[i] = proposed[i][:len(drafts[i])]
            # Draft K/V now covers the row's tokens and its drafts but the last; the target's count
            # after verification caps what of it stands (``_computed``).
            self.computed[seq_ids[i]] = states[i].num_computed + len(drafts[i])

    def _computed(self, seq_id: int, s) -> int:
        return min(self.computed.get(seq_id, 0), s.num_computed)

    def _greedy_last(self, runner, requests, greedy) -> list[int]:
        batch = runner.prepare(requests)
        with forward_context(batch.meta, self.kv_caches):
            hidden = self.model(batch.input_ids, batch.positions)
        last = torch.tensor(batch.meta.query_start_loc_host[1:], device=hidden.device) - 1
        return greedy(self.model.compute_logits(hidden[last])).tolist()
