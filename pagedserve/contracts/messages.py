"""Plain data that crosses the engine → worker boundary, once per step.

Only diffs travel: a sequence's prompt ids and sampling settings are sent once (``NewSeq``);
afterwards a step names the scheduled sequence ids, how many new tokens each computes and
which blocks were appended to which block table. Workers keep the rest of the per-sequence
state (token ids, number of computed tokens, block table) and append the token they sample
themselves, so a decode step carries no token ids at all.

Per-sequence columns of a step (and of its output) travel as packed machine integers in
``bytes`` fields, not as lists of ints: msgspec (and pickle) copy a bytes field in one go,
whereas 256 ints or 256 small lists cost one Python object each to decode, which used to be
most of a decode step's round trip. Producers build messages with ``pack``; consumers read
the columns through the read-only views ``seq_ids``, ``num_new_tokens``, ... (memoryviews
cast to int64 / int32: index, iterate, ``len``, ``tolist()``). Block appends are sparse: a
decode step gives most sequences no new block, so instead of one (mostly empty) list per
sequence the step carries (batch index, block id) pairs. Both ends run on the same host
(shared memory), so native byte order is fine.

Worker-side order of operations for one ``StepInput``:
  0. swaps (preemption by swapping): copy every ``blocks_to_swap_out`` pair (device block → host
     swap-pool block), then every ``blocks_to_swap_in`` pair (host block → device block), before
     anything else of the step. Out before in: a device block freed by a swap-out may be the
     destination of a swap-in of the same step (the engine never reuses a host block read by a
     swap-in before that step was sent);
  1. forget every id in ``finished_seq_ids`` (finished, aborted or preempted sequences);
  1b. copy the K/V of block ``src`` to block ``dst`` in every layer, for each (src, dst) pair of
     ``blocks_to_copy`` (copy-on-write of a beam fork's shared tail block, before the forward);
  2. register every ``NewSeq`` (a preempted sequence comes back as a NewSeq with the same id,
     its generated tokens included in ``token_ids``);
  3. for each k, append ``new_block_ids[k]`` to the block table of scheduled sequence
     ``seq_ids[new_block_seqs[k]]`` (k in order, so a table grows in the order listed);
  3b. load every ``lora_loads`` entry into its slot (multi-LoRA; the rows of the step then use
     ``lora_slots``);
  4. for each scheduled sequence i: compute tokens
     ``token_ids[num_computed : num_computed + num_new_tokens[i]]``;
  4b. speculative decoding: a row with d > 0 in ``num_draft_tokens`` is a decode whose
     ``num_new_tokens`` (1 + d) are its last token followed by its d draft tokens (the row's slice
     of ``draft_token_ids``). The worker samples at all 1 + d positions, each as a plain decode
     would given the tokens before it; it keeps the longest prefix of drafts equal to what it
     sampled, plus the token sampled after that prefix (a+1 tokens for a accepted drafts). It
     appends them, counts the last token and the a accepted drafts as computed, and cuts its
     block table to the blocks its tokens need (the engine frees the same tail blocks);
  5. a sequence whose ``num_computed`` reaches ``len(token_ids)`` samples one token, appends it
     to its own ``token_ids`` and reports it in ``StepOutput`` (a partial prefill chunk samples
     nothing). A pooling sequence (``NewSeq.pooling`` set: embeddings) samples nothing: each of
     its prefill chunks feeds its pooler, and when its prompt is computed the pooled vector
     goes back in ``StepOutput.pooled`` (gpu/pooling.py); the engine then finishes it.

Structs are msgspec Structs so the multi-process executor can encode them with msgpack
without pickling Python objects; the in-process executor passes them as they are.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable

import msgspec

SEQ_ID_FORMAT = "q"  # sequence ids: int64
INT_FORMAT = "i"  # token counts, batch indexes, block ids, token ids: int32


class StepEncodeError(ValueError):
    """A StepInput msgpack cannot encode (an integer past 64 bits in a request's settings).

    Nothing was sent: the workers and the executor are unaffected and no reply is due. The
    engine fails the requests of that step and goes on (the cause is one request's values, so
    it must not stop the engine for everyone)."""


def pack_seq_ids(values: Iterable[int] = ()) -> bytes:
    return array(SEQ_ID_FORMAT, values).tobytes()


def pack_ints(values: Iterable[int] = ()) -> bytes:
    """int32 column; a value out of range raises OverflowError here, on the producer's side."""
    return array(INT_FORMAT, values).tobytes()


class SamplingOptions(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What the device-side sampler needs for one sequence (converted from SamplingParams)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # Sampling is a pure function of (seed, number of tokens generated so far, logits), so a
    # seeded sequence gives the same tokens whatever else is in the batch and after preemption.
    # The engine always sets a seed (a random one when the user gave none).
    seed: int = 0
    logprobs: int | None = None  # None = no logprobs; k >= 0 = sampled token's logprob + top-k
    prompt_logprobs: int | None = None  # None = none; k >= 0 = per prompt position, actual + top-k
    min_tokens: int = 0
    # Token ids that may not be sampled while fewer than min_tokens tokens were generated.
    min_tokens_blocked_ids: tuple[int, ...] = ()


class PoolingOptions(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A pooling sequence (embeddings): prefill only, one vector back instead of tokens.

    ``pooling_type``: "last" (the last token's hidden state), "mean" (over the prompt) or "cls"
    (the first token's). Hidden states are taken after the model's final norm; ``dimensions``
    keeps the leading ones (Matryoshka truncation) before ``normalize`` (L2)."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None


class PooledOutput(msgspec.Struct, array_like=True):
    """One pooling sequence's result: float32 values, native byte order (one host)."""

    seq_id: int
    data_buf: bytes

    @property
    def data(self) -> memoryview:
        return memoryview(self.data_buf).cast("f")


class NewSeq(msgspec.Struct, array_like=True):
    seq_id: int
    token_ids: list[int]  # prompt + tokens already generated (a sequence resumed after preemption)
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (penalties need the split)
    num_computed_tokens: int  # leading tokens whose K/V are already in the cache (prefix-cache hit)
    block_ids: list[int]  # initial block table
    sampling: SamplingOptions
    pooling: PoolingOptions | None = None  # set for a pooling (embedding) sequence


class LoRALoad(msgspec.Struct, frozen=True, array_like=True):
    """Put adapter ``lora_id`` (the PEFT directory ``path``, checked by the engine) into the
    workers' stacked LoRA slot ``slot`` before the step's forward. Each worker reads the weights
    from ``path`` itself (one host, or the same path on every node, as vLLM) and keeps up to
    max_cpu_loras adapters loaded, so a reload into a slot is a copy, not a read."""

    slot: int
    lora_id: int
    path: str


class StepInput(msgspec.Struct, array_like=True):
    step_id: int
    new_seqs: list[NewSeq]
    seq_ids_buf: bytes  # int64: scheduled this step, in batch order
    num_new_tokens_buf: bytes  # int32: per scheduled sequence
    # Blocks appended to block tables this step, as pairs: new_block_ids[k] goes to the end of
    # the table of seq_ids[new_block_seqs[k]]. Pairs are in batch order, a sequence's blocks in
    # table order; a sequence that got no block has no pair.
    new_block_seqs_buf: bytes  # int32: batch index of each pair
    new_block_ids_buf: bytes  # int32: block id of each pair
    finished_seq_ids: list[int]  # forget these before running the step
    # Token bitmask of the constrained rows (structured outputs, allowed_token_ids, bad_words):
    # token_mask_rows = batch indexes (int32) of scheduled sequences that sample this step;
    # token_mask = their rows, int32 words row-major ([rows, ceil(vocab / 32)]); bit t of a row
    # (word t // 32, bit t % 32) set = token t may be sampled. Unconstrained rows send nothing.
    token_mask_rows_buf: bytes = b""
    token_mask_buf: bytes = b""
    # Preemption by swapping, as (source, destination) int32 pairs flattened: swap_out =
    # (device block, host block), swap_in = (host block, device block). Done before the forward.
    blocks_to_swap_out_buf: bytes = b""
    blocks_to_swap_in_buf: bytes = b""
    # Copy-on-write of KV blocks (beam search forks): int32 pairs src0, dst0, src1, dst1, ...; the
    # worker copies block src's K/V into block dst, every layer, before the forward.
    blocks_to_copy_buf: bytes = b""
    # Multi-LoRA: adapters to put into slots before the forward (only when a slot changes), and one
    # int32 per scheduled sequence, in batch order: its adapter's slot, -1 = the base model. Both
    # empty when no scheduled sequence uses an adapter.
    lora_loads: list[LoRALoad] | None = None
    lora_slots_buf: bytes = b""
    # Speculative decoding (step 4b above): int32 draft count per scheduled sequence, empty when no
    # row has drafts; the drafts themselves, flattened in batch order.
    num_draft_tokens_buf: bytes = b""
    draft_token_ids_buf: bytes = b""

    @classmethod
    def pack(cls, step_id: int, new_seqs: list[NewSeq], seq_ids: Iterable[int], num_new_tokens: Iterable[int],
             new_block_seqs: Iterable[int] = (), new_block_ids: Iterable[int] = (),
             finished_seq_ids: list[int] | None = None) -> StepInput:
        return cls(step_id, new_seqs, pack_seq_ids(seq_ids), pack_ints(num_new_tokens),
                   pack_ints(new_block_seqs), pack_ints(new_block_ids),
                   [] if finished_seq_ids is None else finished_seq_ids)

    @property
    def seq_ids(self) -> memoryview:
        return memoryview(self.seq_ids_buf).cast(SEQ_ID_FORMAT)

    @property
    def num_new_tokens(self) -> memoryview:
        return memoryview(self.num_new_tokens_buf).cast(INT_FORMAT)

    @property
    def new_block_seqs(self) -> memoryview:
        return memoryview(self.new_block_seqs_buf).cast(INT_FORMAT)

    @property
    def new_block_ids(self) -> memoryview:
        return memoryview(self.new_block_ids_buf).cast(INT_FORMAT)

    @property
    def lora_slots(self) -> memoryview:
        return memoryview(self.lora_slots_buf).cast(INT_FORMAT)

    @property
    def num_draft_tokens(self) -> memoryview:
        return memoryview(self.num_draft_tokens_buf).cast(INT_FORMAT)

    @property
    def draft_token_ids(self) -> memoryview:
        return memoryview(self.draft_token_ids_buf).cast(INT_FORMAT)

    @property
    def token_mask_rows(self) -> memoryview:
        return memoryview(self.token_mask_rows_buf).cast(INT_FORMAT)

    @property
    def blocks_to_copy(self) -> list[tuple[int, int]]:
        """The (src, dst) block pairs to copy before the forward."""
        return _pairs(self.blocks_to_copy_buf)

    @property
    def blocks_to_swap_out(self) -> list[tuple[int, int]]:
        return _pairs(self.blocks_to_swap_out_buf)

    @property
    def blocks_to_swap_in(self) -> list[tuple[int, int]]:
        return _pairs(self.blocks_to_swap_in_buf)


def pack_pairs(pairs: Iterable[tuple[int, int]]) -> bytes:
    """(a, b) pairs as one flat int32 column a0 b0 a1 b1 ..."""
    return pack_ints(x for pair in pairs for x in pair)


def _pairs(buf: bytes) -> list[tuple[int, int]]:
    flat = memoryview(buf).cast(INT_FORMAT).tolist()
    return list(zip(flat[0::2], flat[1::2]))


class SampledLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the chosen token and the top-k alternatives, as (token_id, logprob) pairs."""

    logprob: float
    top: list[tuple[int, float]]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Prompt logprobs computed by one prefill chunk.

    ``entries[i]`` is for prompt position ``first_position + i`` (>= 1): the logprob of the
    actual prompt token there given the tokens before it, and the top-k at that position.
    """

    seq_id: int
    first_position: int
    entries: list[SampledLogprobs]


class StepOutput(msgspec.Struct, array_like=True):
    step_id: int
    seq_ids_buf: bytes = b""  # int64: sequences that sampled a token this step, in batch order
    token_ids_buf: bytes = b""  # int32: the sampled token of each
    # One entry per sampled sequence when any sequence of the step asked for logprobs
    # (None for those that did not ask); None when nobody asked.
    logprobs: list[SampledLogprobs | None] | None = None
    prompt_logprobs: list[PromptLogprobs] | None = None
    error: str | None = None  # set when the worker failed this step; the engine fails the requests
    # Pooling sequences whose prompt was computed this step (they sample nothing); None = none.
    pooled: list[PooledOutput] | None = None
    # Speculative decoding: int32 count of tokens each sampled sequence got (1 + accepted drafts),
    # empty when every one got one. token_ids (and logprobs) then hold them all, flattened.
    num_tokens_buf: bytes = b""
    # Slots of this step's lora_loads that failed to load (emptied on every rank): the engine fails
    # the requests of those adapters in this step and forgets the slots. None = all loaded.
    lora_failed: list[int] | None = None

    @classmethod
    def pack(cls, step_id: int, seq_ids: Iterable[int], token_ids: Iterable[int],
             logprobs: list[SampledLogprobs | None] | None = None,
             prompt_logprobs: list[PromptLogprobs] | None = None,
             num_tokens: list[int] | None = None) -> StepOutput:
        out = cls(step_id, pack_seq_ids(seq_ids), pack_ints(token_ids), logprobs, prompt_logprobs)
        if num_tokens is not None and any(n != 1 for n in num_tokens):
            out.num_tokens_buf = pack_ints(num_tokens)
        return out

    @property
    def num_tokens(self) -> memoryview:
        return memoryview(self.num_tokens_buf).cast(INT_FORMAT)

    @property
    def seq_ids(self) -> memoryview:
        return memoryview(self.seq_ids_buf).cast(SEQ_ID_FORMAT)

    @property
    def token_ids(self) -> memoryview:
        return memoryview(self.token_ids_buf).cast(INT_FORMAT)


STEP_INPUT_ENCODER = msgspec.msgpack.Encoder()
STEP_INPUT_DECODER = msgspec.msgpack.Decoder(StepInput)
STEP_OUTPUT_DECODER = msgspec.msgpack.Decoder(StepOutput)
