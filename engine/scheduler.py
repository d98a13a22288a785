"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

One ``schedule()`` call builds one step:
  1. RUNNING sequences, in order, each gets what it still has to compute (1 token for a decode,
     the next chunk for a prefill in progress), capped by the step's remaining token budget.
     When the block manager has no block for one, the victim (lowest priority, then latest
     arrival) is preempted: its blocks are freed, its generated tokens kept, and it goes back to
     the front of the waiting queue; it is recomputed later (cheaply when its blocks are still
     in the prefix cache). A victim already scheduled this step gives its tokens back.
  2. If nobody was preempted, WAITING sequences are admitted in order (fcfs: arrival, preempted
     first; priority: (priority, arrival)) while budget, ``max_num_seqs`` and free blocks allow.
     A prompt longer than the remaining budget is split into chunks over several steps. The
     queue stops at the first sequence that does not fit (no overtaking of a big request).

Bookkeeping mirrors the worker (gpu/messages.py): ``num_computed_tokens`` grows by the tokens
scheduled; a sequence samples when it reaches its token count, and the engine appends the
sampled token as the worker does. Sequences of n > 1 requests other than the first wait until
the prompt has been computed once, so that they hit its blocks in the prefix cache.

Contract: schedule() must not be called again before the previous step was processed, except
with pipeline stages (``EngineCore`` keeps up to pp steps in flight): a sequence in a step that is
sent but not yet processed (``in_flight``) is neither scheduled again nor preempted, so each
sequence is in at most one step in flight.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from engine.kv_blocks import BlockManager
from engine.request import Sequence, SeqStatus
from gpu.config import SchedulerConfig
from gpu.messages import NewSeq, StepInput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledStep:
    step_input: StepInput
    seqs: list[Sequence]  # parallel to step_input.seq_ids
    num_new_tokens: list[int]
    samples: list[bool]  # whether each scheduled sequence samples a token this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {config.policy!r}: choose fcfs or priority")
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.config = config
        self.policy = config.policy
        self.bm = block_manager
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # Every running sequence needs at least one token of budget per step.
        self.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._finished_ids: list[int] = []  # seq ids the worker must forget at the next step
        self._step_id = 0
        self.num_preemptions = 0
        self.in_flight: set[int] = set()  # seq ids of steps scheduled but not yet processed

    # ---- ordering ---------------------------------------------------------------------------

    def _key(self, seq: Sequence) -> tuple:
        """Lower key = served first; the max key is the preemption victim."""
        if self.policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def _insert_waiting(self, seq: Sequence, front: bool = False) -> None:
        if self.policy == "priority":
            keys = [self._key(s) for s in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, self._key(seq)), seq)
        elif front:
            self.waiting.insert(0, seq)
        else:
            self.waiting.append(seq)

    def _insert_running(self, seq: Sequence) -> None:
        if self.policy == "priority":
            keys = [self._key(s) for s in self.running]
            self.running.insert(bisect.bisect_right(keys, self._key(seq)), seq)
        else:
            self.running.append(seq)

    # ---- lifecycle --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._insert_waiting(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence in any state (finished, aborted, failed): free its blocks and tell
        the worker to forget it."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.bm.free(seq.seq_id)
        self._forget_on_worker(seq)

    def _forget_on_worker(self, seq: Sequence) -> None:
        if seq.on_worker:
            self._finished_ids.append(seq.seq_id)
            seq.on_worker = False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        self._forget_on_worker(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(seq, front=True)
        logger.debug("preempted %r", seq)

    def _eligible(self, seq: Sequence) -> bool:
        if seq.index == 0 or not self.bm.enable_prefix_caching:
            return True
        req = seq.request
        return req.prefill_done or req.seqs[0].is_finished

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        budget = self.max_num_batched_tokens
        B = self.bm.block_size
        scheduled: dict[int, tuple[Sequence, int, list[int]]] = {}  # seq id -> (seq, n, new blocks)
        preempted: list[Sequence] = []

        # 1. running sequences
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in self.in_flight:
                continue  # preempted earlier in this loop, or in a step still in flight
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            new_blocks = None
            while True:
                new_blocks = self.bm.append_slots(seq.seq_id, seq.num_computed_tokens + num_new)
                if new_blocks is not None:
                    break
                victim = max((s for s in self.running if s.seq_id not in self.in_flight), key=self._key)
                if victim.seq_id in scheduled:
                    budget += scheduled.pop(victim.seq_id)[1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            scheduled[seq.seq_id] = (seq, num_new, new_blocks)
            budget -= num_new

        # 2. waiting sequences
        new_seqs: list[NewSeq] = []
        if not preempted:
            i = 0
            while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[i]
                if not self._eligible(seq):
                    i += 1
                    continue
                cached = self.bm.find_cached_prefix(seq) if seq.use_prefix_cache else []
                num_computed = len(cached) * B
                num_new = min(seq.num_tokens - num_computed, budget)
                table = self.bm.allocate_new(seq, cached, num_computed + num_new)
                if table is None:
                    break
                self.waiting.pop(i)
                seq.status = SeqStatus.RUNNING
                seq.num_computed_tokens = num_computed
                self._insert_running(seq)
                new_seqs.append(NewSeq(
                    seq_id=seq.seq_id,
                    token_ids=list(seq.token_ids),
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_computed_tokens=num_computed,
                    block_ids=list(table),
                    sampling=seq.options,
                ))
                seq.on_worker = True
                if seq.index == 0 and seq.request.num_cached_tokens == 0:
                    seq.request.num_cached_tokens = num_computed
                scheduled[seq.seq_id] = (seq, num_new, [])
                budget -= num_new

        if not scheduled:
            return None

        # Decodes (one new token) first, otherwise in scheduling order.
        entries = sorted(scheduled.values(), key=lambda e: e[1] != 1)
        seqs: list[Sequence] = []
        num_new_tokens: list[int] = []
        new_block_seqs: list[int] = []  # (batch index, block id) pairs, see gpu/messages.py
        new_block_ids: list[int] = []
        samples: list[bool] = []
        for i, (seq, n, blocks) in enumerate(entries):
            seq.num_computed_tokens += n
            seqs.append(seq)
            num_new_tokens.append(n)
            if blocks:
                new_block_seqs.extend([i] * len(blocks))
                new_block_ids.extend(blocks)
            samples.append(seq.num_computed_tokens == seq.num_tokens)
        self._step_id += 1
        step_input = StepInput.pack(
            step_id=self._step_id,
            new_seqs=new_seqs,
            seq_ids=[s.seq_id for s in seqs],
            num_new_tokens=num_new_tokens,
            new_block_seqs=new_block_seqs,
            new_block_ids=new_block_ids,
            finished_seq_ids=self._finished_ids,
        )
        self._finished_ids = []
        self.in_flight.update(s.seq_id for s in seqs)
        return ScheduledStep(step_input, seqs, num_new_tokens, samples, preempted)

    def step_not_sent(self, step: ScheduledStep) -> None:
        """The step never reached the workers (call after its requests were finished): its
        finished ids are due again, and its new sequences, never registered, must not be
        named as finished."""
        self.step_returned(step)
        unregistered = {ns.seq_id for ns in step.step_input.new_seqs}
        self._finished_ids = list(step.step_input.finished_seq_ids) + [
            i for i in self._finished_ids if i not in unregistered]

    def step_returned(self, step: ScheduledStep) -> None:
        """The step's reply (or failure) is in: its sequences may be scheduled again."""
        self.in_flight.difference_update(s.seq_id for s in step.seqs)

    def step_done(self, step: ScheduledStep) -> None:
        """The step's K/V is in the cache: publish full blocks to the prefix cache."""
        for seq in step.seqs:
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            self.bm.register_computed(seq, seq.num_computed_tokens)
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.request.prefill_done = True
