"""The worker process: one per rank (tensor x pipeline), started with ``spawn`` by MultiprocExecutor.

Start-up: attach the rings, set torch threads, (tp > 1) join the gloo/NCCL group and set the
tensor-parallel state, build the model runner and report ``("ready", num_blocks, num_swap_blocks)`` or
``("error", traceback text)`` over the ready pipe. Then loop: read a message from the step ring
(every rank reads every step), execute it, and the output rank (rank 0; with pipeline stages the
first rank of the last stage, gpu/pipeline.py) writes the StepOutput to the reply ring.

Failures: a step that raises on rank 0 becomes ``StepOutput(error=...)`` and the worker keeps
serving; on another rank the traceback goes over the ready pipe and the worker exits, since its
peers are now stuck in a collective and the executor must tear the group down. A parent that
dies is noticed through its sentinel while waiting for the next step, and the worker exits.
SIGINT is ignored: Ctrl-C reaches the whole process group, and the parent shuts workers down.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from pagedserve.contracts import env
from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.cpu_threads import openmp_defaults, usable_cpus
from pagedserve.contracts.log_format import configure_logging
from pagedserve.contracts.messages import STEP_INPUT_DECODER, STEP_INPUT_ENCODER, StepEncodeError, StepInput, StepOutput
from pagedserve.gpu.heap_trim import HeapTrimmer
from pagedserve.gpu.pipeline_tokens import TAG_SAMPLED, decode_sampled_tokens
from pagedserve.gpu.ring_errors import RingTimeout
from pagedserve.gpu.shm_ring import RingClosed, RingPeerDied, RingSpec, ShmRing
from pagedserve.gpu.transport import attach_channel

logger = logging.getLogger(__name__)

# First byte of every message on the step ring.
TAG_STEP = ord("S")
TAG_SHUTDOWN = ord("Q")
SHUTDOWN_MESSAGE = bytes([TAG_SHUTDOWN])

DEFAULT_RUNNER = "pagedserve.gpu.model_runner:ModelRunner"
PIPELINE_RUNNER = "pagedserve.gpu.pipeline:PipelineModelRunner"


def encode_step(step: StepInput) -> bytearray:
    """Tag byte + msgpack, encoded in place (no intermediate copy). StepEncodeError when a value
    does not fit msgpack (nothing is sent then)."""
    buf = bytearray(b"S")
    try:
        STEP_INPUT_ENCODER.encode_into(step, buf, 1)
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        raise StepEncodeError(f"step {step.step_id} cannot be encoded for the workers: {e}") from e
    return buf


def decode_step(msg) -> StepInput:
    return STEP_INPUT_DECODER.decode(memoryview(msg)[1:])


def encode_output(out: StepOutput) -> bytes:
    return STEP_INPUT_ENCODER.encode(out)


@dataclass(slots=True)
class WorkerArgs:
    config: EngineConfig
    rank: int
    world_size: int
    step_ring: RingSpec
    reply_ring: RingSpec  # only the output rank writes it
    ready_conn: Connection  # worker -> executor: ("ready", num_blocks) | ("error", text)
    dist_init_method: str | None = None  # tcp://127.0.0.1:PORT when world_size > 1
    runner_factory: str | None = None  # "module:callable" taking (config, rank); None = ModelRunner
    log_level: int = logging.INFO
    num_threads: int | None = None  # torch intra-op threads; None = this rank's share of the CPUs
    # The process sees only its own GPU (a Ray actor: Ray sets CUDA_VISIBLE_DEVICES), so it uses
    # device 0; else every rank of this replica sees them all and picks its own (gpu/device.py).
    own_gpu: bool = False
    log_format: str = "text"  # `serve --log-format` (contracts/log_format.py)

    @property
    def output_rank(self) -> int:
        return output_rank(self.config)


def output_rank(config: EngineConfig) -> int:
    """The rank that answers on the reply ring: the first rank of the last pipeline stage."""
    p = config.parallel
    return (p.pipeline_parallel_size - 1) * p.tensor_parallel_size


def load_factory(spec: str):
    """Resolve ``"package.module:attr"`` to the callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"runner factory {spec!r} must look like 'package.module:callable'")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _threads_for_rank(world_size: int, requested: int | None) -> int:
    """The caller's count (--worker-threads), else $PAGEDSERVE_WORKER_THREADS, else a share of the
    CPUs this process may use: its affinity mask capped by its cgroup CPU quota (contracts/cpu_threads.py)."""
    if requested:
        return requested
    override = env.WORKER_THREADS.get()
    if override:
        return override
    return max(1, usable_cpus() // world_size)


def setup_torch(args: WorkerArgs) -> None:
    """A rank's torch threads and process groups (a spawned worker and a Ray actor alike)."""
    import torch

    threads = _threads_for_rank(args.world_size, args.num_threads or args.config.parallel.worker_threads)
    torch.set_num_threads(threads)
    logger.debug("rank %d uses %d torch threads", args.rank, threads)
    from pagedserve.gpu.device import resolve_device, select_cuda_device

    use_cuda = resolve_device(args.config.parallel.device).type == "cuda"
    if use_cuda:  # every rank (one alone too), before anything touches the GPU: not all on cuda:0
        if args.own_gpu:
            index = select_cuda_device(0, 1, 0)
        else:
            index = select_cuda_device(args.rank, args.world_size, args.config.parallel.data_parallel_rank)
        logger.info("rank %d uses cuda:%d", args.rank, index)
    if args.world_size > 1:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=args.dist_init_method,
                                rank=args.rank, world_size=args.world_size,
                                timeout=datetime.timedelta(seconds=120))
        _init_groups(args)


def _init_groups(args: WorkerArgs) -> None:
    """Tensor-parallel groups (one per stage: consecutive ranks) and this rank's stage peers.
    Every rank creates every group, in the same order, as torch.distributed requires."""
    import torch.distributed as dist

    from pagedserve.gpu.parallel_state import init_pipeline_parallel, init_tensor_parallel

    tp = args.config.parallel.tensor_parallel_size
    pp = args.config.parallel.pipeline_parallel_size
    if pp == 1:
        init_tensor_parallel(args.rank, args.world_size, dist.group.WORLD)
        return
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if tp > 1 else None for s in range(pp)]
    stage, tp_rank = divmod(args.rank, tp)
    init_tensor_parallel(tp_rank, tp, groups[stage])
    init_pipeline_parallel(stage, pp, args.rank - tp if stage > 0 else None,
                           args.rank + tp if stage < pp - 1 else None)


def teardown_torch(args: WorkerArgs) -> None:
    """Leave the process groups ``setup_torch`` joined."""
    if args.world_size > 1 and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # best effort on the way out
                pass


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a spawned worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    openmp_defaults()  # inherited from the parent as a rule; before this process loads torch's libgomp
    configure_logging(args.log_level, args.log_format, process=f"worker {args.rank}")
    parent = multiprocessing.parent_process()
    parent_fds = [parent.sentinel] if parent is not None and parent.sentinel is not None else []
    conn = args.ready_conn
    try:
        step_ring = attach_channel(args.step_ring, args.rank, peer_fds=parent_fds)
        reply_ring = (attach_channel(args.reply_ring, "writer", peer_fds=parent_fds)
                      if args.rank == args.output_rank else None)
        if args.runner_factory is None or args.world_size > 1:
            setup_torch(args)
        default = PIPELINE_RUNNER if args.config.parallel.pipeline_parallel_size > 1 else DEFAULT_RUNNER
        factory = load_factory(args.runner_factory or default)
        runner = factory(args.config, args.rank)
        num_blocks = runner.initialize()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        teardown_torch(args)
        sys.exit(1)
    # optional: a runner factory's runner (echo, test runners) need not keep a host swap pool
    conn.send(("ready", int(num_blocks), int(getattr(runner, "num_swap_blocks", 0))))
    code = 0
    try:
        serve_steps(args, runner, step_ring, reply_ring, conn)
    except (RingPeerDied, RingClosed) as e:
        logger.info("stopping: %s", e)
    except BaseException:
        code = 1
        text = traceback.format_exc()
        logger.error("worker %d failed:\n%s", args.rank, text)
        try:
            conn.send(("error", text))
        except OSError:
            pass
    finally:
        teardown_torch(args)
        step_ring.close()
        if reply_ring is not None:
            reply_ring.close()
        conn.close()
    sys.exit(code)


# No step for this long after some ran: the worker is idle, its heap is trimmed once.
IDLE_TRIM_S = 0.5


def serve_steps(args: WorkerArgs, runner, step_ring: ShmRing, reply_ring: ShmRing | None, conn) -> None:
    """Run the steps arriving on ``step_ring`` until the shutdown message; the answering rank
    (``reply_ring`` given) sends each reply back."""
    heap = HeapTrimmer()  # this process's C heap: free pages back after steps, and when idle
    while True:
        try:
            msg = step_ring.recv(timeout=IDLE_TRIM_S if heap.dirty else None)
        except RingTimeout:
            heap.trim_if_dirty()
            continue
        if msg[0] == TAG_SHUTDOWN:
            logger.debug("rank %d: shutdown message", args.rank)
            return
        payload = handle_message(runner, msg, answers=reply_ring is not None)
        if payload is not None:
            reply_ring.send(payload)
        heap.after_step()


def handle_message(runner, msg, answers: bool) -> bytes | None:
    """One step-ring message on one rank (the ring's serve loop and the Ray actor call share it).

    Sampled tokens (pipeline stages) are applied and give None. A step runs; the answering rank
    (``answers``: the output rank) returns its encoded StepOutput, with a failure inside as the
    reply's error; on any other rank a failure raises (its peers are stuck in a collective, the
    executor must tear the group down) and success returns None."""
    tag = msg[0]
    if tag == TAG_SAMPLED:
        runner.accept_sampled(*decode_sampled_tokens(msg))
        return None
    if tag != TAG_STEP:
        raise RuntimeError(f"unknown message tag {tag!r} on the step ring")
    step_id = -1
    try:
        step = decode_step(msg)
        step_id = step.step_id
        out = runner.execute(step)
    except Exception:
        if not answers:
            raise
        text = traceback.format_exc()
        logger.error("step %d failed:\n%s", step_id, text)
        out = StepOutput(step_id, error=text)
    if not answers:
        return None
    try:
        return encode_output(out)
    except (msgspec.EncodeError, TypeError, OverflowError) as e:
        return encode_output(StepOutput(step_id, error=f"cannot encode StepOutput: {e}"))
