"""AsyncEngine: the engine loop as one task on the server's event loop.

The loop schedules a step, awaits the executor (a worker thread or worker processes, so the
event loop stays free to accept requests and stream), processes the outputs and feeds one
asyncio queue per request. Slow per-request work runs off the loop, each kind in a bounded pool
of its own with a deadline (engine/prep_pools.py): tokenizing, chat-template rendering, grammar
validation and compiles; a request past its deadline fails alone (400 naming the flag), a full
pool refuses new work (503). Model loading and restarts use a pool of their own.

The loop survives a request: an exception while one request is added (a MemoryError: 503) or
while its output is processed or delivered fails that request only, and the loop goes on. It
dies only when the executor fails (then --restart-workers applies), or when steps fail for no
request it can name several times in a row (the core's state can no longer be trusted). If the
loop dies, every in-flight request ends with EngineDeadError and new ones are refused: never a
hang.

With ``restart_workers`` (--restart-workers), a worker failure (death, hang, foreign reply:
ExecutorError) fails the in-flight requests, and a fresh worker pool and engine core (empty
scheduler, block manager sized for the new pool) are built off the loop; meanwhile new requests
get EngineRestartingError (503 + Retry-After) and ``health_status()`` says "restarting".
Restarts are bounded (``RestartPolicy``): a pool that dies every time it starts is not rebuilt
for ever; past the limit the engine is dead like one without the flag.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from pagedserve.engine.bounded_render import MAX_TEMPLATE_LINES, _RenderInterrupted, _render_bounded
from pagedserve.engine.core import INTERNAL_REQUEST_ERROR
from pagedserve.engine.engine_loop import StepLoop
from pagedserve.engine.errors import (SHUTDOWN_ABORT_MESSAGE, EngineDeadError, EngineError, EngineOverloadedError,
                           EngineRestartingError)
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.output_collector import OutputCollector
from pagedserve.engine.prep_pools import DeadlinePool
from pagedserve.engine.request_stream import RequestStream, StreamEnd
from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.restart_policy import RestartPolicy
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.worker_restarts import WorkerSupervisor
from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.error_text import error_summary
from pagedserve.contracts.errors import ExecutorError

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Composed of a step loop (engine/engine_loop.StepLoop, given this engine as its output sink)
    and a supervisor owning worker restarts (engine/worker_restarts.WorkerSupervisor)."""

    def __init__(self, config: EngineConfig, restart_policy: RestartPolicy | None = None):
        self.config = config
        self.restart_policy = restart_policy or RestartPolicy()
        self.parts = None
        self.tokenizer = None
        self._queues: dict[str, OutputCollector] = {}
        self._pending_aborts: list[tuple[str, OutputCollector]] = []  # streams dropped unclosed
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._accepting = False
        # Start-up, shutdown and worker restarts only; requests' work has the pools below.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pagedserve-cpu")
        self.supervisor = WorkerSupervisor(config, self.restart_policy, self._pool)
        self._steps: StepLoop | None = None  # built at start, kept across worker restarts
        self._tokenizer_pool = DeadlinePool(
            "tokenizer", 2, config.prep.tokenize_timeout, what="tokenizing the prompt",
            flag="--tokenize-timeout")
        self._template_pool = DeadlinePool(
            "chat-template", 2, config.prep.chat_template_timeout,
            what="rendering the chat template", flag="--chat-template-timeout")
        self.num_deaths = 0  # times the engine loop stopped on a failure (for /metrics)

    # ---- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        from pagedserve.engine.bootstrap import build_engine

        from pagedserve.engine.structured_output.xgrammar_backend import preload

        loop = asyncio.get_running_loop()
        # The grammar engine's import (torch) overlaps the workers' model loading, instead of
        # stalling the loop at the first structured request.
        preloading = loop.run_in_executor(self._pool, preload)
        self.parts = await loop.run_in_executor(self._pool, build_engine, self.config)
        await preloading
        self.tokenizer = self.parts.tokenizer
        # The text-length bound of prompts (app/prompt_options.fit_text): once, off the loop.
        await loop.run_in_executor(self._pool, getattr, self.tokenizer, "max_token_chars", None)
        self._wake = asyncio.Event()
        self._steps = StepLoop(self, self._wake)
        self._accepting = True
        self._task = asyncio.create_task(self._run(), name="pagedserve-engine-loop")

    @property
    def core(self):
        return self.parts.core

    @property
    def last_step_gap_s(self) -> float:
        """Time between a step's reply and the next step's send (0 before the first)."""
        return self._steps.last_step_gap_s if self._steps is not None else 0.0

    @property
    def num_worker_restarts(self) -> int:
        """Worker pools rebuilt after a failure (--restart-workers)."""
        return self.supervisor.num_worker_restarts

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def sampling_defaults(self) -> dict:
        """The model's recommended sampling fields (--generation-config), {} before the start."""
        return self.parts.sampling_defaults if self.parts is not None else {}

    @property
    def embedding_size(self) -> int | None:
        """Values in an embedding (the model's hidden size): the bound of ``dimensions``."""
        return self.core.pooling_hidden_size

    @property
    def num_blocks(self) -> int:
        return self.parts.executor.num_blocks

    def is_healthy(self) -> bool:
        return self.health_status() == "ok"

    def health_status(self) -> str:
        """"ok", "restarting" (a new worker pool is being built) or "dead"."""
        if self._error is not None or self._task is None or self._task.done():
            return "dead"
        return "restarting" if self.supervisor.restarting else "ok"

    def replica_states(self) -> None:
        """One engine, no data-parallel replicas (engine.client.EngineClient)."""
        return None

    def stats(self):
        s = self.core.stats()
        queries, hits, preemptions = self.supervisor.retired_counters  # counters stay monotonic
        s.prefix_cache_queries += queries
        s.prefix_cache_hits += hits
        s.num_preemptions += preemptions
        s.num_worker_restarts = self.num_worker_restarts
        if self.health_status() != "ok":
            # Dead, or rebuilding a failed pool: the in-flight requests were failed with it. The
            # core that still lists them is never stepped again, so the gauges say what is true:
            # nothing runs, waits, or holds KV (counters above stay cumulative).
            s.num_running = s.num_waiting = s.num_running_seqs = s.num_waiting_seqs = 0
            s.kv_cache_usage = 0.0
            s.num_free_blocks = s.num_blocks
        return s

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish for up to timeout_s; abort the rest."""
        self._accepting = False
        self.supervisor.stop.set()
        deadline = time.monotonic() + timeout_s
        while self._queues and self.is_healthy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(EngineDeadError(SHUTDOWN_ABORT_MESSAGE))
            self._abort_now(request_id)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        loop = asyncio.get_running_loop()
        # A restart was under way: stop the pool it builds too. (Cancelling the loop before the
        # rebuild started cancels it: awaiting it then would raise CancelledError here.)
        rebuilding = self.supervisor.rebuilding
        if rebuilding is not None and not rebuilding.cancelled():
            try:
                parts = await asyncio.wrap_future(rebuilding)
                if parts is not self.parts:
                    await loop.run_in_executor(self._pool, parts.executor.shutdown)
            except Exception:  # noqa: BLE001 - the failed restart was logged
                pass
        if self.parts is not None:
            await loop.run_in_executor(self._pool, self.parts.executor.shutdown)
            self.parts.core.constraints.manager.shutdown()
        self._pool.shutdown(wait=False)
        self._tokenizer_pool.shutdown()
        self._template_pool.shutdown()

    # ---- requests -------------------------------------------------------------------------

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Off the loop in the tokenizer pool (--tokenize-timeout; PrepDeadlineError: 400)."""
        return await self._tokenizer_pool.run(self.tokenizer.encode, text, add_special_tokens, param="prompt")

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._tokenizer_pool.run(self.tokenizer.decode, token_ids, skip_special_tokens,
                                              param="tokens")

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        """The token strings of ``token_ids`` (``/tokenize`` return_token_strs), off the loop."""
        return await self._tokenizer_pool.run(self.tokenizer.convert_ids_to_tokens, token_ids, param="prompt")

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, **template_kwargs) -> str:
        """``template_kwargs``: ``chat_template`` and the template's variables (Tokenizer.
        apply_chat_template). In the chat-template pool with its deadline (--chat-template-timeout):
        a request's own template is also interrupted there; the model's is trusted to end."""
        pool = self._template_pool
        own_template = template_kwargs.get("chat_template") is not None

        def render():
            try:
                return _render_bounded(lambda: self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, **template_kwargs),
                    pool.timeout_s if own_template else None, MAX_TEMPLATE_LINES if own_template else None)
            except _RenderInterrupted:
                raise pool.deadline_error(param="chat_template") from None

        return await pool.run(render, param="chat_template" if own_template else "messages")

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 prompt: str | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Register a request and return its stream of deltas. Raises at once, before any
        output, when the engine is dead (EngineDeadError), the waiting queue is full
        (EngineOverloadedError) or the request can never run (RequestRejectedError).
        ``cache_salt`` isolates the request's prefix-cache blocks to requests of the same salt;
        ``lora_request`` runs it with that adapter (--enable-lora)."""
        self._check_alive()
        waiting = self.core.stats().num_waiting
        if waiting >= self.config.scheduler.max_waiting_requests:
            raise EngineOverloadedError(
                f"{waiting} requests are already waiting (--max-waiting-requests); retry shortly")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        queue = OutputCollector()
        core = self.core
        try:
            core.add_request(request_id, prompt, prompt_token_ids, params, priority=priority,
                             cache_salt=cache_salt, lora_request=lora_request)
        except (ValueError, EngineError):  # the request's fault (400) or a full pool (503)
            self._discard(core, request_id)
            raise
        except MemoryError:
            self._discard(core, request_id)
            logger.warning("request %s: out of memory while admitting it; refused with 503", request_id)
            raise EngineOverloadedError("the server has not enough memory to admit this request now; retry "
                                        "later or send a smaller request") from None
        except Exception as e:  # noqa: BLE001 - a fault in preparing this request: it alone fails
            self._discard(core, request_id)
            logger.error("request %s: preparing it failed; the engine goes on", request_id, exc_info=e)
            raise EngineError(f"preparing the request failed: {INTERNAL_REQUEST_ERROR}") from None
        self._queues[request_id] = queue
        self._wake.set()
        return RequestStream(request_id, queue, self._stream_ended)

    def _stream_ended(self, request_id: str, queue: OutputCollector, how: StreamEnd) -> None:
        """A RequestStream's ``on_close``: forget the request's queue; abort the request when
        its reader closed the stream early (now) or dropped it (at the loop's next turn)."""
        if how is StreamEnd.DROPPED:
            if self._queues.get(request_id) is queue:  # else already ended (or the id reused)
                self._pending_aborts.append((request_id, queue))
            return
        self._queues.pop(request_id, None)
        if how is StreamEnd.CLOSED:
            self._abort_now(request_id)

    def has_request(self, request_id: str) -> bool:
        """Is ``request_id`` running here (its stream not yet ended)?"""
        return request_id in self._queues

    def _discard(self, core, request_id: str) -> None:
        """Remove what a failed add_request left of this request (never another one: add_request
        refuses an id in use before registering anything)."""
        if request_id in self._queues:  # the id belongs to a running request: not ours to touch
            return
        req = core.requests.get(request_id)
        if req is None:
            return
        try:
            core.abort_request(request_id)
        except Exception:  # noqa: BLE001 - half-built: drop it by hand
            logger.exception("request %s: cleaning up after a failed add_request", request_id)
            core.requests.pop(request_id, None)
            for seq in req.seqs:
                core.drop_seq(seq)
                try:
                    core.scheduler.finish(seq)
                except Exception:  # noqa: BLE001
                    pass

    def check_lora(self, lora_request: LoRARequest) -> None:
        """RequestRejectedError naming what is wrong unless the adapter can serve here (read from
        disk once per id and path: its header only, a few milliseconds)."""
        self.core.check_lora(lora_request)

    def lora_requests_in_use(self, lora_int_id: int) -> int:
        """Requests running with or waiting for adapter ``lora_int_id``."""
        return self.core.lora_requests_in_use(lora_int_id)

    def forget_lora(self, lora_int_id: int) -> None:
        """An adapter unloaded by the server: its slot and checked spec go."""
        self.core.forget_lora(lora_int_id)

    def pool(self, prompt_token_ids: list[int], params, request_id: str, prompt: str | None = None,
             priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """A pooling request (``params``: engine.pooling_params.PoolingParams): the same checks
        and queue as ``generate``; its stream yields one PoolingRequestOutput, the final one."""
        return self.generate(prompt_token_ids, params, request_id, prompt=prompt, priority=priority,
                             cache_salt=cache_salt)

    async def check_constraint(self, params: SamplingParams) -> None:
        """Refuse, before ``generate``, a structured-output spec or token constraint the grammar
        engine cannot honour (RequestRejectedError with the library's reason: HTTP 400), and wait
        for its grammar to compile, all within --grammar-compile-timeout (PrepDeadlineError: 400
        naming it): a stream then starts only for a grammar that is ready. Runs off the loop, in
        the grammar pool: the first check of a spec parses it (the first ever imports xgrammar);
        requests with the same spec share one compile."""
        if self.parts is None or not params.has_token_constraint:
            return
        manager = self.core.constraints.manager
        t0 = time.monotonic()
        await manager.pool.run(self.core.check_constraint, params)
        spec = params.structured_outputs
        if spec is None:
            return
        compiled = manager.compiled(spec)
        if compiled.done():
            return  # a compile error surfaces (and is retried) when the request is added
        timeout = manager.compile_timeout_s
        inner = asyncio.wrap_future(compiled)
        inner.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        waiter = asyncio.shield(inner)
        try:
            if timeout:
                await asyncio.wait_for(waiter, max(0.0, timeout - (time.monotonic() - t0)))
            else:
                await waiter
        except TimeoutError:
            manager.release_overdue()
            raise manager.deadline_error() from None
        except Exception:  # noqa: BLE001 - the compile's own error is reported by add_request
            pass

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        self._abort_now(request_id)
        if queue is not None:
            queue.put_nowait(EngineDeadError(f"request {request_id} was aborted"))

    def _abort_now(self, request_id: str) -> None:
        if self.parts is not None and self._error is None:
            self.core.abort_request(request_id)
            if self._wake is not None:
                self._wake.set()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(self._death_message())
        if self.supervisor.restarting:
            raise EngineRestartingError("the engine is restarting its workers after a failure; "
                                        "retry in a few seconds")
        if not self._accepting or self._task is None or self._task.done():
            raise EngineDeadError("the engine is not running (starting up or shutting down)")

    # ---- the loop, its output sink, and death -----------------------------------------------

    async def _run(self) -> None:
        """Step until the executor fails; then restart the workers (--restart-workers, within the
        policy) or die, failing every in-flight request either way."""
        supervisor = self.supervisor
        while True:
            try:
                await self._steps.run(self.parts.core, self.parts.executor)
            except asyncio.CancelledError:
                raise
            except ExecutorError as e:
                if not self.config.parallel.restart_workers or not self._accepting:
                    self._die(e)
                    return
                delay = supervisor.next_restart_delay()
                if delay is None:
                    self._die(supervisor.limit_reached(e))
                    return
                self._fail_in_flight(EngineDeadError(
                    f"the workers failed and the request was aborted: {error_summary(str(e))} (the server is "
                    "restarting its workers; retry shortly)"))
                try:
                    parts = await supervisor.restart(self.parts, self.tokenizer, e, delay)
                except asyncio.CancelledError:
                    raise
                except BaseException as restart_error:  # noqa: BLE001
                    self._die(ExecutorError(f"{e}; restarting the workers failed: {restart_error}"))
                    return
                self.parts = parts  # a fresh scheduler and block manager sized for the new pool
                self._pending_aborts.clear()  # ids of the old core's requests
            except BaseException as e:  # noqa: BLE001 - any failure must reach every request
                self._die(e)
                return

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's deltas to their requests, stamped with the time they were produced (so
        TTFT / inter-token latency measure the engine, not how fast a client reads)."""
        now = time.monotonic()
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            try:
                for comp in out.outputs if isinstance(out, RequestOutput) else ():  # not pooling's
                    if comp.token_ids and comp.token_times is None:
                        comp.token_times = [now] * len(comp.token_ids)
                queue.put_nowait(out)
            except Exception as e:  # noqa: BLE001 - this request's stream fails, not the loop
                logger.error("request %s: delivering its output failed", out.request_id, exc_info=e)
                self._queues.pop(out.request_id, None)
                queue.put_nowait(EngineError(INTERNAL_REQUEST_ERROR))
                self._abort_now(out.request_id)

    def fail_stream(self, request_id: str, error: BaseException) -> None:
        """End the request's stream with ``error`` (its request is already gone from the core)."""
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)

    def apply_pending_aborts(self, core) -> None:
        """Abort, in the core, the requests whose streams ended since the last step."""
        while self._pending_aborts:
            request_id, queue = self._pending_aborts.pop()
            if self._queues.get(request_id) is queue:  # else already ended (or the id reused)
                del self._queues[request_id]
                core.abort_request(request_id)

    def _die(self, e: BaseException) -> None:
        logger.error("engine loop died", exc_info=e)
        self._error = e
        self.supervisor.restarting = False
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
