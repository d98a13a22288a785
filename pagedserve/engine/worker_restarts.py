"""Worker restarts (--restart-workers): a supervisor that owns the restart state, the back-off of
``RestartPolicy`` and the rebuilding of the worker pool and engine core off the loop. AsyncEngine
asks it for the next delay and for a rebuilt pool; failing the in-flight requests, and dying when
no restart is allowed, stay with AsyncEngine (it owns the requests' streams)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.restart_policy import RestartPolicy
from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.error_text import error_summary
from pagedserve.contracts.errors import ExecutorError

logger = logging.getLogger(__name__)


class WorkerSupervisor:
    """Given the engine's config, its restart policy and the thread pool that builds engines."""

    def __init__(self, config: EngineConfig, policy: RestartPolicy,
                 pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.config = config
        self.policy = policy
        self.pool = pool
        self.restart_times: list[float] = []  # monotonic times of restarts within the window
        self.stop = threading.Event()  # set by shutdown: ends a restart's back-off
        self.restarting = False
        self.rebuilding: concurrent.futures.Future | None = None  # the pool being rebuilt
        self.num_worker_restarts = 0  # worker pools rebuilt after a failure
        self.retired_counters = (0, 0, 0)  # cumulative stats of cores replaced by restarts

    def next_restart_delay(self) -> float | None:
        """Back-off before the next restart, or None when the policy allows no more now."""
        now = time.monotonic()
        window = self.policy.window_s
        self.restart_times = [t for t in self.restart_times if now - t < window]
        if len(self.restart_times) >= self.policy.max_restarts:
            return None
        delay = self.policy.delay(len(self.restart_times))
        self.restart_times.append(now)
        return delay

    def limit_reached(self, cause: ExecutorError) -> ExecutorError:
        """The error the engine dies with when the policy allows no more restarts."""
        p = self.policy
        return ExecutorError(
            f"{error_summary(str(cause))}; the workers failed {len(self.restart_times) + 1} "
            f"times within {p.window_s:g} s and --restart-workers allows at most "
            f"{p.max_restarts} restarts in that time: not restarting them again; fix the "
            "cause (see the log) and restart the server")

    async def restart(self, parts, tokenizer, cause: ExecutorError, delay: float = 0.0):
        """Build and return a new worker pool and core (``parts``) off the loop; the old pool is reaped
        first (its memory, on a GPU, must be free before the new workers load the model), then the
        back-off ``delay`` passes (``stop`` cuts it short)."""
        self.restarting = True
        logger.warning("restarting the worker pool (--restart-workers) in %.1f s after: %s", delay, cause)
        old, config, stop = parts.executor, self.config, self.stop

        def rebuild():
            from pagedserve.engine.bootstrap import build_engine

            t0 = time.monotonic()
            old.shutdown()
            if stop.wait(max(0.0, delay - (time.monotonic() - t0))):
                raise EngineDeadError("the server is shutting down; the workers were not restarted")
            new = build_engine(config, tokenizer=tokenizer, cancel=stop)  # shutdown kills the load
            logger.info("worker pool restarted in %.1f s", time.monotonic() - t0)
            return new

        self.rebuilding = self.pool.submit(rebuild)
        new_parts = await asyncio.wrap_future(self.rebuilding)
        self.rebuilding = None
        old_stats = parts.core.stats()
        q, h, p = self.retired_counters
        self.retired_counters = (q + old_stats.prefix_cache_queries, h + old_stats.prefix_cache_hits,
                                 p + old_stats.num_preemptions)
        self.num_worker_restarts += 1
        self.restarting = False
        return new_parts
