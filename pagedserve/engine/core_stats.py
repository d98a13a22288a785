"""EngineCore's counters (kept apart so core.py is about one job): ``EngineStats`` and
``core_stats()``, which reads them off the requests, scheduler, block manager, LoRA slots and
speculative decoding it is given (app/metrics.py exports them)."""
from __future__ import annotations

from dataclasses import dataclass, field

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pagedserve.engine.request import Request, SeqStatus

if TYPE_CHECKING:
    from pagedserve.engine.kv_blocks import BlockManager
    from pagedserve.engine.lora_slots import LoRASlots
    from pagedserve.engine.scheduler import Scheduler
    from pagedserve.engine.spec_decode import SpecDecode

__all__ = ["EngineStats", "core_stats"]


@dataclass(slots=True)
class EngineStats:
    num_running: int  # unfinished requests with a sequence running
    num_waiting: int  # unfinished requests with no sequence running
    kv_cache_usage: float  # fraction of KV blocks held by sequences
    prefix_cache_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # tokens found there (cumulative)
    num_preemptions: int  # cumulative
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_worker_restarts: int = 0  # worker pools rebuilt after a failure (set by AsyncEngine)
    # Multi-LoRA (vLLM's lora_requests_info): adapter names of running / waiting requests, sorted,
    # and the adapters one step may run (0 = LoRA off).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int = 0
    # Speculative decoding (engine/spec_decode.py), cumulative; 0 / [] when it is off.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


def core_stats(requests: Mapping[str, Request], scheduler: "Scheduler", block_manager: "BlockManager",
               lora_slots: "LoRASlots | None", spec: "SpecDecode | None", max_loras: int) -> EngineStats:
    """The counters of one engine core (``max_loras``: --max-loras, reported when LoRA is on)."""
    running = sum(1 for r in requests.values() if any(s.status is SeqStatus.RUNNING for s in r.seqs))
    bm = block_manager
    stats = EngineStats(
        num_running=running,
        num_waiting=len(requests) - running,
        kv_cache_usage=bm.usage,
        prefix_cache_queries=bm.prefix_cache_queries,
        prefix_cache_hits=bm.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_running_seqs=len(scheduler.running),
        num_waiting_seqs=len(scheduler.waiting),
        num_free_blocks=bm.num_free_blocks,
        num_blocks=bm.num_usable_blocks,
        **(_lora_stats(requests, max_loras) if lora_slots is not None else {}),
    )
    if spec is not None:
        sp = spec.stats
        stats.spec_decode_num_drafts = sp.num_drafts
        stats.spec_decode_num_draft_tokens = sp.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = sp.num_accepted_tokens
        stats.spec_decode_num_accepted_tokens_per_pos = list(sp.accepted_per_pos)
    return stats


def _lora_stats(requests: Mapping[str, Request], max_loras: int) -> dict:
    running: set[str] = set()
    waiting: set[str] = set()
    for r in requests.values():
        if r.lora_request is not None and not r.finished:
            on = any(s.status is SeqStatus.RUNNING for s in r.seqs)
            (running if on else waiting).add(r.lora_request.lora_name)
    return {"lora_running": tuple(sorted(running)), "lora_waiting": tuple(sorted(waiting)),
            "max_lora": max_loras}
