"""EngineCore's counters (a mixin, to keep core.py about one job): ``EngineStats`` and
``stats()``, which reads them off the requests, scheduler, block manager, LoRA slots and
speculative decoding (app/metrics.py exports them)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import SeqStatus

__all__ = ["EngineStats", "CoreStats"]


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


class CoreStats:
    """Needs EngineCore's ``requests``, ``block_manager``, ``scheduler``, ``lora_slots``,
    ``spec`` and ``config``."""

    def stats(self) -> EngineStats:
        running = sum(1 for r in self.requests.values() if any(s.status is SeqStatus.RUNNING for s in r.seqs))
        bm = self.block_manager
        stats = EngineStats(
            num_running=running,
            num_waiting=len(self.requests) - running,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_running_seqs=len(self.scheduler.running),
            num_waiting_seqs=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_usable_blocks,
            **(self._lora_stats() if self.lora_slots is not None else {}),
        )
        if self.spec is not None:
            sp = self.spec.stats
            stats.spec_decode_num_drafts = sp.num_drafts
            stats.spec_decode_num_draft_tokens = sp.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = sp.num_accepted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = list(sp.accepted_per_pos)
        return stats

    def _lora_stats(self) -> dict:
        running: set[str] = set()
        waiting: set[str] = set()
        for r in self.requests.values():
            if r.lora_request is not None and not r.finished:
                on = any(s.status is SeqStatus.RUNNING for s in r.seqs)
                (running if on else waiting).add(r.lora_request.lora_name)
        return {"lora_running": tuple(sorted(running)), "lora_waiting": tuple(sorted(waiting)),
                "max_lora": self.config.lora.max_loras}
