"""Ray executor (``--distributed-executor-backend ray``): the ranks are Ray actors in a placement group.

Placement (gpu/ray_cluster.py): one bundle per rank, PACK or SPREAD (``--ray-placement-strategy``),
on the cluster ``ray.init`` finds or on a local instance started on demand. torch.distributed
meets at an address the driver asks rank 0's actor for (its node, a free port).

Steps travel one of two ways, with the same messages (contracts/messages.py) and the same rank
behaviour (gpu/worker.py):

- ``shm``: every actor on the driver's node. The mp executor's shared-memory ring (pipes on
  CPUs without x86 ordering), its fds handed over a Unix socket (gpu/fd_handoff.py). This is
  ``MultiprocExecutor`` itself with actors in place of spawned processes: the same reply
  matching, step timeout and death handling, each actor's process watched through a pidfd,
  and with pipeline stages the same ``submit``/``collect`` of up to pp steps in flight.
- ``ray``: an actor call per rank and step (gpu/ray_call_executor.py); works across nodes.

Pipeline stages (``--pipeline-parallel-size``) work on both: world = tp x pp actors, rank =
stage x tp + tp rank, the activations going stage to stage with torch.distributed send/recv
between the actors (gpu/pipeline.py), as between the mp executor's processes.

``PAGEDSERVE_RAY_TRANSPORT=shm|ray`` forces one (``shm`` needs every actor on this node); the
default is ``shm`` when every actor landed here, else ``ray``. Shutdown (or a failure) kills
the actors and removes the placement group; a Ray instance started here is stopped by the last
executor using it.
"""
from __future__ import annotations

import logging
import os
import select
import time
import weakref

from pagedserve.contracts.config import EngineConfig
from pagedserve.contracts.errors import ExecutorError
from pagedserve.contracts.log_format import current_format
from pagedserve.gpu.mp_executor import RING_SLOT_SIZE, RING_SLOTS, MultiprocExecutor
from pagedserve.gpu.ray_cluster import PlacedWorkers, import_ray
from pagedserve.gpu.ring_errors import RingError
from pagedserve.gpu.transport import create_channel
from pagedserve.gpu.worker import SHUTDOWN_MESSAGE, output_rank
from pagedserve.gpu.worker_group import WorkerGroup

logger = logging.getLogger(__name__)



def start_ranks(placed: PlacedWorkers, config: EngineConfig, runner_factory: str | None,
                num_threads: int | None, timeout: float) -> int:
    """Run every actor's ``start`` (they meet in torch.distributed) and return the KV block count."""
    ray = import_ray()
    from ray.exceptions import RayActorError, RayTaskError

    world = len(placed.actors)
    init_method = None
    if world > 1:
        init_method = ray.get(placed.actors[0].rendezvous_address.remote(placed.all_local), timeout=60)
    level = logging.getLogger().getEffectiveLevel()
    refs = [a.start.remote(config, rank, world, init_method, runner_factory, level, num_threads, current_format())
            for rank, a in enumerate(placed.actors)]
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    blocks: dict[int, int] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left))
        if not ready:
            raise ExecutorError(
                f"worker(s) {sorted(rank_of[r] for r in pending)} did not report ready within "
                f"{timeout:.0f} s; raise PAGEDSERVE_WORKER_STARTUP_TIMEOUT if the model is slow to load")
        rank = rank_of[ready[0]]
        try:
            blocks[rank] = int(ray.get(ready[0]))
        except RayTaskError as e:
            raise ExecutorError(f"worker {rank} failed to start:\n{e}") from None
        except RayActorError as e:
            raise ExecutorError(f"worker {rank} (Ray actor) died while starting: {e}") from None
    if len(set(blocks.values())) > 1:
        logger.warning("ranks allocated different KV block counts %s; using the smallest", blocks)
    return min(blocks.values())


class ActorProcess:
    """A local actor's process as the mp executor watches a worker: pid and a sentinel (pidfd)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)

    def gone(self, timeout: float = 0.0) -> bool:
        if self.sentinel < 0:
            return True
        return bool(select.select([self.sentinel], [], [], timeout)[0])

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class RayRingGroup(WorkerGroup):
    """The mp executor's WorkerGroup for actors: stop message, wait, kill actors, drop the group."""

    def __init__(self, placed: PlacedWorkers):
        super().__init__()
        self.placed = placed

    def _close(self, graceful: bool, join_timeout: float) -> None:
        ray = import_ray()
        alive = [p for p in self.procs if not p.gone()]
        if self.step_ring is not None and alive and graceful:
            try:
                self.step_ring.send(SHUTDOWN_MESSAGE, timeout=0.5)
                # Let the ranks leave their serve loop and process group before the kill.
                ray.get([a.wait_stopped.remote(join_timeout) for a in self.placed.actors],
                        timeout=join_timeout + 1)
            except Exception:  # RingError, a dead actor, a timeout: the kill below settles it
                pass
        if self.step_ring is not None:
            self.step_ring.mark_closed()
        self.placed.release()
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.gone(max(0.0, deadline - time.monotonic()))
            p.close()
        for ring in (self.step_ring, self.reply_ring):
            if ring is not None:
                try:
                    ring.close()
                except RingError:
                    pass
        logger.debug("Ray executor resources released")


class RayRingExecutor(MultiprocExecutor):
    """MultiprocExecutor whose ranks are Ray actors on this node (see the module docstring)."""

    def __init__(self, config: EngineConfig, placed: PlacedWorkers, **kwargs):
        self._placed = placed
        super().__init__(config, **kwargs)

    def _start(self, runner_factory: str | None, timeout: float, num_threads: int | None) -> None:
        from pagedserve.gpu.fd_handoff import FdServer, split_spec

        ray = import_ray()
        placed = self._placed
        res = self._res = RayRingGroup(placed)
        res.procs = [ActorProcess(pid) for pid in placed.pids]
        kind = self.config.parallel.step_transport
        res.step_ring = create_channel(self.world_size, RING_SLOTS, RING_SLOT_SIZE, role="writer", kind=kind)
        res.reply_ring = create_channel(1, RING_SLOTS, RING_SLOT_SIZE, role=0, kind=kind)
        self._finalizer = weakref.finalize(self, res.close)
        self._sentinels = [p.sentinel for p in res.procs]
        res.step_ring.peer_fds = list(self._sentinels)
        res.reply_ring.peer_fds = list(self._sentinels)
        t0 = time.monotonic()
        self.num_blocks = start_ranks(placed, self.config, runner_factory, num_threads, timeout)
        step_skeleton, step_fds = split_spec(res.step_ring.spec)
        reply_skeleton, reply_fds = split_spec(res.reply_ring.spec)
        # the actors' pids: their fds are theirs even when Ray runs as another user
        with FdServer(step_fds + reply_fds, allowed_pids=placed.pids) as server:
            answering = output_rank(self.config)  # rank 0, or the last stage's first rank
            refs = [a.attach_channels.remote(server.address, server.token, step_skeleton, len(step_fds),
                                             reply_skeleton if rank == answering else None,
                                             len(reply_fds), os.getpid())
                    for rank, a in enumerate(placed.actors)]
            server.serve(len(refs), timeout=60)
        ray.get(refs, timeout=60)
        logger.info("%d Ray worker(s) ready in %.1f s, %d KV blocks each", self.world_size,
                    time.monotonic() - t0, self.num_blocks)

    def _dead_message(self) -> str | None:
        for rank, proc in enumerate(self._res.procs):
            if proc.gone():
                return (f"worker {rank} (Ray actor, pid {proc.pid}) exited (its log, forwarded by "
                        "Ray, says why); in-flight requests cannot finish")
        return None

    def shutdown(self) -> None:
        try:
            super().shutdown()
            if self._reaper is not None:
                self._reaper.join()
        finally:
            self._placed.release()
            self._placed.leave_ray()

