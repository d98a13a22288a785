"""EngineCore's admission checks (a collaborator, to keep core.py about one job): refuse, with a
RequestRejectedError (HTTP 400) that says why, a request the engine cannot serve: a prompt that
does not fit the context or the KV cache, or a LoRA adapter it cannot run."""
from __future__ import annotations

from pagedserve.contracts.lora import LoRAAdapterError
from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.kv_blocks import BlockManager
from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.lora_slots import LoRASlots
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import BeamSearchParams, SamplingParams


class RequestChecks:
    """Checks against the model's context (``max_model_len``), its vocabulary (``vocab_size``, None:
    unknown), the KV cache (``block_manager``) and the LoRA slots (None: LoRA off)."""

    def __init__(self, max_model_len: int, vocab_size: int | None, block_manager: BlockManager,
                 lora_slots: LoRASlots | None) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_manager = block_manager
        self.lora_slots = lora_slots

    def check_lora(self, lora_request: LoRARequest, params=None) -> None:
        """RequestRejectedError unless the adapter can serve this request."""
        if not isinstance(lora_request, LoRARequest):
            raise RequestRejectedError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_slots is None:
            raise RequestRejectedError(f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not "
                                       f"enabled: start the engine with --enable-lora (LLM(enable_lora=True))")
        if isinstance(params, (BeamSearchParams, PoolingParams)):
            raise RequestRejectedError("LoRA adapters serve sampling requests only (not beam search or pooling)")
        try:
            self.lora_slots.check(lora_request)
        except LoRAAdapterError as e:
            raise RequestRejectedError(str(e)) from None

    def check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestRejectedError("the prompt is empty: give at least one token")
        if any(not isinstance(t, int) or t < 0 or t >= 2**63 for t in prompt_token_ids):
            raise RequestRejectedError("prompt token ids must be integers >= 0 (and below 2**63)")
        if self.vocab_size is not None and max(prompt_token_ids) >= self.vocab_size:
            raise RequestRejectedError(
                f"prompt token id {max(prompt_token_ids)} is out of range: the vocabulary has "
                f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})")
        limit = self.max_model_len
        if params.max_tokens is None:
            if num_prompt >= limit:
                raise RequestRejectedError(
                    f"the prompt has {num_prompt} tokens but the model's context (max_model_len) is "
                    f"{limit}: leave room for at least one generated token; shorten the prompt")
        elif num_prompt + params.max_tokens > limit:
            raise RequestRejectedError(
                f"the prompt has {num_prompt} tokens and max_tokens is {params.max_tokens}: "
                f"{num_prompt + params.max_tokens} > the model's context (max_model_len) {limit}; "
                f"shorten the prompt or lower max_tokens")
        bm = self.block_manager
        # K/V is needed for every token but the last generated one.
        kv_tokens = num_prompt + (params.max_tokens - 1 if params.max_tokens is not None else 0)
        need = bm.blocks_for(kv_tokens)
        if need > bm.num_usable_blocks:
            what = f"the prompt ({num_prompt} tokens)" if params.max_tokens is None else (
                f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens})")
            raise RequestRejectedError(
                f"{what} needs {need} KV blocks of {bm.block_size} tokens but the whole cache has "
                f"{bm.num_usable_blocks} ({bm.num_usable_blocks * bm.block_size} tokens); "
                f"shorten the request or give the KV cache more memory")
