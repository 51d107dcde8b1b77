"""Engine workers as Ray actors, for fleets across machines (`python -m cluster.serve --launcher ray`).

Each worker is one actor that asks Ray for one GPU (or, for emulated and CPU engines, a share of a CPU), so Ray places
it on any machine with one free. The actor builds its engine and serves the cluster protocol (`cluster.worker.Worker`)
on its own event loop, on the interface given or its machine's address, and answers that address; the router connects
to it over TCP as to a local worker. In the actor's process rather than a subprocess it owns: one process per worker
(process start and imports once, which is what a cold start and a 2-core test machine pay for), the GPU Ray counts is
held by the process Ray knows, and the worker ends with its actor, with nothing left behind to reap. What the actor
shares with the engine is Ray's core-worker threads, which are native code and idle between calls.

A worker's end is heard here from Ray (its actor, or the actor's machine, died) and passed to `on_exit`, so the
service handles it whether the socket or Ray tells first. Each worker's resources are reserved first, as a placement
group of one bundle that its actor then runs in: a reservation Ray cannot make within `placement_timeout_s` (no
machine has the resources free) is removed and the start raises `PlacementError`, on which the service stops asking
for a while; the actor's process start, imports and weights count against `ready_timeout_s` only.

Ray lowers its worker processes' priority (niceness 15) by default, so that its own daemons stay responsive. An engine
worker is the latency-critical process on its machine: at niceness 15 any other busy process there starves its step
loop (and its start: importing torch then takes a minute where it takes seconds). `connect_ray` starts local Ray
clusters with workers at normal priority; a cluster started with `ray start` needs `RAY_worker_niceness=0` in the
environment of each node's `ray start` (deploy/ray-cluster.yaml does this).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Collection

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.launcher import Launcher, LaunchError, PlacementError
from cluster.worker import Worker
from engine.config import EngineConfig
from engine.llm import build_engine
from engine.serving import freeze_startup_heap

log = logging.getLogger(__name__)

# An emulated engine sleeps through its steps: four share a core. A CPU model engine wants a core of its own.
EMULATED_WORKER_CPUS = 0.25
CPU_WORKER_CPUS = 1.0
GPU_WORKER_CPUS = 1.0  # host work of a GPU engine: batch building, sampling, detokenizing
RAY_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU"}  # an actor's option -> a placement bundle's key


def connect_ray(address: str | None = None, **init_args) -> None:
    """`ray.init`, with the workers of a Ray cluster it starts here at normal priority (see the module's doc); on
    connecting to a running cluster, that cluster's setting holds."""
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=address, **init_args)


def worker_resources(config: EngineConfig, num_cpus: float | None = None) -> dict[str, float]:
    """What one worker's actor asks Ray for: a GPU for a model on CUDA, else CPU only. `num_cpus` overrides the
    CPU share."""
    if num_cpus is not None and not num_cpus > 0:
        raise ValueError(f"num_cpus must be positive, got {num_cpus}")
    if config.executor == "model" and config.device.startswith("cuda"):
        return {"num_gpus": 1, "num_cpus": GPU_WORKER_CPUS if num_cpus is None else num_cpus}
    default = EMULATED_WORKER_CPUS if config.executor == "emulated" else CPU_WORKER_CPUS
    return {"num_cpus": default if num_cpus is None else num_cpus}


class WorkerActor:
    """One engine worker on the machine Ray placed this actor on (made a Ray actor class by RayLauncher)."""

    def __init__(self, config: EngineConfig, heartbeat_s: float | None, token: str, host: str | None):
        self.config, self.heartbeat_s, self.token = config, heartbeat_s, token
        self.host = host or ray.util.get_node_ip_address()
        self.worker: Worker | None = None

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def start(self, instance_id: str) -> tuple[str, int]:
        """Builds the engine (off the event loop: weights load for a while) and listens; returns the address."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        engine = await asyncio.to_thread(build_engine, self.config, instance_id=instance_id)
        beat = {} if self.heartbeat_s is None else {"heartbeat_s": self.heartbeat_s}
        self.worker = Worker(engine, instance_id=instance_id, token=self.token, **beat)
        port = await self.worker.start(self.host, 0)
        freeze_startup_heap()
        return self.host, port

    async def wait_exit(self) -> int:
        """Returns 0 once the worker has stopped (drained)."""
        await self.worker.done.wait()
        return 0

    async def stop(self, timeout_s: float) -> int:
        """Waits for the (drained) worker to stop; past the timeout stops it: 1."""
        try:
            await asyncio.wait_for(self.worker.done.wait(), timeout_s)
            return 0
        except asyncio.TimeoutError:
            await self.worker.stop()
            return 1


class RayLauncher(Launcher):
    def __init__(self, config: EngineConfig, *, heartbeat_s: float | None = None, warm_spares: int = 0,
                 token: str | None = None, host: str | None = None, num_cpus: float | None = None,
                 placement_timeout_s: float = 30.0, ready_timeout_s: float = 300.0, prefill_instances: int = 0):
        """Workers built from `config` (with `prefill_instances`, its role set per worker: see cluster/launcher.py),
        on the Ray cluster this process is connected to (`ray.init` first).
        `host`: the interface each worker listens on (None: its machine's address as Ray knows it). `num_cpus`:
        each worker's CPU share (None: `worker_resources`' default). `placement_timeout_s`: how long Ray may take
        to find a machine with room for a worker before its start fails with PlacementError; with a Ray autoscaler
        that adds machines on demand, make it longer than a machine takes to join. `ready_timeout_s`: from
        placement to the worker listening (process, imports, weights)."""
        if not ray.is_initialized():
            raise RuntimeError("RayLauncher needs a Ray connection: call ray.init() first")
        if not (placement_timeout_s > 0 and ready_timeout_s > 0):
            raise ValueError("placement_timeout_s and ready_timeout_s must be positive")
        super().__init__(token=token, warm_spares=warm_spares, prefill_instances=prefill_instances)
        self.config, self.heartbeat_s, self.host = config, heartbeat_s, host
        self.resources = worker_resources(config, num_cpus)
        self.placement_timeout_s, self.ready_timeout_s = placement_timeout_s, ready_timeout_s
        self._actor_class = ray.remote(WorkerActor)
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.groups: dict[str, PlacementGroup] = {}  # instance id -> the reservation its actor runs in
        # instance id -> how it ended: 0 stopped by itself (drained), 1 stopped past the timeout, None its actor died
        self.exit_codes: dict[str, int | None] = {}
        self._watchers: dict[str, asyncio.Task] = {}
        self._ending: set[str] = set()  # asked to stop or killed here: its end is expected, not news

    def alive(self, instance_id: str) -> bool:
        return instance_id in self.actors and instance_id not in self.exit_codes

    def _worker_ids(self) -> Collection[str]:
        return self.groups.keys()

    def _forget(self, instance_id: str) -> None:
        asyncio.get_running_loop().create_task(self.stop(instance_id, 5.0))

    async def start(self, instance_id: str) -> tuple[str, int]:
        if instance_id in self.groups:
            raise LaunchError(f"instance {instance_id!r} is already running")
        asked = time.monotonic()
        config = self._claim_role(instance_id, self.config)
        try:
            group = self.groups[instance_id] = placement_group([self._bundle()])
            # `wait` asks Ray's control store only (`ready` would run a task, which needs a process started)
            if not await asyncio.to_thread(group.wait, self.placement_timeout_s):
                raise PlacementError(f"Ray found no machine with {self._resource_text()} free for {instance_id} "
                                     f"within {self.placement_timeout_s:g} s")
            actor = self.actors[instance_id] = self._actor_class.options(
                max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group), **self.resources
            ).remote(config, self.heartbeat_s, self.token, self.host)
            address = await asyncio.wait_for(actor.start.remote(instance_id), self.ready_timeout_s)
        except BaseException as e:
            if instance_id in self.actors:
                ray.kill(self.actors[instance_id])
            self._drop(instance_id)
            if isinstance(e, RayError):
                raise LaunchError(f"worker {instance_id}: {str(e).splitlines()[0]}") from None
            if isinstance(e, asyncio.TimeoutError):
                raise LaunchError(f"worker {instance_id} was not ready within {self.ready_timeout_s:g} s") from None
            raise
        self.cold_starts.append(time.monotonic() - asked)
        self._watchers[instance_id] = asyncio.get_running_loop().create_task(self._watch(instance_id, actor))
        return address

    def _bundle(self) -> dict[str, float]:
        return {RAY_RESOURCE_NAMES[option]: amount for option, amount in self.resources.items()}

    def _resource_text(self) -> str:
        return " and ".join(f"{amount:g} {name}" for name, amount in self._bundle().items())

    async def _watch(self, instance_id: str, actor) -> None:
        try:
            self.exit_codes[instance_id] = await actor.wait_exit.remote()
            return  # drained and done
        except RayActorError as e:
            reason = f"Ray reports its actor dead ({str(e).splitlines()[0]})"
        self.exit_codes[instance_id] = None
        if instance_id in self._ending:
            return
        log.warning("worker %s ended: %s", instance_id, reason)
        if self.on_exit is not None:
            self.on_exit(instance_id, reason)

    def kill(self, instance_id: str) -> None:
        self.roles.pop(instance_id, None)
        actor = self.actors.get(instance_id)
        if actor is not None:
            self._ending.add(instance_id)
            ray.kill(actor)

    async def stop(self, instance_id: str, timeout_s: float = 30.0) -> int | None:
        actor = self.actors.get(instance_id)
        if actor is None:
            return self.exit_codes.get(instance_id)
        self._ending.add(instance_id)
        status = self.exit_codes.get(instance_id)
        try:
            status = await asyncio.wait_for(actor.stop.remote(timeout_s), timeout_s + 10.0)
        except (RayError, asyncio.TimeoutError):
            pass  # its actor is gone, or hangs: ending the actor ends its worker
        ray.kill(actor)
        self._drop(instance_id)
        self.exit_codes[instance_id] = status
        return status

    def _drop(self, instance_id: str) -> None:
        self.spares.pop(instance_id, None)
        self.roles.pop(instance_id, None)
        self.actors.pop(instance_id, None)
        group = self.groups.pop(instance_id, None)
        if group is not None:
            remove_placement_group(group)  # frees the reservation; kills its actor if that still runs
        self._ending.discard(instance_id)
        watcher = self._watchers.pop(instance_id, None)
        if watcher is not None:
            watcher.cancel()

    async def close(self) -> None:
        for instance_id in list(self.actors):
            self.kill(instance_id)
        await asyncio.gather(*(self.stop(instance_id, 5.0) for instance_id in list(self.actors)))
