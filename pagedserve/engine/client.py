"""What the HTTP layer may ask of an engine: ``EngineClient`` and the tokenizer it exposes.

app/ is written against these protocols, not against AsyncEngine: one engine
(engine.async_engine.AsyncEngine), N data-parallel replicas behind a router
(engine.replicas.ReplicatedEngine) and the test double (tests/app/fake_engine.py) all
implement them, and tests/engine/test_client_protocol.py checks every member of each against
the signatures here. A member the app needs is declared here and implemented by all three, so
the app calls it directly instead of probing for it.

Nothing here imports torch (app/ imports this module).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedserve.contracts.config import EngineConfig
    from pagedserve.engine.core import EngineStats


class TokenizerClient(Protocol):
    """The tokenizer calls the routes make on the event loop's side (cheap ones, or cached)."""

    vocab_size: int
    chat_template: str | None  # the model's own template (None: the tokenizer has none)
    all_special_ids: Collection[int]
    max_token_chars: int | None  # most characters one token stands for (None: no bound)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def token_to_id(self, token: str) -> int | None: ...


class EngineClient(Protocol):
    """An engine as the server sees it: its description, off-loop tokenizer work, requests as
    streams of deltas, health and figures for /health and /metrics."""

    config: EngineConfig
    tokenizer: TokenizerClient  # set once the engine has started
    model_name: str
    max_model_len: int
    # Request fields' defaults from the model (--generation-config): temperature, top_p, top_k,
    # min_p, repetition_penalty; a request's own values override them.
    sampling_defaults: dict[str, float | int]
    num_blocks: int  # KV-cache blocks (all replicas together)
    embedding_size: int | None  # values in an embedding (the bound of ``dimensions``)
    num_deaths: int  # times the engine stopped on a failure it did not recover from

    async def start(self) -> None: ...

    async def shutdown(self, timeout_s: float = 0.0) -> None: ...

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]: ...

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, **template_kwargs: Any) -> str: ...

    async def check_constraint(self, params: Any) -> None: ...

    def generate(self, prompt_token_ids: list[int], params: Any, request_id: str,
                 prompt: str | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_request: Any = None) -> AsyncIterator[Any]: ...

    def check_lora(self, lora_request: Any) -> None:
        """RequestRejectedError naming what is wrong unless the adapter (a LoRARequest) can serve."""
        ...

    def lora_requests_in_use(self, lora_int_id: int) -> int: ...

    def forget_lora(self, lora_int_id: int) -> None: ...

    def pool(self, prompt_token_ids: list[int], params: Any, request_id: str,
             prompt: str | None = None, priority: int = 0,
             cache_salt: str | None = None) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def health_status(self) -> str: ...

    def replica_states(self) -> list[str] | None:
        """Each data-parallel replica's health_status(); None for a single engine."""
        ...

    def stats(self) -> EngineStats: ...
