"""The Ray actor behind one rank: the same runner and start-up as a worker process (gpu/worker.py).

Made a Ray actor by gpu/ray_cluster.py (``ray.remote(RayWorker)``), so this module never imports
Ray itself and loads anywhere. One actor per rank, in its placement-group bundle.

Start-up: ``start`` joins torch.distributed (gloo on CPU, NCCL on CUDA) at the rendezvous
address the driver chose, builds the runner and returns its KV block count; an exception there
reaches the driver with its traceback (Ray wraps it).

Steps come one of two ways, chosen by the driver (gpu/ray_executor.py):
- ``attach_channels``: the shared-memory ring (or pipes) of the mp executor, when the actor runs
  on the driver's node. The channel fds come over a Unix socket (gpu/fd_handoff.py) and a thread
  of the actor runs gpu/worker.py's serve loop. A fatal error there ends the actor's process, as
  it ends a worker process: the driver sees it through the process's pidfd.
- ``execute``: one Ray actor call per step carrying the encoded StepInput (any node), and with
  pipeline stages the sampled tokens to apply first; the output rank (rank 0, or the first rank
  of the last stage) returns the encoded StepOutput, the other ranks None.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import traceback

from pagedserve.contracts.config import EngineConfig
from pagedserve.gpu.ring_errors import RingClosed, RingPeerDied
from pagedserve.gpu.worker import (DEFAULT_RUNNER, PIPELINE_RUNNER, WorkerArgs, serve_steps, setup_torch, teardown_torch,
                        handle_message, load_factory, output_rank)

logger = logging.getLogger(__name__)


def node_ip() -> str:
    """This host's address as other nodes reach it (the route to a public address, no traffic)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def pid_space() -> str:
    """Which pids this process can see: the kernel boot and the pid namespace. Two processes with
    the same value share pid numbers (one machine, one container), whatever their Ray node."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:  # not Linux: only the driver's own node counts
        return f"unknown-{os.getpid()}"


class RayWorker:
    def __init__(self):
        self.args: WorkerArgs | None = None
        self.runner = None
        self._serve_thread: threading.Thread | None = None
        self._channels: list = []

    # ---------------------------------------------------------------- placement

    def where(self) -> tuple[str, int, str]:
        """(Ray node id, pid, pid space): the driver uses the ring only with actors on its own
        node, and waits at release for the exit of those whose pids it can see."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid(), pid_space()

    def rendezvous_address(self, local: bool) -> str:
        """A free TCP port on this node, for torch.distributed's rendezvous (asked of rank 0)."""
        host = "127.0.0.1" if local else node_ip()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    # ---------------------------------------------------------------- start-up

    def start(self, config: EngineConfig, rank: int, world_size: int, init_method: str | None,
              runner_factory: str | None, log_level: int, num_threads: int | None, log_format: str = "text") -> int:
        from pagedserve.contracts.log_format import configure_logging

        configure_logging(log_level, log_format, process=f"ray worker {rank}")
        import ray

        # An actor Ray gave a GPU sees only that one (CUDA_VISIBLE_DEVICES): it uses device 0.
        self.args = WorkerArgs(config, rank, world_size, None, None, None, init_method, runner_factory,
                               log_level, num_threads, own_gpu=bool(ray.get_gpu_ids()), log_format=log_format)
        if runner_factory is None or world_size > 1:
            setup_torch(self.args)
        default = PIPELINE_RUNNER if config.parallel.pipeline_parallel_size > 1 else DEFAULT_RUNNER
        factory = load_factory(runner_factory or default)
        self.runner = factory(config, rank)
        return int(self.runner.initialize())

    # ---------------------------------------------------------------- ring transport

    def attach_channels(self, fd_address: str, token: bytes, step_skeleton: tuple, step_fd_count: int,
                        reply_skeleton: tuple | None, reply_fd_count: int, driver_pid: int) -> None:
        """Attach the step channel (and, rank 0, the reply channel) and serve it on a thread."""
        from pagedserve.gpu.fd_handoff import rebuild_spec, receive_fds
        from pagedserve.gpu.transport import attach_channel

        fds = receive_fds(fd_address, token, step_fd_count + reply_fd_count)
        driver = [os.pidfd_open(driver_pid)]  # the engine's process: readable once it is gone
        step = attach_channel(rebuild_spec(step_skeleton, fds[:step_fd_count]), self.args.rank,
                              peer_fds=driver)
        self._channels.append(step)
        reply = None
        if reply_skeleton is not None:  # the output rank
            reply = attach_channel(rebuild_spec(reply_skeleton, fds[step_fd_count:]), "writer",
                                   peer_fds=driver)
            self._channels.append(reply)
        else:  # every rank gets every fd: the reply channel's are not this one's
            for fd in fds[step_fd_count:]:
                os.close(fd)
        self._serve_thread = threading.Thread(target=self._serve_channels, args=(step, reply, driver[0]),
                                              name="pagedserve-ray-serve", daemon=True)
        self._serve_thread.start()

    def _serve_channels(self, step, reply, driver_fd: int) -> None:
        try:
            serve_steps(self.args, self.runner, step, reply, None)
        except (RingPeerDied, RingClosed) as e:
            logger.info("stopping: %s", e)
        except BaseException:
            # As a worker process does: the peers are stuck in a collective, the group must be
            # torn down. Ending the process is what the driver watches (its pidfd).
            logger.error("worker %d failed:\n%s", self.args.rank, traceback.format_exc())
            os._exit(1)
        finally:
            teardown_torch(self.args)
            for channel in self._channels:
                channel.close()
            os.close(driver_fd)

    def wait_stopped(self, timeout: float) -> bool:
        """After the shutdown message: True once the serve thread has left (process group gone)."""
        if self._serve_thread is not None:
            self._serve_thread.join(timeout)
            return not self._serve_thread.is_alive()
        return True

    # ---------------------------------------------------------------- Ray-call transport

    def execute(self, msg: bytes, sampled: bytes | None = None) -> bytes | None:
        """One step from an actor call, after the sampled tokens of pipeline stages (if any): the
        output rank returns the encoded StepOutput, the others None. An error on a rank that does
        not answer raises (the group cannot go on)."""
        answers = self.args.rank == output_rank(self.args.config)
        if sampled is not None:
            handle_message(self.runner, sampled, answers)
        return handle_message(self.runner, msg, answers)

    def stop(self) -> None:
        """Leave the process group before the actor is killed (Ray-call transport)."""
        if self.args is not None:
            teardown_torch(self.args)

    def ping(self) -> bool:
        return True
