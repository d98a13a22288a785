"""Speculative decoding on the engine side: the proposer, what a verified step's tokens do to
their sequences, and the acceptance counters (the metrics and the log line).

The scheduler asks the proposer for drafts and reserves their slots (engine/scheduler.py); the
worker verifies them (gpu/spec_verify.py) and returns 1 + accepted tokens per sequence. Here each
token goes through ``EngineCore.append_token`` one by one, so EOS, stop tokens, stop strings and
max_tokens inside an accepted run end the sequence exactly where they would without drafts (the
tokens after that point are dropped with the sequence's worker state).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedserve.contracts.config import ConfigError, EngineConfig, SpeculativeConfig
from pagedserve.contracts.messages import StepOutput
from pagedserve.engine.request import SeqStatus

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counters, vLLM's spec_decode_* figures."""

    num_drafts: int = 0  # sequences that proposed drafts in a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts at position 0, 1, ...

    def record(self, num_draft: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for p in range(accepted):
            self.accepted_per_pos[p] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def check_supported(config: EngineConfig) -> None:
    """Start-up refusal of the combinations speculative decoding does not support here."""
    spec = config.speculative
    if spec is None:
        return
    if config.parallel.pipeline_parallel_size > 1:
        raise ConfigError("--speculative-config cannot be combined with --pipeline-parallel-size > 1 "
                          "(drafts are verified on the last stage only); drop one of them")
    if spec.method == "draft_model" and config.parallel.tensor_parallel_size > 1:
        raise ConfigError("--speculative-config with a draft model cannot be combined with "
                          "--tensor-parallel-size > 1 here; use the ngram method or one rank")


class DraftModelSlots:
    """Method draft_model: the worker's draft model proposes (gpu/spec_draft.py); the engine only
    reserves k slots per decode, sent as placeholder drafts (-1) the worker fills in."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def propose(self, seq_id: int, token_ids: list[int], max_tokens: int) -> list[int]:
        return [-1] * min(self.k, max_tokens)

    def forget(self, seq_id: int) -> None:
        pass


def new_proposer(spec: SpeculativeConfig):
    if spec.method == "draft_model":
        return DraftModelSlots(spec.num_speculative_tokens)
    from pagedserve.engine.spec_ngram import NgramProposer

    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


class SpecDecode:
    """Per engine core: the stats and the step outputs of steps that carried drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()
        self._last_log = time.monotonic()
        self._logged_drafts = 0

    def append_verified(self, core, scheduled, step_output: StepOutput, touched: dict, failed: dict,
                        now: float) -> None:
        """Append each sequence's tokens of a step with drafts (``EngineCore.process``)."""
        drafts = {s.seq_id: d for s, d in zip(scheduled.seqs, scheduled.drafts)}
        counts = step_output.num_tokens.tolist() if step_output.num_tokens_buf else None
        tokens = step_output.token_ids.tolist()
        logprobs = step_output.logprobs
        at = 0
        for i, seq_id in enumerate(step_output.seq_ids):
            n = counts[i] if counts is not None else 1
            first, at = at, at + n
            seq = core.live_seq(seq_id)
            if seq is None:
                continue  # aborted while the step ran
            d = drafts.get(seq_id) or []
            if d:
                self.stats.record(len(d), n - 1)
            req = seq.request
            try:
                for j in range(first, first + n):
                    core.append_token(seq, tokens[j], logprobs[j] if logprobs is not None else None)
                    if seq.status is not SeqStatus.RUNNING:
                        break  # finished inside the accepted run: the rest is dropped
                else:
                    if d:
                        core.scheduler.accept_drafts(seq, n - 1)
            except Exception as e:  # noqa: BLE001 - this request's fault: it fails, the step goes on
                failed[req.request_id] = core.fail_request(req, e)
                continue
            core.token_arrived(req, now, touched)
        self._maybe_log(now)

    def _maybe_log(self, now: float) -> None:
        s = self.stats
        if now - self._last_log < LOG_INTERVAL_S or s.num_drafts == self._logged_drafts:
            return
        self._last_log, self._logged_drafts = now, s.num_drafts
        per_pos = [round(c / s.num_drafts, 3) for c in s.accepted_per_pos]
        logger.info("speculative decoding: acceptance rate %.1f %% (%d of %d draft tokens), mean accepted "
                    "length %.2f, per position %s", 100 * s.acceptance_rate, s.num_accepted_tokens,
                    s.num_draft_tokens, 1 + s.num_accepted_tokens / s.num_drafts, per_pos)
