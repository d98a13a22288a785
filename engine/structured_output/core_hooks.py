"""EngineCore's structured-output hooks (a mixin, to keep core.py about one job): the request-time
check of a constraint, and the admission of requests whose grammar finished compiling."""
from __future__ import annotations

from engine.errors import RequestRejectedError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output.xgrammar_backend import GrammarError


class ConstrainedRequests:
    """Needs EngineCore's ``constraints``, ``requests``, ``scheduler``, ``_ready_outputs``,
    ``_finish_seq`` and ``_make_output``."""

    def check_constraint(self, params: SamplingParams) -> None:
        """Refuse a structured-output spec (or allowed_token_ids) the grammar engine cannot
        honour, with its reason (RequestRejectedError: HTTP 400). Cached per spec; the first
        check of a spec may take milliseconds, so servers call it off the loop first."""
        try:
            self.constraints.check(params)
        except GrammarError as e:
            raise RequestRejectedError(str(e)) from None

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs made outside ``process()`` (a request whose grammar failed to compile)."""
        out, self._ready_outputs = self._ready_outputs, []
        return out

    def _admit_compiled(self) -> None:
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
