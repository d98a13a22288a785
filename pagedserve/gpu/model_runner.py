"""The model runner: owns the model, the paged KV cache and the per-sequence device-side state.

It turns a StepInput (diffs only, see contracts/messages.py) into flat input tensors, runs one forward
over the mixed batch of decodes and prefill chunks, samples, and returns a StepOutput.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.contracts.config import EngineConfig
from pagedserve.gpu.device import checkpoint_dtype, resolve_device, resolve_dtype
from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.batch import BatchRequest, PreparedBatch
from pagedserve.gpu.host_staging import HostStaging
from pagedserve.gpu.sampling_host import on_device
from pagedserve.gpu.kv_sizing import KVCacheSizing
from pagedserve.gpu.kv_swap import owned_layers
from pagedserve.contracts.messages import NewSeq, PooledOutput, PromptLogprobs, SamplingOptions, StepInput, StepOutput
from pagedserve.gpu.pooling import new_pooler
from pagedserve.gpu.spec_verify import draft_slices, keep_accepted
from pagedserve.kernels import kv_cache_dtype
from pagedserve.kernels.kv_cache_dtype import index_copy_rows
from pagedserve.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqState:
    """What a worker remembers about one sequence between steps."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_table: list[int]
    options: SamplingOptions
    pooler: Any = None  # gpu.pooling.Pooler of a pooling (embedding) sequence: it samples nothing
    # gpu.sampling_logits.LogitsPrep: logit_bias / min_tokens ids as tensors, built at the first
    # sample and kept (None when the options have neither).
    logits_prep: Any = None


class ModelRunner(KVCacheSizing):
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.parallel.device)
        if self.device.type == "cuda" and self.device.index is None:
            # The GPU setup_torch (gpu/worker.py) made current for this rank and replica.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cuda_free_at_start: int | None = None
        if rank == 0:
            from pagedserve.gpu.device import describe_device

            logger.info("%s", describe_device(self.device))
        self.dtype = resolve_dtype(config.model.dtype, self.device, checkpoint_dtype(config.model.hf_config))
        self.kv_dtype = kv_cache_dtype.resolve(config.cache.cache_dtype, self.dtype, self.device)
        self.block_size = config.cache.block_size
        self.staging = HostStaging(self.device)  # a step's index arrays: one copy to a GPU
        self.seqs: dict[int, SeqState] = {}
        self.model = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.sampler = None
        self.graph_runner = None
        self.swap_pool = None  # gpu/kv_swap.HostSwapPool in --preemption-mode swap
        self.num_swap_blocks = 0
        self.lora = None  # gpu/lora_worker.WorkerLoRA under --enable-lora
        self.drafter = None  # gpu/spec_draft.DraftRunner with a draft model (speculative decoding)

    # ---- start-up -------------------------------------------------------------------------

    def initialize(self) -> int:
        """Load the model, size and allocate the KV cache; returns the number of blocks."""
        from pagedserve.gpu.huge_pages import loaded_onto_huge_pages
        from pagedserve.gpu.models.loader import load_model
        from pagedserve.gpu.sampler import Sampler

        t0 = time.perf_counter()
        cpu = self.device.type == "cpu"
        if self.device.type == "cuda":  # before the weights: what other processes leave this one
            self._cuda_free_at_start = torch.cuda.mem_get_info(self.device)[0]
        # CPU weights onto 2 MiB pages, before the KV cache is allocated (its pages stay untouched).
        with loaded_onto_huge_pages(background=True) if cpu else contextlib.nullcontext():
            self.model = load_model(self.config.model, self.device, self.dtype)
        if cpu:
            from pagedserve.kernels import fused

            fused.library()  # build (first run on this machine) or load now, not in the first step
            from pagedserve.gpu.models.packed_linear import warm_row_buckets

            sched = self.config.scheduler
            warm_row_buckets(self.model, sched.max_num_batched_tokens, sched.max_num_seqs)
        logger.info("loaded model in %.1f s (%s, %s)", time.perf_counter() - t0, self.dtype, self.device)
        if self.config.cache.cache_dtype == "auto":
            quantized = any(getattr(m, "qweight", None) is not None for m in self.model.modules())
            self.kv_dtype = kv_cache_dtype.auto(self.dtype, self.device, quantized)
        if self.config.lora.enable_lora:
            from pagedserve.gpu.lora_worker import WorkerLoRA

            self.lora = WorkerLoRA(self.model, self.config.lora, self.dtype, self.device)
        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model":
            from pagedserve.gpu.spec_draft import DraftRunner

            self.drafter = DraftRunner(spec, self.config.model)
            self.drafter.load(self.device, self.dtype, (self.config.model.hf_config or {}).get("vocab_size"))
        self.sampler = Sampler()
        self.num_blocks = self._num_blocks()
        self.allocate_kv_cache(self.num_blocks)
        self._allocate_swap_pool()
        self._setup_graph_runner()
        return self.num_blocks

    def _setup_graph_runner(self) -> None:
        from pagedserve.gpu.graphs import DecodeGraphRunner

        eager = self.config.parallel.enforce_eager
        if eager is None:
            eager = self.device.type != "cuda"
        if eager:
            return
        if not getattr(self.model, "cuda_graphs", True):  # optional: models whose attention cannot be captured
            logger.info("%s runs eagerly: its windowed / soft-capped attention is not captured in CUDA graphs",
                        type(self.model).__name__)
            return
        max_len = self.config.model.max_model_len or 2048
        self.graph_runner = DecodeGraphRunner(
            self.model, self.kv_caches, self.config.parallel.cuda_graph_batch_sizes,
            max_blocks_per_seq=-(-max_len // self.block_size), device=self.device, max_model_len=max_len,
            max_loras=self.config.lora.max_loras if self.lora is not None else 0, mask_dtype=self.dtype)
        self.graph_runner.capture()

    # ---- one step -------------------------------------------------------------------------

    def prepare(self, requests: list[BatchRequest]) -> PreparedBatch:
        """Flat tensors and attention metadata for a batch (decodes should come first)."""
        B = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        num_decodes = 0
        counting_decodes = True
        max_blocks = 1
        for r in requests:
            n = len(r.token_ids)
            input_ids.extend(r.token_ids)
            positions.extend(range(r.start_position, r.start_position + n))
            query_start.append(query_start[-1] + n)
            seq_lens.append(r.start_position + n)
            if counting_decodes and n == 1:
                num_decodes += 1
            else:
                counting_decodes = False
            max_blocks = max(max_blocks, len(r.block_table))
        # Host arrays, then one staged copy to the device (gpu/host_staging.py; off CUDA the
        # tensors are built in place). Block tables as one padded array: a per-request copy
        # costs an op each (decode batches).
        block_tables = np.zeros((len(requests), max_blocks), dtype=np.int32)
        for i, r in enumerate(requests):
            block_tables[i, :len(r.block_table)] = r.block_table
        pos = np.asarray(positions, dtype=np.int64)
        if num_decodes == len(requests):
            # All decodes (the per-token step): one slot each.
            slots = [r.block_table[p // B] * B + p % B for r, p in zip(requests, positions)]
        else:
            req_index = np.repeat(np.arange(len(requests)), [len(r.token_ids) for r in requests])
            slots = block_tables[req_index, pos // B].astype(np.int64) * B + pos % B
        R, T = len(requests), len(input_ids)
        ids_t, pos_t, qsl_t, lens_t, tables_t, slots_t = self.staging.stage([
            (input_ids, torch.long, (T,)), (pos, torch.long, (T,)), (query_start, torch.int32, (R + 1,)),
            (seq_lens, torch.int32, (R,)), (block_tables, torch.int32, (R, max_blocks)), (slots, torch.long, (T,))])
        meta = AttentionMetadata(
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            block_tables=tables_t,
            slot_mapping=slots_t,
            num_decodes=num_decodes,
            max_query_len=max(query_start[i + 1] - query_start[i] for i in range(len(requests))),
            max_seq_len=max(seq_lens),
            query_start_loc_host=query_start,
            seq_lens_host=seq_lens,
        )
        return PreparedBatch(ids_t, pos_t, meta)

    @torch.inference_mode()
    def forward(self, requests: list[BatchRequest]) -> torch.Tensor:
        """Run a hand-built batch; returns float32 logits at each request's last new token."""
        batch = self.prepare(requests)
        hidden = self._run_model(batch)
        last = torch.tensor(batch.meta.query_start_loc_host[1:], device=self.device) - 1
        return self.model.compute_logits(hidden[last])

    def _run_model(self, batch: PreparedBatch, lora=None) -> torch.Tensor:
        """``lora``: the step's LoRABatch when rows use adapters (a decode step the graph runner
        takes carries it in its static slot buffers)."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch.meta):
            return self.graph_runner.run(batch.input_ids, batch.positions, batch.meta, lora)
        with forward_context(batch.meta, self.kv_caches, lora):
            return self.model(batch.input_ids, batch.positions)

    def begin_step(self, step: StepInput) -> list:
        """The bookkeeping before a forward, in contracts/messages.py's order (swaps, forgets, block
        copies, new sequences, new blocks): the scheduled sequences' states. Every runner (and
        every pipeline stage) starts a step here, so each keeps its own layers' KV in step."""
        if self.swap_pool is not None:
            self.swap_pool.apply(step, self.kv_caches)
        for seq_id in step.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.begin_step(step)
        if step.blocks_to_copy_buf:
            self.copy_blocks(step.blocks_to_copy)
        for new in step.new_seqs:
            self.seqs[new.seq_id] = self._new_state(new)
        states = [self.seqs[seq_id] for seq_id in step.seq_ids]
        for i, block in zip(step.new_block_seqs, step.new_block_ids):
            states[i].block_table.append(block)
        return states

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        states = self.begin_step(step)
        # adapters into their slots; a failed load empties its slot and fails its requests only
        lora_failed = self.lora.apply_loads(step.lora_loads) if self.lora is not None and step.lora_loads else []
        if not states:
            return StepOutput(step.step_id, lora_failed=lora_failed or None)
        drafts = draft_slices(step)  # speculative decoding: None unless some row has drafts
        if drafts is not None and self.drafter is not None:  # placeholders: the draft model proposes
            self.drafter.propose(self, step.seq_ids, states, drafts)
        requests: list[BatchRequest] = []
        first_request: list[int] = []  # per scheduled row, its first request (several: drafts)
        for i, (s, n) in enumerate(zip(states, step.num_new_tokens)):
            start = s.num_computed
            first_request.append(len(requests))
            if drafts is not None and drafts[i]:
                # Its last token and each draft as a decode row of its own over the same block table
                # (all K/V of a layer is written before its attention, so row j sees the drafts
                # before it): the decode kernels, and the very numbers of a plain decode.
                tokens = s.token_ids[start:start + 1] + drafts[i]
                requests.extend(BatchRequest([t], start + j, s.block_table) for j, t in enumerate(tokens))
            else:
                requests.append(BatchRequest(s.token_ids[start:start + n], start, s.block_table))
        batch = self.prepare(requests)
        lora = self.lora.batch(step, step.num_new_tokens.tolist()) if self.lora is not None else None
        hidden = self._run_model(batch, lora)

        qsl = batch.meta.query_start_loc_host
        if drafts is not None:  # each scheduled row's span of hidden rows
            qsl = [qsl[r] for r in first_request] + [qsl[-1]]
        sample_rows: list[int] = []
        sample_ids: list[int] = []
        sample_states: list[SeqState] = []
        sample_batch_idx: list[int] = []
        sample_tokens: list[list[int]] = []  # the tokens before each sampled position
        spec_rows: list[tuple[int, list[int]]] = []  # per sampled sequence: (first sampler row, drafts)
        prompt_logprobs: list[PromptLogprobs] = []
        pooled: list[PooledOutput] = []
        for i, (seq_id, s) in enumerate(zip(step.seq_ids, states)):
            n = qsl[i + 1] - qsl[i]
            if s.pooler is not None:  # embeddings: feed the pooler, never sample
                s.num_computed += n
                vector = s.pooler.add(hidden[qsl[i]:qsl[i + 1]], s.num_computed == len(s.token_ids))
                if vector is not None:
                    pooled.append(PooledOutput(seq_id, vector))
                continue
            if s.options.prompt_logprobs is not None and s.num_computed < s.num_prompt_tokens:
                prompt_logprobs.append(self._prompt_logprobs(seq_id, s, hidden[qsl[i]:qsl[i + 1]]))
            d = drafts[i] if drafts is not None else None
            if d:  # one position per draft and the bonus position (gpu/spec_verify.py)
                s.num_computed += 1
                spec_rows.append((len(sample_rows), d))
                for j in range(len(d) + 1):
                    sample_rows.append(qsl[i + 1] - 1 - len(d) + j)
                    sample_states.append(s)
                    sample_batch_idx.append(i if j == 0 else -1)
                    sample_tokens.append(s.token_ids + d[:j])
                sample_ids.append(seq_id)
                continue
            s.num_computed += n
            if s.num_computed == len(s.token_ids):
                sample_rows.append(qsl[i + 1] - 1)
                sample_ids.append(seq_id)
                sample_states.append(s)
                sample_batch_idx.append(i)
                sample_tokens.append(s.token_ids)
                if drafts is not None:
                    spec_rows.append((len(sample_rows) - 1, []))

        token_ids: list[int] = []
        logprobs = None
        if sample_rows:
            logits = self.model.compute_logits(hidden[on_device(hidden, sample_rows)], fp32=False)
            options = [s.options for s in sample_states]
            preps = self.sampler.logits_preps(logits, options, [s.logits_prep for s in sample_states])
            for s, p in zip(sample_states, preps):
                s.logits_prep = p
            result = self.sampler.sample(
                logits,
                options,
                sample_tokens,
                [s.num_prompt_tokens for s in sample_states],
                token_mask=self._token_mask(step, sample_batch_idx),
                preps=preps,
            )
            if drafts is not None:
                token_ids, logprobs, num_tokens = keep_accepted(spec_rows, sample_states, result, self.block_size)
            else:
                for s, token in zip(sample_states, result.token_ids):
                    s.token_ids.append(token)
                token_ids = result.token_ids
                logprobs = result.logprobs
        out = StepOutput.pack(step.step_id, sample_ids, token_ids, logprobs, prompt_logprobs or None,
                              num_tokens if drafts is not None and sample_rows else None)
        out.pooled = pooled or None
        out.lora_failed = lora_failed or None
        return out

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of beam forks: block dst takes block src's K/V in every layer."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for k_cache, v_cache in owned_layers(self.kv_caches):  # a pipeline stage: its own layers
            index_copy_rows(k_cache, dst, k_cache.index_select(0, src))
            index_copy_rows(v_cache, dst, v_cache.index_select(0, src))

    @staticmethod
    def _token_mask(step: StepInput, sample_batch_idx: list[int]):
        """The step's bitmask rows mapped from batch indexes to sampler rows."""
        if not step.token_mask_rows_buf:
            return None
        from pagedserve.gpu.sampling_mask import TokenMask

        where = {b: r for r, b in enumerate(sample_batch_idx)}
        batch_rows = step.token_mask_rows.tolist()
        if all(b in where for b in batch_rows):
            return TokenMask([where[b] for b in batch_rows], step.token_mask_buf)
        # A row that does not sample here (the engine and worker disagree): drop it, keep the rest.
        width = len(step.token_mask_buf) // len(batch_rows)
        keep = [k for k, b in enumerate(batch_rows) if b in where]
        bits = b"".join(step.token_mask_buf[k * width:(k + 1) * width] for k in keep)
        return TokenMask([where[batch_rows[k]] for k in keep], bits)

    def _new_state(self, new: NewSeq) -> SeqState:
        return SeqState(list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                        list(new.block_ids), new.sampling, new_pooler(new))

    def _prompt_logprobs(self, seq_id: int, s: SeqState, hidden: torch.Tensor) -> PromptLogprobs:
        """Logprobs of prompt tokens start+1 .. end of this chunk, given the tokens before them."""
        from pagedserve.gpu.sampler import compute_prompt_logprobs

        start = s.num_computed
        end = min(start + hidden.shape[0], s.num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
        if end <= start:
            return PromptLogprobs(seq_id, start + 1, [])
        logits = self.model.compute_logits(hidden[: end - start])
        targets = s.token_ids[start + 1:end + 1]
        entries = compute_prompt_logprobs(logits, targets, s.options.prompt_logprobs)
        return PromptLogprobs(seq_id, start + 1, entries)
