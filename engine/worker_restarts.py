"""AsyncEngine's worker restarts and death (a mixin, to keep async_engine.py about one job):
the back-off of --restart-workers (``RestartPolicy``), rebuilding the worker pool and engine core
off the loop, and, when the loop dies, failing every in-flight request with EngineDeadError.

Needs AsyncEngine's ``config``, ``restart_policy``, ``_restart_times``, ``_stop_restart``,
``parts``, ``tokenizer``, ``_queues``, ``_pending_aborts``, ``_pool``, ``_rebuild``,
``_restarting``, ``_error``, ``_retired_counters``, ``num_deaths`` and ``num_worker_restarts``."""
from __future__ import annotations

import asyncio
import logging
import time

from engine.errors import EngineDeadError
from contracts.error_text import error_summary
from contracts.errors import ExecutorError

logger = logging.getLogger(__name__)


class WorkerRestarts:
    def _next_restart_delay(self) -> float | None:
        """Back-off before the next restart, or None when the policy allows no more now."""
        now = time.monotonic()
        window = self.restart_policy.window_s
        self._restart_times = [t for t in self._restart_times if now - t < window]
        if len(self._restart_times) >= self.restart_policy.max_restarts:
            return None
        delay = self.restart_policy.delay(len(self._restart_times))
        self._restart_times.append(now)
        return delay

    def _die(self, e: BaseException) -> None:
        logger.error("engine loop died", exc_info=e)
        self._error = e
        self._restarting = False
        self.num_deaths += 1
        self._fail_in_flight(EngineDeadError(self._death_message()))

    def _death_message(self) -> str:
        hint = ""
        if isinstance(self._error, ExecutorError) and not self.config.parallel.restart_workers:
            hint = "; restart the server (or serve with --restart-workers)"
        return f"the engine stopped: {error_summary(str(self._error))}{hint}"  # full text: the log

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()

    async def _restart_workers(self, cause: ExecutorError, delay: float = 0.0) -> None:
        """Build a new worker pool and core off the loop; the old pool is reaped first (its
        memory, on a GPU, must be free before the new workers load the model), then the
        back-off ``delay`` passes (shutdown cuts it short)."""
        self._restarting = True
        logger.warning("restarting the worker pool (--restart-workers) in %.1f s after: %s", delay, cause)
        old, config, tokenizer = self.parts.executor, self.config, self.tokenizer
        stop = self._stop_restart

        def rebuild():
            from engine.bootstrap import build_engine

            t0 = time.monotonic()
            old.shutdown()
            if stop.wait(max(0.0, delay - (time.monotonic() - t0))):
                raise EngineDeadError("the server is shutting down; the workers were not restarted")
            parts = build_engine(config, tokenizer=tokenizer, cancel=stop)  # shutdown kills the load
            logger.info("worker pool restarted in %.1f s", time.monotonic() - t0)
            return parts

        self._rebuild = self._pool.submit(rebuild)
        parts = await asyncio.wrap_future(self._rebuild)
        self._rebuild = None
        old_stats = self.parts.core.stats()
        q, h, p = self._retired_counters
        self._retired_counters = (q + old_stats.prefix_cache_queries, h + old_stats.prefix_cache_hits,
                                  p + old_stats.num_preemptions)
        self.parts = parts  # a fresh scheduler and block manager sized for the new pool
        self._pending_aborts.clear()  # ids of the old core's requests
        self.num_worker_restarts += 1
        self._restarting = False
