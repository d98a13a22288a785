"""A worker's adapters: loaded from disk once, kept up to max_cpu_loras, copied into slots on demand.

The engine decides which adapter sits in which slot (engine/lora_slots.py) and says so in a step
(``StepInput.lora_loads``) only when a slot changes; every rank applies the same loads, so the
ranks' slots agree. A step's rows name their slot in ``StepInput.lora_slots``; ``batch`` turns
that into the per-row mask every LoRA layer of the step reads (gpu/models/lora_layers.py).

A load that fails (the files changed since the engine checked them, a read error) never fails the
step: its slot is emptied (zero A and B: a base-model delta of exactly zero) and the slot is
reported in ``StepOutput.lora_failed``, so the engine fails that adapter's requests alone and
forgets the slot. With tensor parallelism the ranks agree first (a failure on any rank empties the
slot on all), so no rank raises and leaves its peers in a collective.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from pagedserve.contracts.config import LoRAConfig
from pagedserve.contracts.lora import read_adapter
from pagedserve.contracts.messages import LoRALoad, StepInput
from pagedserve.gpu.models.lora_layers import LoRABatch, LoRALinear, install

logger = logging.getLogger(__name__)

AdapterWeights = dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]  # layer -> module -> (A, scaled B)


def load_adapter_weights(path: str, hf_config: dict, max_rank: int, dtype: torch.dtype) -> AdapterWeights:
    """An adapter's tensors by layer and module, B scaled (checked again here: the same rules as
    the engine's, so a worker never copies a tensor of the wrong shape into a slot)."""
    from safetensors.torch import load_file

    spec = read_adapter(path, hf_config, max_rank)
    tensors = load_file(spec.weights_file)
    out: AdapterWeights = {}
    for m in spec.modules:
        a = tensors[m.a_key].to(torch.float32)
        b = tensors[m.b_key].to(torch.float32) * spec.scaling
        out.setdefault(m.layer, {})[m.module] = (a.to(dtype), b.to(dtype))
    return out


def base_is_quantized(model) -> bool:
    """Whether the decoder layers' linears compute from quantized weights (GGUF q8_0 / q4_1 kept as
    stored, --quantization int8 / int4): gpu.models.quantization.attach gave them a ``qweight``."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    attn = getattr(layers[0], "self_attn", None)
    return getattr(getattr(attn, "qkv_proj", None), "qweight", None) is not None


def resolve_lora_dtype(choice: str, model_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The adapter slots' dtype for --lora-dtype ``choice`` (contracts.config.LORA_DTYPES).

    "auto" is the model's dtype, so an unquantized fp32 model adds exactly the fp32 delta PEFT adds,
    except over quantized base weights with fp32 activations: there it is bf16, because a decode step
    with adapters streams the adapter weights next to a base model that is 4-8x smaller than fp32, and
    the delta's weights rounded to bf16 (8 significant bits) sit far below the base's own quantization
    error; the sums stay fp32 (loadtest/PERF.md, "LoRA overhead, thirteenth session")."""
    if choice == "float32":
        return torch.float32
    if choice == "bfloat16":
        return torch.bfloat16
    if choice != "auto":
        raise ValueError(f"unknown LoRA dtype {choice!r}")
    if quantized and model_dtype == torch.float32:
        return torch.bfloat16
    return model_dtype


class WorkerLoRA:
    def __init__(self, model, config: LoRAConfig, dtype: torch.dtype, device):
        self.config = config
        self.dtype, self.device = dtype, device  # the model's (activations, the step's row mask)
        self.hf_config = model.config
        # the slots': fp32 or bf16, independent of the activations' (either pair runs in the fused layer)
        self.lora_dtype = resolve_lora_dtype(config.lora_dtype, dtype, base_is_quantized(model))
        self.layers: dict[int, list[LoRALinear]] = install(model, config.max_loras, config.max_lora_rank,
                                                           self.lora_dtype, device)
        self.cache: OrderedDict[tuple[int, str], AdapterWeights] = OrderedDict()  # LRU, max_cpu_loras
        self.slots: list[tuple[int, str] | None] = [None] * config.max_loras

    def apply_loads(self, loads: list[LoRALoad]) -> list[int]:
        """Put each load's adapter into its slot; the slots whose load failed (emptied), agreed
        over the tensor-parallel ranks."""
        failed = [0] * len(loads)
        for i, load in enumerate(loads):
            try:
                self._load(load)
            except Exception as e:  # noqa: BLE001 - this adapter's fault: its slot empties, the step goes on
                logger.error("LoRA adapter %d from %r could not be loaded into slot %d: %s", load.lora_id,
                             load.path[:300], load.slot, repr(str(e)[:1000]))
                failed[i] = 1
        failed = self._agree(failed)
        for load, bad in zip(loads, failed):
            if bad:
                self._empty(load.slot)
        return [load.slot for load, bad in zip(loads, failed) if bad]

    def _load(self, load: LoRALoad) -> None:
        key = (load.lora_id, load.path)
        weights = self.cache.get(key)
        if weights is None:
            weights = load_adapter_weights(load.path, self.hf_config, self.config.max_lora_rank, self.lora_dtype)
            self.cache[key] = weights
            while len(self.cache) > self.config.cpu_loras:
                self.cache.popitem(last=False)
            logger.info("loaded LoRA adapter %d from %r", load.lora_id, load.path[:300])
        self.cache.move_to_end(key)
        for layer, holders in self.layers.items():
            modules = weights.get(layer, {})
            for h in holders:
                h.set_slot(load.slot, modules)
        self.slots[load.slot] = key

    def _empty(self, slot: int) -> None:
        for holders in self.layers.values():
            for h in holders:
                h.clear_slot(slot)
        self.slots[slot] = None

    def _agree(self, failed: list[int]) -> list[int]:
        """A load failed if it failed on any tensor-parallel rank (identity at tp = 1)."""
        from pagedserve.gpu.parallel_state import get_tp_size, tp_all_reduce

        if get_tp_size() == 1 or not failed:
            return failed
        flags = tp_all_reduce(torch.tensor(failed, dtype=torch.int32, device=self.device))
        return [int(v > 0) for v in flags.tolist()]

    def batch(self, step: StepInput, query_lens: list[int]) -> LoRABatch | None:
        """The step's per-row slot mask, or None when no row uses an adapter (the step's loads
        are applied before, by ``apply_loads``)."""
        if not step.lora_slots_buf:
            return None
        seq_slots = step.lora_slots.tolist()
        k = max(seq_slots) + 1
        if k <= 0:
            return None
        rows = torch.repeat_interleave(torch.tensor(seq_slots, dtype=torch.int32),
                                       torch.tensor(query_lens, dtype=torch.long))
        if k == 1 and min(seq_slots) == 0:  # no mask to apply (one adapter, no base row)
            return LoRABatch(None, k, rows)
        mask = (rows.unsqueeze(1) == torch.arange(k)).to(self.dtype)
        return LoRABatch(mask.to(self.device), k, rows)
