"""Pipeline parallelism: one model runner per stage, activations handed on with send/recv.

Ranks: global rank = stage * tp_size + tp_rank (gpu/parallel_state.py). Every rank reads every
step from the step ring and keeps the same per-sequence bookkeeping (token counts, block
tables), so each can build the step's flat inputs (positions, slot mapping, block tables) by
itself; only activations travel between stages. The first stage embeds the tokens, runs its
layers and sends the hidden states (and the residual stream for models that keep one) to the
next stage's rank of the same tensor rank; the last stage receives, finishes the model (norm,
logits), samples and answers on the reply ring (it is the executor's output rank).

KV cache on a pipeline: the engine's block manager hands a sequence one block table, and every
stage applies that same table to the caches of its *own* layers only. Block ``b`` on stage
``s`` holds the K/V of stage ``s``'s layers for the tokens the table maps to ``b``; a block id
means the same tokens on every stage, so nothing about KV travels between stages. Each stage
sizes its cache from its own layers (a block costs ``layers of the stage x ...`` bytes there),
and the executor takes the smallest block count any rank reports.

Sampled tokens: only the last stage samples. A sequence's next step needs its last sampled token
as input on the first stage, so the executor forwards each reply's (seq id, token) pairs to
the workers ahead of the next step (gpu/pipeline_tokens.py); stages before the last append
them, as the last stage did when it sampled (vLLM's scheduler sends new token ids for PP for the
same reason). The engine schedules a sequence again only after processing the step that sampled
its token, so the tokens always arrive before the step that uses them.

Batches in flight: the engine keeps up to ``pipeline_parallel_size`` steps sent (EngineCore /
AsyncEngine with ``executor.max_in_flight``), each sequence in at most one (Scheduler.in_flight:
such a sequence is neither scheduled again nor preempted). A stage sends its activations
asynchronously (``isend``) and takes its next step at once, so stages work on different steps at
the same time; every stage runs steps in ring order and replies come back in order.
"""
from __future__ import annotations

import logging

import torch

from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.kv_alloc import zeroed_tensor
from pagedserve.contracts.messages import StepInput, StepOutput
from pagedserve.gpu.batch import BatchRequest
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.models.stages import StageActivations
from pagedserve.gpu.parallel_state import get_pp_peers

logger = logging.getLogger(__name__)

# Activations cross the wire as raw tensors; a 4-int header says their dtypes and width.
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class StageLink:
    """Point-to-point activations between neighbouring stages (gloo on CPU, NCCL on CUDA).

    Sends are asynchronous: the sending stage goes on with its next step while the tensors
    drain; a send's tensors are kept until it completes (and waited for before the next one)."""

    def __init__(self, device: torch.device):
        self.prev, self.next = get_pp_peers()
        self.device = device
        self._pending: list = []  # (work, tensors) of sends not yet known complete

    def send(self, acts: StageActivations) -> None:
        import torch.distributed as dist

        self._drain()
        tensors = [acts.hidden.contiguous()]
        if acts.residual is not None:
            tensors.append(acts.residual.contiguous())
        res_dtype = _DTYPES.index(acts.residual.dtype) if acts.residual is not None else -1
        header = torch.tensor([_DTYPES.index(acts.hidden.dtype), res_dtype, acts.hidden.shape[0],
                               acts.hidden.shape[1]], dtype=torch.int64, device=self.device)
        works = [dist.isend(t, self.next) for t in [header, *tensors]]
        self._pending.append((works, [header, *tensors]))

    def recv(self) -> StageActivations:
        import torch.distributed as dist

        header = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(header, self.prev)
        h_dtype, r_dtype, rows, cols = header.tolist()
        hidden = torch.empty(rows, cols, dtype=_DTYPES[h_dtype], device=self.device)
        dist.recv(hidden, self.prev)
        residual = None
        if r_dtype >= 0:
            residual = torch.empty(rows, cols, dtype=_DTYPES[r_dtype], device=self.device)
            dist.recv(residual, self.prev)
        return StageActivations(hidden, residual)

    def _drain(self) -> None:
        for works, _ in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()

    def close(self) -> None:
        self._drain()


class PipelineModelRunner(ModelRunner):
    """A ModelRunner for one pipeline stage: KV for its own layers, activations in and out."""

    def __init__(self, config, rank: int = 0):
        super().__init__(config, rank)
        self.link: StageLink | None = None

    def initialize(self) -> int:
        num_blocks = super().initialize()
        self.link = StageLink(self.device)
        s = self.model.stage
        logger.info("pipeline stage: layers %d..%d of %d%s%s", s.start, s.end - 1, self.model.num_layers,
                    ", embedding" if s.first else "", ", norm + logits" if s.last else "")
        return num_blocks

    def _setup_graph_runner(self) -> None:
        """Decode graphs capture a whole model; a stage runs eagerly."""

    @property
    def _stage_layers(self) -> range:
        s = self.model.stage
        return range(s.start, s.end)

    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * len(self._stage_layers) * self.block_size * m.num_kv_heads * m.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Caches for this stage's layers only; the list stays indexed by global layer number
        (``Attention.layer_idx``), None where another stage owns the layer."""
        m = self.model
        shape = (num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [(zeroed_tensor(shape, self.kv_dtype, self.device),
                           zeroed_tensor(shape, self.kv_dtype, self.device))
                          if i in self._stage_layers else None for i in range(m.num_layers)]
        self.num_blocks = num_blocks
        logger.info("KV cache for layers %d..%d: %d blocks x %d tokens, %.2f GiB", self._stage_layers[0],
                    self._stage_layers[-1], num_blocks, self.block_size,
                    num_blocks * self.kv_bytes_per_block() / 2**30)

    def _run_model(self, batch, lora=None):  # no LoRA with pipeline stages (EngineConfig refuses it)
        stage = self.model.stage
        intermediate = None if stage.first else self.link.recv()
        with forward_context(batch.meta, self.kv_caches):
            out = self.model(batch.input_ids, batch.positions, intermediate)
        if stage.last:
            return out
        self.link.send(out)
        return None

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        if self.model.stage.last:
            return super().execute(step)  # its _run_model receives the activations
        # A stage before the last: the same bookkeeping as ModelRunner.execute (swaps and block
        # copies of its own layers included), the forward of its layers, no sampling (the tokens
        # come back through accept_sampled).
        states = self.begin_step(step)
        if not states:
            return StepOutput(step.step_id)
        requests = [BatchRequest(s.token_ids[s.num_computed:s.num_computed + n], s.num_computed, s.block_table)
                    for s, n in zip(states, step.num_new_tokens)]
        self._run_model(self.prepare(requests))
        for s, n in zip(states, step.num_new_tokens):
            s.num_computed += n
        return StepOutput(step.step_id)

    def accept_sampled(self, seq_ids: list[int], token_ids: list[int]) -> None:
        """Tokens the last stage sampled: append them where this stage has not (stages before
        the last). A token that does not follow the sequence's computed tokens is a protocol
        fault; raising ends this worker, and the executor fails the group."""
        if self.model.stage.last:
            return
        for seq_id, token in zip(seq_ids, token_ids):
            s = self.seqs.get(seq_id)
            if s is None:
                continue  # finished or preempted since (its worker state is gone)
            if len(s.token_ids) != s.num_computed:
                raise RuntimeError(f"sampled token for sequence {seq_id} arrived with {len(s.token_ids)} "
                                   f"tokens held and {s.num_computed} computed")
            s.token_ids.append(token)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
