"""Data-parallel replicas (--data-parallel-size N): N engines behind the AsyncEngine API.

Each replica is a whole AsyncEngine: its own engine loop task (all on the server's one event
loop), executor, worker processes and KV cache. ``ReplicatedEngine`` is an
engine.client.EngineClient as one AsyncEngine is, so the HTTP side does not change; ``generate`` asks the policy
(engine/dp_policy.py) which replica takes the request. The replicas share nothing but the event
loop, so a dead replica fails only its own in-flight requests, and the router stops sending to
it (a replica restarting its workers, --restart-workers, is skipped until it is back).

Health: ``health_status()`` is "ok" while any replica is ok (the server can still answer);
"restarting" when none is ok but one is rebuilding its workers; "dead" when all are dead.
``replica_states()`` lists each replica's own status for /health and /metrics.

Cores: each replica's workers get ``cpus // (N x ranks per replica)`` torch threads (its
config's ``worker_threads``, unless the user chose a count: --worker-threads or
$PAGEDSERVE_WORKER_THREADS), so N replicas use the same cores as one.
--kv-cache-memory is per replica. GPUs: replica i's workers take the world-size GPUs after those of
replicas 0..i-1 (its config's ``data_parallel_rank``; gpu/device.py cuda_device_index).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import fields

from pagedserve.engine.dp_policy import PrefixIndex, ReplicaView, choose_replica
from pagedserve.engine.errors import EngineDeadError, EngineOverloadedError, EngineRestartingError
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts import env
from pagedserve.contracts.config import ConfigError, EngineConfig
from pagedserve.contracts.cpu_threads import usable_cpus

logger = logging.getLogger(__name__)

_LIVE_GAUGES = ("num_running", "num_waiting", "num_running_seqs", "num_waiting_seqs")


def check_data_parallel(config: EngineConfig, num_replicas: int) -> None:
    """Refuse what cannot be replicated, before anything starts."""
    if num_replicas < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {num_replicas}")
    if num_replicas > 1 and config.parallel.resolved_executor() == "inproc":
        raise ConfigError("--data-parallel-size > 1 needs worker processes (--executor mp): "
                          "in-process replicas would share one torch thread pool")


def ranks_per_replica(config: EngineConfig) -> int:
    return config.parallel.world_size


def _replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s own copy of the config: on CUDA its index picks its GPUs."""
    config = copy.deepcopy(config)
    config.parallel.data_parallel_rank = index
    return config


def _engine_factory(config: EngineConfig, restart_policy):
    from pagedserve.engine.async_engine import AsyncEngine

    return AsyncEngine(config, restart_policy=restart_policy)


class ReplicatedEngine:
    """N replicas, one router. ``engine_factory(config, restart_policy)`` builds a replica
    (AsyncEngine; tests pass stand-ins). ``prefix_aware=False`` routes by load alone."""

    def __init__(self, config: EngineConfig, num_replicas: int, restart_policy=None,
                 engine_factory: Callable | None = None, prefix_aware: bool = True, **policy_options):
        if num_replicas < 1:
            raise ConfigError(f"--data-parallel-size must be at least 1, got {num_replicas}")
        factory = engine_factory or _engine_factory
        self.num_replicas = num_replicas
        self.replicas = [factory(_replica_config(config, i), restart_policy) for i in range(num_replicas)]
        self.config = self.replicas[0].config
        self.policy_options = policy_options  # max_imbalance, kv_imbalance
        self.prefix_aware = prefix_aware  # False: load alone decides (to measure what prefixes buy)
        self.prefix_index: PrefixIndex | None = None
        self._generation = [0] * num_replicas  # deaths + restarts seen: a change empties its cache
        self.num_routed = [0] * num_replicas  # requests sent to each replica
        self.num_prefix_routed = [0] * num_replicas  # ... of which for a prefix hit there
        self.num_decisions = 0
        self.decision_ns = 0  # total time spent deciding (hashing the prefix included)

    # ---- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        if (self.num_replicas > 1 and self.config.parallel.worker_threads is None
                and not env.WORKER_THREADS.is_set() and self.config.parallel.resolved_executor() != "inproc"):
            cpus = usable_cpus()  # affinity mask capped by the cgroup CPU quota
            threads = max(1, cpus // (self.num_replicas * ranks_per_replica(self.config)))
            for replica in self.replicas:  # each builds its workers from its own config
                replica.config.parallel.worker_threads = threads
            logger.info("%d replicas on %d CPUs: %d torch thread(s) per worker", self.num_replicas,
                        cpus, threads)
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = [e for e in results if isinstance(e, BaseException)]
        if failed:
            await self.shutdown()
            raise failed[0]
        self._build_prefix_index()
        logger.info("%d data-parallel replicas ready", self.num_replicas)

    def _build_prefix_index(self) -> None:
        bm = self.replicas[0].core.block_manager
        if not bm.enable_prefix_caching:
            return
        self.prefix_index = PrefixIndex(bm.block_size, bm.root_hash, self.num_replicas)

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        await asyncio.gather(*(r.shutdown(timeout_s) for r in self.replicas), return_exceptions=True)

    # ---- what app/ reads --------------------------------------------------------------------

    def _front(self):
        """The replica that answers tokenizer work: the first live one (any, if none is)."""
        for r in self.replicas:
            if r.health_status() == "ok":
                return r
        return self.replicas[0]

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def sampling_defaults(self) -> dict:
        return self.replicas[0].sampling_defaults

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def num_blocks(self) -> int:
        """KV blocks of all replicas together (each has its own cache)."""
        return sum(r.num_blocks for r in self.replicas)

    @property
    def embedding_size(self) -> int | None:
        return self.replicas[0].embedding_size

    @property
    def num_deaths(self) -> int:
        return sum(r.num_deaths for r in self.replicas)

    @property
    def last_step_gap_s(self) -> float:
        return max(r.last_step_gap_s for r in self.replicas)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._front().encode(text, add_special_tokens)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._front().decode(token_ids, skip_special_tokens)

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return await self._front().convert_ids_to_tokens(token_ids)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, **template_kwargs) -> str:
        return await self._front().render_chat(messages, add_generation_prompt, continue_final_message,
                                               **template_kwargs)

    async def check_constraint(self, params: SamplingParams) -> None:
        await self._front().check_constraint(params)

    def is_healthy(self) -> bool:
        return self.health_status() == "ok"

    def health_status(self) -> str:
        """"ok" while any replica is ok; else "restarting" if one is rebuilding; else "dead"."""
        states = self.replica_states()
        if "ok" in states:
            return "ok"
        return "restarting" if "restarting" in states else "dead"

    def replica_states(self) -> list[str]:
        return [r.health_status() for r in self.replicas]

    def replica_stats(self) -> list:
        """Each replica's EngineStats (None for one whose stats cannot be read). A replica that
        is not ok holds no live request (they were failed): its gauges read 0, its counters stay."""
        out = []
        for r in self.replicas:
            try:
                s = r.stats()
            except Exception:  # noqa: BLE001 - a replica that never started has no core
                out.append(None)
                continue
            if r.health_status() != "ok":
                for name in _LIVE_GAUGES:
                    setattr(s, name, 0)
                s.kv_cache_usage = 0.0
            out.append(s)
        return out

    def stats(self):
        """The replicas' figures added up; KV usage over all their blocks."""
        per = [s for s in self.replica_stats() if s is not None]
        if not per:
            raise EngineDeadError("no replica has stats")
        total = copy.copy(per[0])
        for f in fields(total):
            values = [getattr(s, f.name) for s in per]
            if f.name == "max_lora":  # every replica's own limit, the same
                total.max_lora = max(values)
            elif f.name == "spec_decode_num_accepted_tokens_per_pos":  # a count per draft position
                width = max(len(v) for v in values)
                total.spec_decode_num_accepted_tokens_per_pos = [sum(v[p] for v in values if p < len(v))
                                                                 for p in range(width)]
            elif isinstance(values[0], tuple):  # adapter names: those of any replica
                setattr(total, f.name, tuple(sorted(set().union(*values))))
            elif f.name != "kv_cache_usage":
                setattr(total, f.name, sum(values))
        blocks = [s.num_blocks for s in per]
        if sum(blocks):
            total.kv_cache_usage = sum(s.kv_cache_usage * b for s, b in zip(per, blocks)) / sum(blocks)
        else:
            total.kv_cache_usage = sum(s.kv_cache_usage for s in per) / len(per)
        return total

    # ---- requests -------------------------------------------------------------------------

    def _views(self) -> list[ReplicaView]:
        views = []
        for i, r in enumerate(self.replicas):
            alive = r.health_status() == "ok"
            generation = r.num_deaths + r.num_worker_restarts
            if generation != self._generation[i]:  # its prefix cache is gone
                self._generation[i] = generation
                if self.prefix_index is not None:
                    self.prefix_index.forget_replica(i)
            if alive:
                core = r.core
                views.append(ReplicaView(i, True, len(core.requests), core.block_manager.usage))
            else:
                views.append(ReplicaView(i, False, 0, 0.0))
        return views

    def route(self, prompt_token_ids: list[int], cache_salt: str | None,
              use_prefix: bool = True) -> tuple[list[ReplicaView], list[bytes]]:
        """Views of the replicas with this prompt's prefix hits filled in, and the prompt's block
        hashes (for the record); ``views`` sorted best first."""
        views = self._views()
        hashes: list[bytes] = []
        index = self.prefix_index
        if index is not None and use_prefix and self.prefix_aware:
            hashes = index.block_hashes(prompt_token_ids, cache_salt)
            if hashes:
                replicas = self.replicas
                hits = index.hits(hashes, lambda i, h: replicas[i].core.block_manager.is_cached(h),
                                  [v.alive for v in views])
                for v, n in zip(views, hits):
                    v.prefix_blocks = n
        first = choose_replica(views, **self.policy_options)
        order = sorted((v for v in views if v.alive and v is not first),
                       key=lambda v: (v.num_requests, v.kv_usage))
        return ([first] + order if first is not None else []), hashes

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 prompt: str | None = None, priority: int = 0, cache_salt: str | None = None,
                 lora_request=None):
        """AsyncEngine.generate on the replica the policy picks; when that one refuses for load
        (its waiting queue is full), the next best live replica is asked."""
        t0 = time.perf_counter_ns()
        if self.owner_of(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already running")
        candidates, hashes = self.route(prompt_token_ids, cache_salt,
                                        use_prefix=not isinstance(params, SamplingParams)
                                        or params.prompt_logprobs is None)
        self.decision_ns += time.perf_counter_ns() - t0
        self.num_decisions += 1
        if not candidates:
            raise self._none_alive_error()
        error: BaseException | None = None
        for view in candidates:
            replica = self.replicas[view.index]
            try:
                stream = replica.generate(prompt_token_ids, params, request_id, prompt=prompt,
                                          priority=priority, cache_salt=cache_salt, lora_request=lora_request)
            except (EngineOverloadedError, EngineDeadError) as e:
                error = error or e
                continue
            self.num_routed[view.index] += 1
            if view.prefix_blocks:
                self.num_prefix_routed[view.index] += 1
            if hashes and self.prefix_index is not None:
                self.prefix_index.routed(hashes, view.index)
            return stream
        raise error

    def check_lora(self, lora_request) -> None:
        """Every replica serves the same model: checking on the first says it for all."""
        self.replicas[0].check_lora(lora_request)

    def lora_requests_in_use(self, lora_int_id: int) -> int:
        return sum(r.lora_requests_in_use(lora_int_id) for r in self.replicas)

    def forget_lora(self, lora_int_id: int) -> None:
        for r in self.replicas:
            r.forget_lora(lora_int_id)

    def pool(self, prompt_token_ids: list[int], params, request_id: str, prompt: str | None = None,
             priority: int = 0, cache_salt: str | None = None):
        """A pooling request (engine.pooling_params.PoolingParams), routed as ``generate`` routes
        (AsyncEngine.pool is its generate with pooling params)."""
        return self.generate(prompt_token_ids, params, request_id, prompt=prompt, priority=priority,
                             cache_salt=cache_salt)

    def _none_alive_error(self) -> BaseException:
        if self.health_status() == "restarting":
            return EngineRestartingError("every replica is restarting its workers after a failure; "
                                         "retry in a few seconds")
        return EngineDeadError("every data-parallel replica has stopped; restart the server "
                               "(or serve with --restart-workers)")

    def owner_of(self, request_id: str) -> int | None:
        """The replica running ``request_id`` (its AsyncEngine keeps one queue per request)."""
        for i, r in enumerate(self.replicas):
            if r.has_request(request_id):
                return i
        return None

    async def abort(self, request_id: str) -> None:
        i = self.owner_of(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)
