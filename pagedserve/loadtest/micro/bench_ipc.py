"""`pagedserve bench ipc`: round trip of a decode step's messages, shm ring vs pipe vs multiprocessing.Queue.

A spawned echo process receives a decode-step StepInput for N scheduled sequences and answers
with a StepOutput carrying N sampled tokens. Measured per round trip, send to decoded reply:

  ring        ShmRing + msgspec msgpack (what MultiprocExecutor does on x86, without the executor)
  pipe        PipeChannel + msgspec msgpack (the transport on CPUs without x86 memory ordering)
  queue       multiprocessing.Queue of the same Python objects (pickle, feeder thread, pipe)
  executor    MultiprocExecutor.execute with an echo runner (rings + framing + health checks)
  async       MultiprocExecutor.execute_async from an asyncio loop (eventfd via add_reader)
  *-bytes     transport only: the encoded step message echoed back unchanged (ring / pipe / Queue)

The executor rows use whatever gpu/transport.py picks (PAGEDSERVE_STEP_TRANSPORT overrides); the
ring rows are left out on CPUs where the ring refuses to run.

Serialization is part of every round trip except the *-bytes ones. Both transports carry the
same message objects: the step's per-sequence columns are int arrays (contracts/messages.py), which
msgspec moves as raw bytes and pickle as array reconstructors, so neither side decodes one
Python int per sequence; the echo's reply is as big as a real one (an int64 sequence id and an
int32 token per sequence).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time

from pagedserve.contracts.messages import STEP_OUTPUT_DECODER, StepInput, StepOutput
from pagedserve.gpu.shm_ring import ring_is_safe_here
from pagedserve.gpu.transport import attach_channel, create_channel
from pagedserve.gpu.worker import SHUTDOWN_MESSAGE, TAG_SHUTDOWN, decode_step, encode_output, encode_step
from pagedserve.loadtest.micro.ipc_echo import _Echo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,64,256",
                        help="comma-separated numbers of scheduled sequences per step (default 1,64,256)")
    parser.add_argument("--iters", type=int, default=2000, help="round trips per measurement (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips first (default 200)")
    parser.add_argument("--no-executor", action="store_true",
                        help="skip the MultiprocExecutor (sync and async) measurements")
    parser.add_argument("--no-raw", action="store_true",
                        help="skip the transport-only measurements (pre-encoded bytes echoed back)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--ray", action="store_true",
                        help="add the Ray executor's transports (ring, actor call, compiled graph) on a "
                             "local Ray instance (loadtest/micro/bench_ipc_ray.py; needs the ray extra)")


def decode_step_input(n: int, step_id: int = 0) -> StepInput:
    """A steady-state decode step: n sequences, one token each, every 16th gets a new block."""
    with_block = range(0, n, 16)
    return StepInput.pack(step_id, [], range(10_000, 10_000 + n), [1] * n,
                          with_block, [50_000 + i for i in with_block], [])


def echo_output(step: StepInput) -> StepOutput:
    """The reply of the same size (each sequence 'samples' its new-token count), read through the
    column views a worker uses and built without a Python loop, so the echo's own work stays
    small next to the transport being measured (both transports pay it alike)."""
    return StepOutput(step.step_id, step.seq_ids.tobytes(), step.num_new_tokens.tobytes())


class EchoRunner:
    """A model runner that samples a deterministic token per scheduled sequence (no model)."""

    def __init__(self, config, rank: int):
        self.rank = rank

    def initialize(self) -> int:
        return 1

    def execute(self, step: StepInput) -> StepOutput:
        return echo_output(step)


def _ring_echo(step_spec, reply_spec, raw: bool = False) -> None:
    parent = multiprocessing.parent_process()
    peers = [parent.sentinel] if parent is not None else []
    steps = attach_channel(step_spec, 0, peer_fds=peers)
    replies = attach_channel(reply_spec, "writer", peer_fds=peers)
    while True:
        msg = steps.recv()
        if msg[0] == TAG_SHUTDOWN:
            break
        replies.send(msg if raw else encode_output(echo_output(decode_step(msg))))
    steps.close()
    replies.close()


def _queue_echo(inbox, outbox, raw: bool = False) -> None:
    while True:
        step = inbox.get()
        if step is None:
            break
        outbox.put(step if raw else echo_output(step))


def _summary(samples_ns: list[int]) -> dict:
    us = sorted(s / 1000 for s in samples_ns)
    p99 = us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]
    return {"median_us": round(statistics.median(us), 1), "p99_us": round(p99, 1),
            "mean_us": round(statistics.fmean(us), 1)}


class _RingEcho(_Echo):
    def __init__(self, ctx, raw: bool = False, kind: str = "shm"):
        self.raw = raw
        self.steps = create_channel(1, 64, 16384, role="writer", kind=kind)
        self.replies = create_channel(1, 64, 16384, role=0, kind=kind)
        self.proc = ctx.Process(target=_ring_echo, args=(self.steps.spec, self.replies.spec, raw),
                                daemon=True)
        self.proc.start()
        self.steps.peer_fds = self.replies.peer_fds = [self.proc.sentinel]

    def round_trip(self, step):
        if self.raw:
            self.steps.send(step)
            return self.replies.recv()
        self.steps.send(encode_step(step))
        return STEP_OUTPUT_DECODER.decode(self.replies.recv())

    def close(self) -> None:
        try:
            self.steps.send(SHUTDOWN_MESSAGE, timeout=1)
        except Exception:
            pass
        _stop(self.proc)
        self.steps.close()
        self.replies.close()


class _QueueEcho(_Echo):
    def __init__(self, ctx, raw: bool = False):
        self.raw = raw
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_queue_echo, args=(self.inbox, self.outbox, raw), daemon=True)
        self.proc.start()

    def round_trip(self, step):
        self.inbox.put(step)
        return self.outbox.get(timeout=30)

    def close(self) -> None:
        self.inbox.put(None)
        _stop(self.proc)


class _ExecutorEcho(_Echo):
    def __init__(self, executor, use_async: bool):
        self.ex = executor
        self.loop = asyncio.new_event_loop() if use_async else None

    def round_trip(self, step):
        if self.loop is None:
            return self.ex.execute(step)
        return self.loop.run_until_complete(self.ex.execute_async(step))

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()


def _stop(proc) -> None:
    proc.join(5)
    if proc.exitcode is None:
        proc.kill()
        proc.join()


def _measure(echo: _Echo, n: int, iters: int, first_id: int) -> list[int]:
    samples = []
    for i in range(first_id, first_id + iters):
        step = echo.prepare(decode_step_input(n, i))
        t0 = time.perf_counter_ns()
        out = echo.round_trip(step)
        t1 = time.perf_counter_ns()
        if echo.raw:
            if out != step:
                raise RuntimeError("the echo changed the bytes")
        elif out.step_id != i or len(out.token_ids) != n:
            raise RuntimeError(f"echo answered step {out.step_id} with {len(out.token_ids)} tokens")
        samples.append(t1 - t0)
    return samples


def bench(sizes: list[int], iters: int, warmup: int, with_executor: bool, with_raw: bool,
          rounds: int = 10, with_ray: bool = False) -> dict:
    """Interleave the transports in rounds so load from other processes hits them alike."""
    ctx = multiprocessing.get_context("spawn")
    echoes: dict[str, _Echo] = {}
    executor = None
    ray_echoes: dict[str, _Echo] = {}
    try:
        if ring_is_safe_here():
            echoes["ring"] = _RingEcho(ctx)
        echoes["pipe"] = _RingEcho(ctx, kind="pipe")
        echoes["queue"] = _QueueEcho(ctx)
        if with_executor:
            from pagedserve.contracts.config import EngineConfig
            from pagedserve.gpu.mp_executor import MultiprocExecutor

            executor = MultiprocExecutor(EngineConfig.from_options(executor="mp"),
                                         runner_factory="pagedserve.loadtest.micro.bench_ipc:EchoRunner", startup_timeout=120)
            echoes["executor"] = _ExecutorEcho(executor, use_async=False)
            echoes["async"] = _ExecutorEcho(executor, use_async=True)
        if with_raw:
            if ring_is_safe_here():
                echoes["ring-bytes"] = _RingEcho(ctx, raw=True)
            echoes["pipe-bytes"] = _RingEcho(ctx, raw=True, kind="pipe")
            echoes["queue-bytes"] = _QueueEcho(ctx, raw=True)
        if with_ray:
            from pagedserve.loadtest.micro.bench_ipc_ray import ray_echoes as start_ray_echoes

            ray_echoes = start_ray_echoes()
            echoes.update(ray_echoes)
        next_id = {name: 0 for name in echoes}
        samples: dict[str, dict[int, list[int]]] = {name: {n: [] for n in sizes} for name in echoes}
        per_round = max(1, iters // rounds)
        from tqdm import tqdm

        progress = tqdm(total=len(sizes) * rounds * len(echoes), desc="bench ipc", unit="round",
                        file=sys.stderr, leave=False)
        for n in sizes:
            for name, echo in echoes.items():
                _measure(echo, n, warmup, next_id[name])
                next_id[name] += warmup
            for _ in range(rounds):
                for name, echo in echoes.items():
                    samples[name][n] += _measure(echo, n, per_round, next_id[name])
                    next_id[name] += per_round
                    progress.update(1)
        progress.close()
        return {name: {n: _summary(s) for n, s in by_size.items()} for name, by_size in samples.items()}
    finally:
        for name, echo in echoes.items():
            if name not in ray_echoes:
                echo.close()
        if executor is not None:
            executor.shutdown()
        if ray_echoes:
            from pagedserve.loadtest.micro.bench_ipc_ray import close_ray

            close_ray(ray_echoes)


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    step_bytes = {n: len(encode_step(decode_step_input(n))) for n in sizes}
    reply_bytes = {n: len(encode_output(echo_output(decode_step_input(n)))) for n in sizes}
    results = bench(sizes, args.iters, args.warmup, not args.no_executor, not args.no_raw,
                    with_ray=getattr(args, "ray", False))
    base = "ring" if "ring" in results else "pipe"
    speedup = {n: round(results["queue"][n]["median_us"] / results[base][n]["median_us"], 1) for n in sizes}
    if args.json:
        print(json.dumps({"iters": args.iters, "step_bytes": step_bytes, "reply_bytes": reply_bytes,
                          "results": results, "queue_over_ring_median": speedup,
                          "ratio_base": base}, indent=2))
        return 0
    modes = list(results)
    print(f"round trip of a decode step, {args.iters} iterations (median / p99 in µs)")
    header = f"{'seqs':>5} {'bytes':>11} " + " ".join(f"{m:>17}" for m in modes) + f" {'queue/' + base:>11}"
    print(header)
    for n in sizes:
        cells = " ".join(f"{results[m][n]['median_us']:>8.1f} /{results[m][n]['p99_us']:>7.1f}" for m in modes)
        print(f"{n:>5} {step_bytes[n]:>5}/{reply_bytes[n]:<5} {cells} {speedup[n]:>10.1f}x")
    return 0
