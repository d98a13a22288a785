"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

One ``schedule()`` call builds one step:
  1. RUNNING sequences, in order, each gets what it still has to compute (1 token for a decode,
     the next chunk for a prefill in progress), capped by the step's remaining token budget.
     When the block manager has no block for one, the victim (lowest priority, then latest
     arrival) is preempted: its generated tokens are kept and it goes back to the front of the
     waiting queue. Recompute mode frees its blocks (recomputed later, cheaply when they are
     still in the prefix cache); swap mode copies its computed K/V to the host swap pool
     (engine/swap_space.py) and back when it resumes, falling back to recompute when the pool
     is full. A victim already scheduled this step gives its tokens back.
  2. If nobody was preempted, WAITING sequences are admitted in order (fcfs: arrival, preempted
     first; priority: (priority, arrival)) while budget, ``max_num_seqs`` and free blocks allow.
     A prompt longer than the remaining budget is split into chunks over several steps. The
     queue stops at the first sequence that does not fit (no overtaking of a big request),
     except under the priority policy: there a waiting sequence that does not fit preempts
     running sequences of strictly lower priority (lowest, then latest, first) until it fits;
     equal priorities never preempt each other, so they keep FCFS order.

Bookkeeping mirrors the worker (contracts/messages.py): ``num_computed_tokens`` grows by the tokens
scheduled; a sequence samples when it reaches its token count, and the engine appends the
sampled token as the worker does. Sequences of n > 1 requests other than the first wait until
the prompt has been computed once, so that they hit its blocks in the prefix cache.

Speculative decoding (``proposer`` set, engine/spec_ngram.py): a running sequence with exactly
one token left to compute may take up to k draft tokens after it, verified in the same step
(contracts/messages.py step 4b). The drafts count against the token budget and get KV slots
like any token; a sequence whose drafts find no free block runs without them before anyone is
preempted. ``num_computed_tokens`` grows by the real token only: ``accept_drafts`` adds the
accepted drafts once the step is back and frees the blocks only rejected drafts used, so the
prefix cache only ever registers accepted tokens. ``spec_disable_batch``: no drafts in a step
once that many sequences run (vLLM's disable_by_batch_size).

Contract: schedule() must not be called again before the previous step was processed, except
with pipeline stages (``EngineCore`` keeps up to pp steps in flight): a sequence in a step that is
sent but not yet processed (``in_flight``) is neither scheduled again nor preempted, so each
sequence is in at most one step in flight.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from pagedserve.engine.kv_blocks import BlockManager
from pagedserve.engine.request import Sequence, SeqStatus
from pagedserve.contracts.config import SchedulerConfig
from pagedserve.contracts.messages import NewSeq, StepInput, pack_ints, pack_pairs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledStep:
    step_input: StepInput
    seqs: list[Sequence]  # parallel to step_input.seq_ids
    num_new_tokens: list[int]
    samples: list[bool]  # whether each scheduled sequence samples a token this step
    preempted: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] | None = None  # parallel to seqs: each one's draft tokens (None: no drafts)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def _lora_key(seq: Sequence) -> tuple[int, str] | None:
    lora = seq.lora_request
    return None if lora is None else (lora.lora_int_id, lora.lora_path)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora_slots=None):
        """``lora_slots`` (engine/lora_slots.LoRASlots, under --enable-lora): a step then runs at
        most max_loras distinct adapters, and carries each row's slot."""
        # SchedulerConfig.__post_init__ has checked the policy, the mode and the limits.
        self.config = config
        self.policy = config.policy
        self.preemption_mode = config.preemption_mode
        self.bm = block_manager
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prompt_admit_tokens = max(0, config.prompt_admit_tokens or 0)
        # Every running sequence needs at least one token of budget per step.
        self.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._finished_ids: list[int] = []  # seq ids the worker must forget at the next step
        self._forked: list[Sequence] = []  # beam forks running but not yet announced to the worker
        self._step_id = 0
        self.num_preemptions = 0
        self.in_flight: set[int] = set()  # seq ids of steps scheduled but not yet processed
        self.lora_slots = lora_slots
        self.max_loras = lora_slots.config.max_loras if lora_slots is not None else 0
        # Speculative decoding: propose(seq_id, token_ids, max_tokens) -> drafts, forget(seq_id).
        self.proposer = None
        self.spec_disable_batch: int | None = None

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
        self.bm.swap.free(seq.seq_id)
        self._forget_on_worker(seq)
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)

    def _forget_on_worker(self, seq: Sequence) -> None:
        if seq.on_worker:
            self._finished_ids.append(seq.seq_id)
            seq.on_worker = False

    def _preempt(self, seq: Sequence) -> None:
        """Swap the sequence out when in swap mode and the host pool has room, else free its
        blocks for recompute; either way it waits again with its generated tokens kept."""
        self.running.remove(seq)
        # A beam that sampled and waits for its siblings (all its tokens computed) swaps all but
        # its last token: that one is recomputed so that it samples, and reports, again. A fork
        # not yet announced is recomputed: its private tail copy (blocks_to_copy) never happened.
        num_swapped = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if not (self.preemption_mode == "swap" and seq.on_worker
                and self.bm.swap_out(seq.seq_id, num_swapped)):
            self.bm.free(seq.seq_id)
        self._forget_on_worker(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(seq, front=True)
        logger.debug("preempted %r", seq)

    def _preempt_for(self, seq: Sequence, scheduled: dict, admitted: set[int],
                     preempted: list[Sequence], need_budget: bool) -> int | None:
        """Priority policy: make room for waiting ``seq`` by preempting the lowest-priority (then
        latest) running sequence, if it ranks strictly below ``seq`` (equal priorities keep FCFS
        order) and was not admitted this step; when the token budget is what is missing, only a
        sequence scheduled this step (that gives tokens back) helps. Returns the token budget
        given back, or None when nobody may be preempted."""
        if self.policy != "priority":
            return None
        # Beams are never victims here: a preempted beam comes back on private blocks, and a cache
        # sized for shared prompt blocks could then hold it waiting on its siblings forever.
        candidates = [s for s in self.running if s.seq_id not in admitted and s.request.beam is None
                      and (not need_budget or s.seq_id in scheduled)]
        if not candidates:
            return None
        victim = max(candidates, key=self._key)
        if victim.priority <= seq.priority:
            return None
        entry = scheduled.pop(victim.seq_id, None)
        self._preempt(victim)
        preempted.append(victim)
        return entry[1] if entry is not None else 0
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Beam search: ``child`` (parent's computed tokens, then one new token) runs at once on
        the parent's blocks, shared (engine/beam_search.py). It reaches the worker as a NewSeq at
        the next step, with a private copy of the shared tail block it is about to write."""
        self.bm.fork(parent.seq_id, child.seq_id)
        child.status = SeqStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self._insert_running(child)
        self._forked.append(child)

    def _unshare_forks(self, preempted: list[Sequence]) -> list[tuple[Sequence, list[int], list[int]]]:
        """Copy-on-write for the pending forks, before anything else allocates this step: each
        gets (fork, its table for the NewSeq, flat (src, dst) copies)."""
        out = []
        for seq in self._forked:
            if seq.status is not SeqStatus.RUNNING or seq.on_worker:
                continue  # finished or preempted meanwhile (a preempted one comes back as a NewSeq)
            pairs = self.bm.copy_on_write(seq.seq_id, seq.num_computed_tokens)
            if pairs is None:  # no free block: recompute it later like any preempted sequence
                self._preempt(seq)
                preempted.append(seq)
                continue
            out.append((seq, list(self.bm.table(seq.seq_id)), [x for pair in pairs for x in pair]))
        self._forked = []
        return out

    def _announce_forks(self, forks: list[tuple[Sequence, list[int], list[int]]]) -> tuple[list[NewSeq], list[int]]:
        """NewSeqs (and block copies) of the forks still running after step 1 of ``schedule``
        (one preempted there never reaches the worker; its copy is dropped)."""
        new_seqs: list[NewSeq] = []
        copies: list[int] = []
        for seq, table, pairs in forks:
            if seq.status is not SeqStatus.RUNNING:
                continue
            new_seqs.append(NewSeq(
                seq_id=seq.seq_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                num_computed_tokens=seq.num_computed_tokens, block_ids=table, sampling=seq.options))
            seq.on_worker = True
            copies += pairs
        return new_seqs, copies

    def _eligible(self, seq: Sequence) -> bool:
        if seq.index == 0 or not self.bm.enable_prefix_caching:
            return True
        req = seq.request
        return req.prefill_done or req.seqs[0].is_finished

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decode: none for rows whose next token depends on more than the
        logits (grammars, allowed ids, bad words), beams and pooling; never past max_tokens."""
        if seq.constraint is not None or seq.request.beam is not None or seq.pooling is not None:
            return []
        room = min(budget - 1, seq.max_tokens - seq.num_output_tokens - 1)
        if room <= 0:
            return []
        return self.proposer.propose(seq.seq_id, seq.token_ids, room)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """The step verified ``seq``'s drafts and ``seq`` is still running with its new tokens
        appended: the accepted drafts count as computed, the blocks only rejected ones used go."""
        seq.num_computed_tokens += num_accepted
        self.bm.trim(seq.seq_id, seq.num_tokens)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        budget = self.max_num_batched_tokens
        prompt_tokens = 0  # tokens of prompt chunks (more than one new token) in this step
        B = self.bm.block_size
        scheduled: dict[int, tuple[Sequence, int, list[int]]] = {}  # seq id -> (seq, n, new blocks)
        drafts_of: dict[int, list[int]] = {}  # seq id -> its draft tokens (included in its n)
        preempted: list[Sequence] = []
        speculate = self.proposer is not None and (
            self.spec_disable_batch is None or len(self.running) < self.spec_disable_batch)
        forks = self._unshare_forks(preempted) if self._forked else []
        adapters: set[tuple[int, str]] = set()  # distinct LoRA adapters of this step

        # 1. running sequences
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in self.in_flight:
                continue  # preempted earlier in this loop, or in a step still in flight
            if self.max_loras and not self._adapter_fits(seq, adapters):
                continue  # its adapter waits for a step with a free adapter slot
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            drafts = self._drafts(seq, budget) if speculate and seq.num_tokens - seq.num_computed_tokens == 1 else []
            num_new += len(drafts)
            new_blocks = None
            while True:
                new_blocks = self.bm.append_slots(seq.seq_id, seq.num_computed_tokens + num_new)
                if new_blocks is not None:
                    break
                if drafts:  # no room for the drafts: run without them before preempting anyone
                    num_new -= len(drafts)
                    drafts = []
                    continue
                victim = max((s for s in self.running if s.seq_id not in self.in_flight), key=self._key)
                if victim.seq_id in scheduled:
                    budget += scheduled.pop(victim.seq_id)[1]
                    drafts_of.pop(victim.seq_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            scheduled[seq.seq_id] = (seq, num_new, new_blocks)
            budget -= num_new
            if drafts:
                drafts_of[seq.seq_id] = drafts
            else:
                prompt_tokens += num_new if num_new > 1 else 0

        # 2. waiting sequences
        new_seqs, block_copies = self._announce_forks(forks) if forks else ([], [])
        if not preempted:
            admitted: set[int] = set()
            i = 0
            while i < len(self.waiting):
                if self.prompt_admit_tokens and prompt_tokens >= self.prompt_admit_tokens:
                    break  # enough prompt work in this step: the next prompt starts in the next one
                seq = self.waiting[i]
                if seq in preempted:
                    break  # a victim of this very step does not come back in it
                if not self._eligible(seq) or (self.max_loras and not self._adapter_fits(seq, adapters)):
                    i += 1
                    continue
                table = None
                if budget > 0 and len(self.running) < self.max_num_seqs:
                    if self.bm.swap.is_swapped(seq.seq_id):
                        num_computed = self.bm.swap.num_computed[seq.seq_id]
                        num_new = min(seq.num_tokens - num_computed, budget)
                        got = self.bm.swap_in(seq, num_computed + num_new)
                        table = got[0] if got is not None else None
                    else:
                        cached = self.bm.find_cached_prefix(seq) if seq.use_prefix_cache else []
                        num_computed = len(cached) * B
                        num_new = min(seq.num_tokens - num_computed, budget)
                        table = self.bm.allocate_new(seq, cached, num_computed + num_new)
                        if table is not None and seq.index == 0 and seq.request.num_cached_tokens == 0:
                            seq.request.num_cached_tokens = num_computed
                if table is None:
                    given = self._preempt_for(seq, scheduled, admitted, preempted, need_budget=budget <= 0)
                    if given is None:
                        break
                    budget += given
                    continue
                admitted.add(seq.seq_id)
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
                    pooling=seq.pooling,
                ))
                seq.on_worker = True
                scheduled[seq.seq_id] = (seq, num_new, [])
                budget -= num_new
                prompt_tokens += num_new

        if not scheduled:
            if new_seqs or block_copies:  # cannot happen (a fork always has a token to compute)
                raise RuntimeError("beam forks announced in a step that schedules nothing")
            return None

        # Decodes (one new token) first, then decodes with drafts (the worker runs each position as
        # a decode row), otherwise in scheduling order.
        if drafts_of:
            entries = sorted(scheduled.values(), key=lambda e: 0 if e[1] == 1 else (1 if e[0].seq_id in drafts_of else 2))
        else:
            entries = sorted(scheduled.values(), key=lambda e: e[1] != 1)
        seqs: list[Sequence] = []
        num_new_tokens: list[int] = []
        new_block_seqs: list[int] = []  # (batch index, block id) pairs, see contracts/messages.py
        new_block_ids: list[int] = []
        samples: list[bool] = []
        for i, (seq, n, blocks) in enumerate(entries):
            # Drafts are not counted as computed until accepted (accept_drafts).
            seq.num_computed_tokens += n - len(drafts_of.get(seq.seq_id, ()))
            seqs.append(seq)
            num_new_tokens.append(n)
            if blocks:
                new_block_seqs.extend([i] * len(blocks))
                new_block_ids.extend(blocks)
            samples.append(seq.num_computed_tokens == seq.num_tokens)
        self._step_id += 1
        swap_out, swap_in = self.bm.swap.take_pending()
        step_input = StepInput.pack(
            step_id=self._step_id,
            new_seqs=new_seqs,
            seq_ids=[s.seq_id for s in seqs],
            num_new_tokens=num_new_tokens,
            new_block_seqs=new_block_seqs,
            new_block_ids=new_block_ids,
            finished_seq_ids=self._finished_ids,
        )
        if swap_out:
            step_input.blocks_to_swap_out_buf = pack_pairs(swap_out)
        if swap_in:
            step_input.blocks_to_swap_in_buf = pack_pairs(swap_in)
        if block_copies:
            step_input.blocks_to_copy_buf = pack_ints(block_copies)
        if adapters:
            slots, loads = self.lora_slots.assign([s.lora_request for s in seqs])
            step_input.lora_slots_buf = pack_ints(slots)
            step_input.lora_loads = loads or None
        drafts = None
        if drafts_of:
            drafts = [drafts_of.get(s.seq_id, []) for s in seqs]
            step_input.num_draft_tokens_buf = pack_ints(len(d) for d in drafts)
            step_input.draft_token_ids_buf = pack_ints(t for d in drafts for t in d)
        self._finished_ids = []
        self.in_flight.update(s.seq_id for s in seqs)
        return ScheduledStep(step_input, seqs, num_new_tokens, samples, preempted, drafts)

    def _adapter_fits(self, seq: Sequence, adapters: set[tuple[int, str]]) -> bool:
        """Whether ``seq`` may join a step already running ``adapters`` (noted when it may)."""
        key = _lora_key(seq)
        if key is None or key in adapters:
            return True
        if len(adapters) >= self.max_loras:
            return False
        adapters.add(key)
        return True

    def step_not_sent(self, step: ScheduledStep) -> None:
        """The step never reached the workers (call after its requests were finished): its
        finished ids are due again, and its new sequences, never registered, must not be
        named as finished."""
        if step.step_input.lora_loads:
            self.lora_slots.unsent(step.step_input.lora_loads)
        self.bm.swap.requeue_out(step.step_input.blocks_to_swap_out)
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
