"""EngineCore's outputs (a collaborator, to keep core.py about one job): the RequestOutput delta of
a sampling request after a step, and the logprob entries (with their decoded token text) it
carries. Pooling and beam-search requests make theirs elsewhere (EngineCore picks)."""
from __future__ import annotations

from typing import Any

from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from pagedserve.engine.request import Request
from pagedserve.contracts.messages import SampledLogprobs


class RequestOutputs:
    """Given the tokenizer that decodes logprob tokens; keeps their text (up to a million ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}  # decoded_token cache for logprobs

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text

    def logprob_entry(self, token_id: int, lp: SampledLogprobs) -> TokenLogprobs:
        entry: TokenLogprobs = {}
        rank = None
        for r, (tid, logprob) in enumerate(lp.top, start=1):
            entry[tid] = Logprob(logprob, r, self._decoded(tid))
            if tid == token_id:
                rank = r
        entry[token_id] = Logprob(lp.logprob, rank, self._decoded(token_id))
        return entry

    def make_output(self, req: Request) -> RequestOutput | None:
        """The delta of a sampling request since its last one; None when it has none."""
        outs: list[CompletionOutput] = []
        for seq in req.seqs:
            n_out = seq.num_output_tokens
            finishing = seq.is_finished and not seq.finish_sent
            if n_out == seq.num_sent_tokens and not finishing:
                continue
            new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens:]
            # Every output is a delta: the entries go with it and the core keeps none (with
            # top_logprobs 20 and n 128 a long request held ~21 objects per token per choice
            # that it never reads again; issue 22). Whoever wants them all merges the deltas.
            logprobs = seq.logprobs
            if logprobs is not None:
                seq.logprobs = []
            outs.append(CompletionOutput(
                index=seq.index,
                text=seq.detok.take_delta(),
                token_ids=new_ids,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
            seq.num_sent_tokens = n_out
            if seq.is_finished:
                seq.finish_sent = True
        if not outs:
            return None
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_logprobs = list(req.prompt_logprobs)
            req.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outs,
            finished=req.finished,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            error_from_request=req.error_from_request,
            error_code=req.error_code,
        )
