"""EngineCore: requests in, scheduled steps out, step outputs in, RequestOutput deltas out.

Synchronous and single-threaded; AsyncEngine (event loop) and LLM (offline) drive it with
``schedule()`` → ``executor.execute*`` → ``process()``, or ``step()`` which does all three.
Never call ``schedule()`` twice without ``process()`` in between.

Stop conditions, checked on every generated token in this order (as vLLM): nothing but the
length limit stops a sequence before ``min_tokens``; EOS (unless ``ignore_eos``) → "stop",
stop_reason None; a ``stop_token_ids`` token → "stop", stop_reason = the id; a stop string in
the text → "stop", stop_reason = the string; ``max_tokens`` / context length / KV cache
capacity (when max_tokens is None) → "length". The EOS or stop token stays in ``token_ids``
but its text is not output unless ``include_stop_str_in_output``.

Worker failure: when ``StepOutput.error`` is set, every request with a sequence in that step
finishes with finish_reason "error" (``RequestOutput.error`` holds a one-line summary the client
may see; the worker's traceback goes to the log only); the other
requests go on. Executor exceptions (ExecutorError) propagate from ``step()``.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time

from pagedserve.engine import beam_engine
from pagedserve.engine.sampling_params import BeamSearchParams
from pagedserve.engine.core_stats import EngineStats, core_stats  # EngineStats: re-exported
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.errors import EngineError, RequestRejectedError, SamplingParamsError
from pagedserve.engine.kv_blocks import BlockManager, model_hash_seed
from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.lora_slots import LoRASlots
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.pooling_requests import PoolingRequests, hidden_size
from pagedserve.engine.request import Request, Sequence, SeqStatus
from pagedserve.engine.request_checks import RequestChecks
from pagedserve.engine.request_outputs import RequestOutputs
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import ScheduledStep, Scheduler
from pagedserve.engine.spec_decode import SpecDecode, check_supported, new_proposer
from pagedserve.engine.stop_matcher import StopMatcher
from pagedserve.engine.structured_output.tracker import ConstraintTracker
from pagedserve.engine.structured_output.xgrammar_backend import GrammarError
from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.error_text import error_summary
from pagedserve.contracts.messages import SampledLogprobs, StepEncodeError, StepOutput

logger = logging.getLogger(__name__)

__all__ = ["EngineCore", "EngineStats", "ScheduledStep"]

INTERNAL_REQUEST_ERROR = ("the server failed while processing this request (an internal error, logged "
                          "on the server); other requests were not affected")


def _swap_blocks(config: EngineConfig, executor) -> int:
    """Host swap-pool blocks the workers allocated (0 unless --preemption-mode swap)."""
    if config.scheduler.preemption_mode != "swap":
        return 0
    return int(executor.num_swap_blocks or 0)


class EngineCore:
    """Composed of collaborators, each given what it uses: the admission checks (``checks``),
    the pooling requests (``pooling``), the sampling outputs (``output_builder``), the token constraints
    (``constraints``), the scheduler and block manager."""

    def __init__(self, config: EngineConfig, executor, tokenizer):
        if config.model.max_model_len is None:
            raise EngineError("config.model.max_model_len must be set before building the engine core")
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = int(config.model.max_model_len)
        self.max_logprobs = int(config.model.max_logprobs)  # -1: no cap
        # Ids past the embedding table would crash the step for everyone; refuse them up front.
        self.vocab_size = int((config.model.hf_config or {}).get("vocab_size") or 0) or None
        self.block_manager = BlockManager(int(executor.num_blocks), config.cache.block_size,
                                          config.cache.enable_prefix_caching,
                                          hash_seed=model_hash_seed(config.model),
                                          num_swap_blocks=_swap_blocks(config, executor))
        self.lora_slots = (LoRASlots(config.lora, config.model.hf_config or {})
                           if config.lora.enable_lora else None)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.lora_slots)
        self.spec: SpecDecode | None = None
        if config.speculative is not None:
            check_supported(config)
            self.spec = SpecDecode(config.speculative)
            self.scheduler.proposer = new_proposer(config.speculative)
            self.scheduler.spec_disable_batch = config.speculative.disable_by_batch_size
        self.eos_token_ids: set[int] = set(tokenizer.eos_token_ids or [])
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count(1)
        self.checks = RequestChecks(self.max_model_len, self.vocab_size, self.block_manager, self.lora_slots)
        self.output_builder = RequestOutputs(tokenizer)
        self.pooling = PoolingRequests(self.max_model_len, self.vocab_size, hidden_size(config.model.hf_config),
                                       self.block_manager, self.scheduler, self.requests, self._seqs,
                                       self.new_seq_id, self._finish_seq)
        # Token constraints (structured outputs, allowed_token_ids, bad_words); grammars compile
        # in a thread and their requests wait there, outside the scheduler.
        self.constraints = ConstraintTracker(tokenizer, self.vocab_size or tokenizer.vocab_size,
                                             compile_timeout_s=config.prep.grammar_compile_timeout)
        self._ready_outputs: list[RequestOutput] = []  # outputs made outside process()
        self._in_flight: collections.deque[ScheduledStep] = collections.deque()  # pipelined steps sent

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams | PoolingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """``cache_salt``: requests share prefix-cache blocks only with requests of an equal
        salt (None is a salt of its own), so tenants never read each other's K/V.
        ``params`` may be BeamSearchParams (engine/beam_engine.py). ``lora_request``: the
        adapter to run with (--enable-lora), checked here so a bad one is this request's error."""
        if lora_request is not None:
            self.checks.check_lora(lora_request, params)
        if isinstance(params, BeamSearchParams):
            if self.spec is not None:
                raise RequestRejectedError("beam search is not supported with speculative decoding "
                                           "(--speculative-config); use sampling, or a server without it")
            return beam_engine.add_beam_request(self, request_id, prompt, prompt_token_ids, params,
                                                arrival_time, priority, cache_salt)
        params = params if params is not None else SamplingParams()
        if request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestRejectedError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestRejectedError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        if isinstance(params, PoolingParams):  # embeddings: engine/pooling_requests.py
            return self.pooling.add(request_id, prompt, prompt_token_ids, params, arrival_time, priority,
                                    cache_salt)
        self.checks.check_fits(prompt_token_ids, params)
        try:
            params.check_max_logprobs(self.max_logprobs)
        except SamplingParamsError as e:
            rejected = RequestRejectedError(str(e))
            rejected.param = e.param
            raise rejected from None
        if params.has_token_constraint:
            self.check_constraint(params)
        num_prompt = len(prompt_token_ids)
        B = self.block_manager.block_size
        capacity = self.block_manager.num_usable_blocks * B  # tokens one sequence can hold
        if params.max_tokens is not None:
            max_tokens = params.max_tokens
        else:  # up to the context, or what the whole cache can hold (the last token needs no K/V)
            max_tokens = min(self.max_model_len, capacity + 1) - num_prompt
        now = time.monotonic()
        req = Request(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
            priority=int(priority),
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else now),
            cache_salt=cache_salt, stop_token_set=frozenset(params.stop_token_ids),
            lora_request=lora_request,
        )
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * num_prompt
        # Stop strings compiled once for the request's n sequences (engine/stop_matcher.py).
        stop = StopMatcher.get(params.stop_strings) if params.stop_strings else None
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids), request=req, index=i,
                token_ids=list(prompt_token_ids), num_prompt_tokens=num_prompt,
                options=params.to_sampling_options(i, sorted(self.eos_token_ids)),
                detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop,
                                             params.include_stop_str_in_output, params.skip_special_tokens),
                max_tokens=max_tokens,
            )
            # Prompt logprobs need every prompt position computed, so no prefix-cache hit.
            seq.use_prefix_cache = seq.options.prompt_logprobs is None
            if params.logprobs is not None:
                seq.logprobs = []
                seq.cumulative_logprob = 0.0
            req.seqs.append(seq)
        self.requests[request_id] = req
        for seq in req.seqs:
            self._seqs[seq.seq_id] = seq
        if not params.has_token_constraint or self.constraints.prepare(req):
            for seq in req.seqs:
                self.scheduler.add(seq)

    def check_lora(self, lora_request: LoRARequest, params=None) -> None:
        """RequestRejectedError unless the adapter can serve this request (engine/request_checks.py)."""
        self.checks.check_lora(lora_request, params)

    def check_constraint(self, params: SamplingParams) -> None:
        """Refuse a structured-output spec (or allowed_token_ids) the grammar engine cannot
        honour, with its reason (RequestRejectedError: HTTP 400). Cached per spec; the first
        check of a spec may take milliseconds, so servers call it off the loop first."""
        try:
            self.constraints.check(params)
        except GrammarError as e:
            raise RequestRejectedError(str(e)) from None

    @property
    def pooling_hidden_size(self) -> int | None:
        """Length of an embedding before ``dimensions`` (the model's hidden size)."""
        return self.pooling.hidden_size

    def stats(self) -> EngineStats:
        return core_stats(self.requests, self.scheduler, self.block_manager, self.lora_slots, self.spec,
                          self.config.lora.max_loras)

    def lora_requests_in_use(self, lora_int_id: int) -> int:
        """Unfinished requests running with (or waiting for) adapter ``lora_int_id``."""
        return sum(1 for r in self.requests.values()
                   if not r.finished and r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id)

    def forget_lora(self, lora_int_id: int) -> None:
        """An unloaded adapter (none of its requests left): its checked spec and slot go."""
        if self.lora_slots is not None:
            self.lora_slots.forget(lora_int_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort in any state and free everything. Returns the final delta
        (finish_reason "abort"), or None for an unknown or already finished request."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish_seq(seq, "abort")
        return self._make_output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- steps ------------------------------------------------------------------------------

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs made outside ``process()`` (a request whose grammar failed to compile)."""
        out, self._ready_outputs = self._ready_outputs, []
        return out

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled go to the scheduler; those whose compile failed finish."""
        ready, failed = self.constraints.take_ready()
        for req in ready:
            if req.request_id in self.requests:
                for seq in req.seqs:
                    if not seq.is_finished:
                        self.scheduler.add(seq)
        for req, reason, code in failed:
            if req.request_id not in self.requests:
                continue
            req.error = reason
            req.error_from_request = True  # a grammar that does not compile (in time) is the request's
            req.error_code = code  # grammar_compile_timeout past --grammar-compile-timeout
            for seq in req.seqs:
                if not seq.is_finished:
                    self._finish_seq(seq, "error")
            if (out := self._make_output(req)) is not None:
                self._ready_outputs.append(out)

    def schedule(self) -> ScheduledStep | None:
        if self.constraints.compiling:
            self._admit_compiled()
        step = self.scheduler.schedule()
        if step is None:
            return None
        self.constraints.attach_masks(step)
        now = time.monotonic()
        for seq in step.seqs:
            m = seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        return step

    def process(self, scheduled: ScheduledStep, step_output: StepOutput) -> list[RequestOutput]:
        self.scheduler.step_returned(scheduled)
        touched: dict[str, Request] = {}
        if step_output.error is not None:
            logger.error("step %d failed on the worker: %s", scheduled.step_input.step_id, step_output.error)
            if scheduled.step_input.lora_loads:  # whether the workers' slots hold them is unknown
                self.lora_slots.unsent(scheduled.step_input.lora_loads)
            for seq in scheduled.seqs:
                req = seq.request
                if req.request_id not in self.requests:
                    continue
                req.error = error_summary(step_output.error)  # the traceback stays in the log above
                for s in req.seqs:
                    if not s.is_finished:
                        self._finish_seq(s, "error")
                touched[req.request_id] = req
            return [out for req in touched.values() if (out := self._make_output(req)) is not None]

        if step_output.lora_failed:  # before step_done: their blocks must never enter the prefix cache
            self._fail_lora_loads(scheduled, step_output.lora_failed, touched)
        self.scheduler.step_done(scheduled)
        if step_output.pooled:
            self.pooling.take_pooled(step_output.pooled, touched)
        if step_output.prompt_logprobs:
            for pl in step_output.prompt_logprobs:
                seq = self._seqs.get(pl.seq_id)
                if seq is None or seq.is_finished or seq.request.prompt_logprobs is None:
                    continue
                req = seq.request
                for j, entry in enumerate(pl.entries):
                    pos = pl.first_position + j
                    if 0 < pos < len(req.prompt_token_ids):
                        req.prompt_logprobs[pos] = self.output_builder.logprob_entry(req.prompt_token_ids[pos], entry)
        now = time.monotonic()
        logprobs = step_output.logprobs
        beam_reqs: dict[str, Request] = {}
        failed: dict[str, RequestOutput | None] = {}  # requests whose own processing raised
        if scheduled.drafts is not None:  # speculative decoding: several tokens per sequence
            self.spec.append_verified(self, scheduled, step_output, touched, failed, now)
        for i, (seq_id, token_id) in enumerate(
                zip(step_output.seq_ids, step_output.token_ids) if scheduled.drafts is None else ()):
            seq = self._seqs.get(seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            lp = logprobs[i] if logprobs is not None else None
            req = seq.request
            try:
                if req.beam is not None:
                    req.beam.report(seq, token_id, lp)
                    beam_reqs[req.request_id] = req
                else:
                    self._append_token(seq, token_id, lp)
            except Exception as e:  # noqa: BLE001 - this request's fault: it fails, the step goes on
                failed[req.request_id] = self.fail_request(req, e)
                continue
            self.token_arrived(req, now, touched)
        for req in beam_reqs.values():
            if req.request_id not in failed:
                try:
                    beam_engine.advance(self, req)
                except Exception as e:  # noqa: BLE001
                    failed[req.request_id] = self.fail_request(req, e)
        outputs = [out for out in failed.values() if out is not None]
        for req in touched.values():
            if req.request_id in failed:
                continue
            try:
                out = self._make_output(req)
            except Exception as e:  # noqa: BLE001
                out = self.fail_request(req, e)
            if out is not None:
                outputs.append(out)
        return outputs

    def _fail_lora_loads(self, scheduled: ScheduledStep, failed_slots: list[int],
                         touched: dict[str, Request]) -> None:
        """The workers could not load these slots' adapters (their files changed or broke after the
        check): the requests of this step that ran with them fail (a 400, ``adapter_load_failed``:
        their rows ran without their weights), the slots are forgotten; every other request goes on."""
        failed = set(failed_slots)
        loads = [ld for ld in scheduled.step_input.lora_loads or () if ld.slot in failed]
        keys = {(ld.lora_id, ld.path) for ld in loads}
        for load in loads:
            self.lora_slots.load_failed(load)
            logger.error("LoRA adapter %d could not be loaded by the workers; failing its requests in step %d",
                         load.lora_id, scheduled.step_input.step_id)
        for seq in scheduled.seqs:
            req = seq.request
            lora = req.lora_request
            if (lora is None or (lora.lora_int_id, lora.lora_path) not in keys
                    or req.request_id not in self.requests):
                continue
            req.error = (f"LoRA adapter {lora.lora_name!r} could not be loaded by the workers (its files changed or "
                         f"cannot be read since it was checked); load it again")
            req.error_from_request = True
            req.error_code = "adapter_load_failed"
            for s in req.seqs:
                if not s.is_finished:
                    self._finish_seq(s, "error")
            touched[req.request_id] = req

    def fail_request(self, req: Request, cause: BaseException | None = None,
                     message: str = INTERNAL_REQUEST_ERROR) -> RequestOutput | None:
        """An internal fault while handling this one request (its preparation, a token, its
        output): finish it with "error" and the ``message`` the client sees (the traceback goes to
        the log), so the engine and every other request go on. Returns its final output."""
        logger.error("request %s failed inside the engine; the others go on", req.request_id,
                     exc_info=cause)
        req.error = message
        req.error_from_request = False
        req.error_code = None
        for seq in req.seqs:
            if not seq.is_finished:
                try:
                    self._finish_seq(seq, "error")
                except Exception:  # noqa: BLE001 - its state is broken: drop it by hand
                    logger.exception("request %s: finishing sequence %d failed", req.request_id, seq.seq_id)
                    seq.finish_reason = "error"
                    seq.status = SeqStatus.FINISHED
                    self._seqs.pop(seq.seq_id, None)
        self.requests.pop(req.request_id, None)
        self.constraints.forget(req)
        req.finished = True
        try:
            out = self._make_output(req)
        except Exception:  # noqa: BLE001
            out = None
        if out is None or not isinstance(out, RequestOutput):
            if req.seqs and req.seqs[0].pooling is not None:
                return out
            out = RequestOutput(
                request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                prompt_logprobs=None, outputs=[CompletionOutput(seq.index, "", [], finish_reason="error")
                                               for seq in req.seqs if not seq.finish_sent]
                or [CompletionOutput(0, "", [], finish_reason="error")],
                finished=True, metrics=req.metrics, error=message)
        out.error, out.error_from_request, out.finished = message, False, True
        return out

    def step(self) -> list[RequestOutput]:
        if self.executor.max_in_flight > 1:
            return self._step_pipelined()
        scheduled = self.schedule()
        ready = self.take_outputs()
        if scheduled is None:
            if not ready and self.constraints.compiling:
                self.constraints.wait(timeout=1.0)  # nothing else can run until a grammar is ready
            return ready
        try:
            output = self.executor.execute(scheduled.step_input)
        except StepEncodeError as e:
            return ready + self.fail_unsent(scheduled, e)
        return ready + self.process(scheduled, output)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline stages: keep up to ``executor.max_in_flight`` steps sent (disjoint sequences,
        see Scheduler.in_flight) so the stages work on different steps at once; return the
        outputs of the oldest."""
        ready = self.take_outputs()
        while len(self._in_flight) < self.executor.max_in_flight:
            scheduled = self.schedule()
            if scheduled is None:
                break
            try:
                self.executor.submit(scheduled.step_input)
            except StepEncodeError as e:
                ready += self.fail_unsent(scheduled, e)
                continue
            self._in_flight.append(scheduled)
        if not self._in_flight:
            if not ready and self.constraints.compiling:
                self.constraints.wait(timeout=1.0)
            return ready
        scheduled = self._in_flight.popleft()
        return ready + self.process(scheduled, self.executor.collect(scheduled.step_input.step_id))

    def fail_unsent(self, scheduled: ScheduledStep, error: StepEncodeError) -> list[RequestOutput]:
        """The executor could not encode the step (a value past 64 bits that got past
        SamplingParams, e.g. changed after validation): nothing reached the workers. Every
        request in the step fails as for a worker error (which request's values were at fault
        is not known) and the engine goes on; the workers' view of sequences stays right."""
        outputs = self.process(scheduled, StepOutput(scheduled.step_input.step_id, error=str(error)))
        self.scheduler.step_not_sent(scheduled)
        return outputs

    # ---- per token --------------------------------------------------------------------------

    @staticmethod
    def token_arrived(req: Request, now: float, touched: dict[str, Request]) -> None:
        """A step gave ``req`` tokens: its token times, and it has a delta to send."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        touched[req.request_id] = req

    def append_token(self, seq: Sequence, token_id: int, lp: SampledLogprobs | None) -> None:
        """One generated token (engine/spec_decode.py appends a verified run through here)."""
        self._append_token(seq, token_id, lp)

    def live_seq(self, seq_id: int) -> Sequence | None:
        """The running sequence of this id, None when it finished or was aborted meanwhile."""
        seq = self._seqs.get(seq_id)
        return seq if seq is not None and seq.status is SeqStatus.RUNNING else None

    def _append_token(self, seq: Sequence, token_id: int, lp: SampledLogprobs | None) -> None:
        seq.token_ids.append(token_id)
        constraint = seq.constraint
        if constraint is not None and not constraint.accept(token_id):
            # Only when the mask could not be honoured: the request's constraints together admit no
            # token (allowed_token_ids or bad_words without any token the grammar allows, min_tokens
            # blocking the grammar's end).
            logger.warning("request %s: sampled token %d does not fit its grammar",
                           seq.request.request_id, token_id)
            seq.request.error = (f"no token satisfies this request's constraints together (the sampled token "
                                 f"{token_id} does not fit the grammar): allowed_token_ids, bad_words or "
                                 f"min_tokens exclude every token the structured output allows")
            seq.request.error_from_request = True
            self._finish_seq(seq, "error")
            return
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(self.output_builder.logprob_entry(token_id, lp))
            seq.cumulative_logprob += lp.logprob
        params = seq.request.params
        n_out = seq.num_output_tokens
        past_min = n_out >= params.min_tokens
        finish: str | None = None
        stop_reason: int | str | None = None
        if past_min and not params.ignore_eos and token_id in self.eos_token_ids:
            finish = "stop"
        elif past_min and token_id in seq.request.stop_token_set:
            finish, stop_reason = "stop", token_id
        if finish is None or params.include_stop_str_in_output:
            matched = seq.detok.add_token(token_id, check_stop=past_min and finish is None)
            if matched is not None:
                finish, stop_reason = "stop", matched
        if finish is None and constraint is not None and constraint.terminated:
            finish = "stop"  # the grammar is complete (its stop token was accepted)
        if finish is None and (n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            finish = "length"
        if finish is not None:
            self._finish_seq(seq, finish, stop_reason)

    def _make_output(self, req: Request) -> RequestOutput | None:
        """The request's delta since its last one (None: none), made by its kind's collaborator."""
        if req.seqs and req.seqs[0].pooling is not None:
            return self.pooling.make_output(req)
        if req.beam is not None:
            return beam_engine.make_output(self, req)
        return self.output_builder.make_output(req)

    # ---- what beam search reshapes (engine/beam_engine.BeamHost) ---------------------------

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def add_seq(self, seq: Sequence) -> None:
        """Track a sequence made outside add_request (a beam forked from its parent)."""
        self._seqs[seq.seq_id] = seq

    def drop_seq(self, seq: Sequence) -> None:
        """Forget a sequence the scheduler already let go of (a beam nothing continues)."""
        self._seqs.pop(seq.seq_id, None)

    def finish_seq(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        self._finish_seq(seq, reason, stop_reason)

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if not seq.detok.stopped:
            seq.detok.flush()
        if seq.request.compiling:  # never reached the scheduler
            seq.status = SeqStatus.FINISHED
        else:
            self.scheduler.finish(seq)
        del self._seqs[seq.seq_id]
        req = seq.request
        if req.all_finished:
            if req.compiling:
                self.constraints.forget(req)
            req.finished = True
            req.metrics.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
