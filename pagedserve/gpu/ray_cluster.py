"""Ray for the Ray executor: connect (or start a local instance), place one actor per rank in a
placement group, and release both. The only module besides gpu/ray_executor.py that imports Ray,
and only inside functions: pagedserve without the ``ray`` extra never needs it.

Which cluster: ``--ray-address`` (``ray_address``), else what ``ray.init`` finds by itself (the
``RAY_ADDRESS`` variable, then a cluster started with ``ray start`` on this machine), else a
local instance started here, which the executor stops again on shutdown. A process that already
called ``ray.init`` (tests, a notebook) keeps its instance.

A local instance started here is one node and listens on the loopback interface only (issue 37):
Ray binds its GCS, raylet, workers and agents to the node IP, on every interface by default, and
takes the loopback address as the node IP only where it thinks clusters are off
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, its switch for Windows and macOS). ``_loopback_node``
sets that for the start: the processes Ray spawns get 127.0.0.1 as their address. To span
machines, start Ray yourself (`ray start --head`) and pass --ray-address.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field

from pagedserve.contracts import env
from pagedserve.contracts.config import RAY_PLACEMENT_STRATEGIES, EngineConfig
from pagedserve.contracts.cpu_threads import openmp_settings
from pagedserve.contracts.errors import ExecutorError

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = RAY_PLACEMENT_STRATEGIES
# Object store of a local instance started on demand: steps are a few KiB, Ray's floor is 75 MiB.


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ExecutorError("the Ray executor needs Ray: pip install 'pagedserve[ray]'") from e
    return ray


# Executors of this process using the local instance it started (data-parallel replicas share
# one): the last one to shut down stops it.
_local_users = [0]
_users_lock = threading.Lock()


def connect(address: str | None, world_size: int = 1) -> bool:
    """Make sure this process is connected to Ray; True when it uses a local instance started here
    (then ``leave_local_ray`` must be called once, at shutdown). A local instance started here is
    sized to place ``world_size`` ranks (``local_num_cpus``)."""
    ray = import_ray()
    with _users_lock:
        if ray.is_initialized():
            if _local_users[0]:
                _local_users[0] += 1
                return True
            return False
        started = _connect(ray, address, world_size)
        if started:
            _local_users[0] = 1
        return started


def leave_local_ray() -> None:
    """One user fewer of the local instance; the last one stops it."""
    with _users_lock:
        _local_users[0] -= 1
        if _local_users[0] == 0:
            import_ray().shutdown()


def local_num_cpus(world_size: int) -> int:
    """Logical CPUs of a Ray instance started here: Ray's own count, or the world size when that
    is larger. Each rank asks for a bundle of one CPU; the instance hosts only this process's
    actors, so, as the mp executor does, more ranks than cores may share them (tp=3 on 2 cores)
    instead of waiting for CPUs that never come."""
    try:
        from ray._private.utils import get_num_cpus  # what ray.init would count (cgroup quotas too)

        cpus = int(get_num_cpus())
    except Exception:  # a Ray without it: the machine's count
        cpus = os.cpu_count() or 1
    return max(cpus, world_size)


def _connect(ray, address: str | None, world_size: int = 1) -> bool:
    kwargs = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.WARNING}
    started = False
    try:
        if address is not None:
            ray.init(address=address, **kwargs)
        else:
            try:  # RAY_ADDRESS, else a cluster started with `ray start` on this machine
                ray.init(address="auto", **kwargs)
            except ConnectionError:  # none: a local instance of our own, its object store bounded
                with _loopback_node():
                    ray.init(address="local", object_store_memory=env.RAY_OBJECT_STORE_BYTES.get(),
                             num_cpus=local_num_cpus(world_size), **kwargs)
                started = True
    except Exception as e:
        raise ExecutorError(f"cannot connect to Ray{f' at {address}' if address else ''}: {e}") from e
    logger.info("%s Ray (%s)", "started a local" if started else "connected to",
                ray.get_runtime_context().gcs_address)
    return started


_RAY_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_node():
    """While a local Ray starts: its node IP is 127.0.0.1, so every process it starts listens there
    only. Ray reads the switch from the environment (its children) and from ray_constants (this
    driver, already imported); both are restored afterwards."""
    from ray._private import ray_constants

    before_env = os.environ.get(_RAY_LOOPBACK_SWITCH)
    before_const = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_LOOPBACK_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_const
        if before_env is None:
            os.environ.pop(_RAY_LOOPBACK_SWITCH, None)
        else:
            os.environ[_RAY_LOOPBACK_SWITCH] = before_env


# How long release() waits for killed actors on this node to exit; it returns as soon as they
# have. 5 s was too short on a busy 2-core box (a full suite beside other work left an actor
# alive after shutdown); a killed process ends unless the machine is starved.
ACTOR_EXIT_WAIT_S = 30.0


@dataclass
class PlacedWorkers:
    """One actor per rank in a placement group; ``release`` kills them and removes the group."""

    pg: object
    actors: list
    nodes: list[str]  # Ray node id of each rank
    pids: list[int]  # process id of each rank (meaningful where its pid space is ours)
    driver_node: str
    started_ray: bool
    pid_spaces: list[str] = field(default_factory=list)  # pid_space() of each rank
    released: bool = False
    left_ray: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def all_local(self) -> bool:
        return all(n == self.driver_node for n in self.nodes)

    def release(self) -> None:
        """Kill the actors and remove the placement group. Idempotent; any thread."""
        with self._lock:
            if self.released:
                return
            self.released = True
        ray = import_ray()
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        try:
            remove_placement_group(self.pg)
        except Exception as e:
            logger.warning("could not remove the placement group: %s", e)
        self._wait_local_exits(ACTOR_EXIT_WAIT_S)

    def _wait_local_exits(self, timeout: float) -> None:
        """ray.kill returns before the process ends: wait for the actors whose pids mean something
        here to be gone: the driver's node, and other Ray nodes of this host and pid namespace
        (two raylets on one machine). Actors on other hosts are Ray's to reap."""
        from pagedserve.gpu.ray_worker import pid_space

        deadline = time.monotonic() + timeout
        here = pid_space()
        spaces = self.pid_spaces or [""] * len(self.pids)
        for node, pid, space in zip(self.nodes, self.pids, spaces):
            if node != self.driver_node and space != here:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone
                continue
            try:
                select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            finally:
                os.close(fd)

    def leave_ray(self) -> None:
        """After ``release``: stop the local Ray instance if this was its last user. Idempotent."""
        with self._lock:
            if self.started_ray and not self.left_ray:
                self.left_ray = True
                leave_local_ray()


def bundle_for(config: EngineConfig) -> dict[str, float]:
    device = config.parallel.device
    use_cuda = device.startswith("cuda")
    if device == "auto":
        ray = import_ray()
        use_cuda = ray.cluster_resources().get("GPU", 0) > 0
    return {"CPU": 1.0, "GPU": 1.0} if use_cuda else {"CPU": 1.0}


def place_workers(config: EngineConfig, world_size: int) -> PlacedWorkers:
    """Start Ray if needed, reserve one bundle per rank, start one RayWorker actor in each."""
    strategy = (config.parallel.ray_placement_strategy or "PACK").upper()
    if strategy not in PLACEMENT_STRATEGIES:
        raise ExecutorError(f"unknown Ray placement strategy {strategy!r}: use one of "
                            f"{', '.join(PLACEMENT_STRATEGIES)}")
    started = connect(config.parallel.ray_address, world_size)
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pagedserve.gpu.ray_worker import RayWorker

    bundle = bundle_for(config)
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy,
                         name=f"pagedserve-{os.getpid()}-{time.monotonic_ns()}")
    placed = PlacedWorkers(pg, [], [], [], ray.get_runtime_context().get_node_id(), started)
    placement_timeout = env.RAY_PLACEMENT_TIMEOUT.get()
    try:
        ready, _ = ray.wait([pg.ready()], timeout=placement_timeout)
        if not ready:
            raise ExecutorError(
                f"Ray could not place {world_size} worker(s) of {bundle} ({strategy}) within "
                f"{placement_timeout:g} s; the cluster has {ray.available_resources()} free "
                f"({env.RAY_PLACEMENT_TIMEOUT.name} sets the wait)")
        actor_cls = ray.remote(RayWorker)
        # the actors see the switches set here, and the OpenMP wait settings (contracts/cpu_threads.py)
        switches = {**env.forwarded(), **openmp_settings()}
        for rank in range(world_size):
            placed.actors.append(actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
                name=None, runtime_env={"env_vars": switches} if switches else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank)).remote())
        where = ray.get([a.where.remote() for a in placed.actors], timeout=placement_timeout)
        placed.nodes = [w[0] for w in where]
        placed.pids = [w[1] for w in where]
        placed.pid_spaces = [w[2] for w in where]
    except BaseException as e:
        placed.release()
        placed.leave_ray()
        if isinstance(e, ExecutorError):
            raise
        if isinstance(e, Exception):
            raise ExecutorError(f"starting the Ray workers failed: {e}") from e
        raise
    logger.info("placed %d Ray worker(s) (%s): rank -> node %s, pid %s", world_size, strategy,
                [n[:8] for n in placed.nodes], placed.pids)
    return placed
