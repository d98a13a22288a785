"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""
from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """``lora_int_id`` (>= 1) identifies the adapter to the engine and its workers; two requests
    with an equal id must name the same adapter. ``lora_path`` is a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path or not isinstance(self.lora_path, str):
            raise ValueError("lora_path must be a non-empty string (a PEFT adapter directory)")

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> bytes:
        """What enters the prefix-cache hash chain: requests of different adapters never share
        K/V (the id and the path, so a re-used id with other weights is another chain too). Tagged,
        with the lengths of the id (decimal) and the path first (engine/kv_blocks.first_block_key):
        no salt and adapter pair reads as another."""
        num = str(self.lora_int_id).encode()
        path = self.lora_path.encode("utf-8", "surrogatepass")
        return b"L" + struct.pack("<QQ", len(num), len(path)) + num + path
