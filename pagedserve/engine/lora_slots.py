"""The engine's side of multi-LoRA: adapters checked once, and which one sits in which worker slot.

Checking (contracts/lora.py) happens when a request names an adapter, so a bad adapter is that
request's clear error, never a failed step. Slots: the workers hold ``max_loras`` stacked A/B slots;
each step, every adapter its rows use must be in one (the scheduler admits at most max_loras
distinct adapters per step). An adapter already in a slot stays there; a new one takes a free
slot, else the least recently used slot no row of this step needs, and the step carries a
``LoRALoad`` for it — the only time adapter data travels; afterwards rows carry only a slot index.
Lowest slots are used first, so the k slots a step touches are usually 0..k-1.
"""
from __future__ import annotations

from collections import OrderedDict

from pagedserve.contracts.config import LoRAConfig
from pagedserve.contracts.lora import AdapterSpec, LoRAAdapterError, read_adapter
from pagedserve.contracts.messages import LoRALoad
from pagedserve.engine.lora_request import LoRARequest

BASE_SLOT = -1


class LoRASlots:
    def __init__(self, config: LoRAConfig, hf_config: dict):
        self.config = config
        self.hf_config = hf_config
        self._checked: OrderedDict[tuple[int, str], AdapterSpec] = OrderedDict()
        self._slots: list[tuple[int, str] | None] = [None] * config.max_loras
        self._last_used: list[int] = [0] * config.max_loras
        self._step = 0

    def check(self, lora: LoRARequest) -> AdapterSpec:
        """The adapter's spec, checked against the model once per (id, path); LoRAAdapterError
        naming what is wrong otherwise."""
        key = (lora.lora_int_id, lora.lora_path)
        spec = self._checked.get(key)
        if spec is None:
            try:
                spec = read_adapter(lora.lora_path, self.hf_config, self.config.max_lora_rank)
            except LoRAAdapterError as e:
                raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: {e}") from None
            self._checked[key] = spec
            while len(self._checked) > max(64, self.config.cpu_loras):
                self._checked.popitem(last=False)
        self._checked.move_to_end(key)
        return spec

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its slot is free for another (a later load of the same id reloads)."""
        for key in [k for k in self._checked if k[0] == lora_int_id]:
            del self._checked[key]
        for i, key in enumerate(self._slots):
            if key is not None and key[0] == lora_int_id:
                self._slots[i] = None

    def assign(self, loras: list[LoRARequest | None]) -> tuple[list[int], list[LoRALoad]]:
        """Slots for one step's rows (None = base model, slot -1) and the loads they need.
        At most max_loras distinct adapters (the scheduler's rule)."""
        self._step += 1
        wanted = {(lr.lora_int_id, lr.lora_path) for lr in loras if lr is not None}
        if len(wanted) > len(self._slots):
            raise RuntimeError(f"{len(wanted)} adapters in one step, over max_loras {len(self._slots)}")
        where = {key: i for i, key in enumerate(self._slots) if key is not None}
        loads: list[LoRALoad] = []
        for key in sorted(wanted - where.keys()):
            free = [i for i, k in enumerate(self._slots) if k is None]
            if free:
                slot = free[0]
            else:
                slot = min((i for i, k in enumerate(self._slots) if k not in wanted), key=self._last_used.__getitem__)
            self._slots[slot] = key
            where = {k: i for i, k in enumerate(self._slots) if k is not None}
            loads.append(LoRALoad(slot, key[0], key[1]))
        slots = []
        for lr in loras:
            if lr is None:
                slots.append(BASE_SLOT)
            else:
                slot = where[(lr.lora_int_id, lr.lora_path)]
                self._last_used[slot] = self._step
                slots.append(slot)
        return slots, loads

    def load_failed(self, load: LoRALoad) -> None:
        """The workers could not load ``load`` (they emptied its slot): the slot holds nothing, and
        the adapter's checked spec goes, so its next request reads its files again."""
        if self._slots[load.slot] == (load.lora_id, load.path):
            self._slots[load.slot] = None
        self._checked.pop((load.lora_id, load.path), None)

    def unsent(self, loads: list[LoRALoad]) -> None:
        """A step's loads never reached the workers: those slots hold nothing known."""
        for load in loads:
            if self._slots[load.slot] == (load.lora_id, load.path):
                self._slots[load.slot] = None
