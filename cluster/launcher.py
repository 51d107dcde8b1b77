"""Starts and stops engine workers: the `Launcher` interface the router service uses, and `LocalLauncher`, which runs
them on this machine as `python -m cluster.worker` subprocesses, one per GPU (its own CUDA_VISIBLE_DEVICES) or, for
emulated engines, as many as asked on a CPU box. `cluster.ray_launcher.RayLauncher` runs them as Ray actors across
machines. The service drains an instance before it asks for the stop; cold start (spawn to READY) is measured here,
spawn to Hello by the service.

Warm spares: workers started ahead of need, their engines built (model loaded, or emulated) and listening, that no
router has attached yet. A replacement or a new instance is then a connection away instead of a cold start (process,
imports, weights). They occupy devices like any worker: with GPUs, spares and workers together stay within them.

Every worker of a fleet holds the fleet's shared secret (`token`: given, else random per launcher), which the router
proves on connecting (cluster/protocol.py).

Prefill/decode disaggregation (`prefill_instances` > 0): a worker starts with role prefill while fewer than that many
prefill workers are held, else with role decode. `prefill_instances` is the prefill count wanted: the service sets it
from the autoscaler's plan before the starts it asks for (its prefill starts first), so that the prefill pool follows
its token rate; left alone, the count stays fixed and a dead prefill worker's replacement is a prefill worker. Spares
are decode workers: a missing prefill worker is filled by a cold start, as `take_spare` gives no spare while one is
missing."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable, Collection, Sequence

from cluster.protocol import TOKEN_ENV
from engine.config import EngineConfig

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


class LaunchError(RuntimeError):
    """A worker did not come up."""


class PlacementError(LaunchError):
    """No machine has room for another worker now (every GPU holds one): asking again at once would find none."""


class Launcher(ABC):
    """Where engine workers run. `start` brings one up and returns the address it listens on; the service connects
    to it there. Warm spares are kept here; `on_exit`, set by the service, hears of a worker that this launcher
    finds gone (its connection may not know yet)."""

    def __init__(self, *, token: str | None, warm_spares: int, prefill_instances: int = 0):
        if warm_spares < 0:
            raise ValueError(f"warm_spares must be non-negative, got {warm_spares}")
        if prefill_instances < 0:
            raise ValueError(f"prefill_instances must be non-negative, got {prefill_instances}")
        self.token = token or secrets.token_hex(32)
        self.warm_spares = warm_spares
        self.prefill_instances = prefill_instances
        self.roles: dict[str, str] = {}  # instance id -> the engine role it was started with, while it counts
        self.spares: dict[str, tuple[str, int] | None] = {}  # instance id -> its address once ready, oldest first
        self.cold_starts: list[float] = []  # seconds from asking for a worker to its READY, every successful start
        self.on_exit: Callable[[str, str], None] | None = None  # (instance id, why)

    @property
    def capacity(self) -> int | None:
        """How many workers can run at once; None: no bound known here."""
        return None

    @abstractmethod
    async def start(self, instance_id: str) -> tuple[str, int]:
        """Brings a worker up; returns (host, port) once it listens. LaunchError (PlacementError: no room) if not."""

    def holds(self, instance_id: str) -> bool:
        """Whether a worker of that id is starting, running, or ended and not yet stopped here."""
        return instance_id in self._worker_ids()

    @abstractmethod
    def alive(self, instance_id: str) -> bool:
        """Whether a worker of that id is starting or running."""

    @abstractmethod
    def kill(self, instance_id: str) -> None:
        """Ends a worker that died or hangs, at once; `stop` collects it."""

    @abstractmethod
    async def stop(self, instance_id: str, timeout_s: float = 30.0) -> int | None:
        """Waits for a (drained) worker to end, forcing it past the timeout; its exit status where known."""

    @abstractmethod
    async def close(self) -> None:
        """Ends every worker."""

    @abstractmethod
    def _worker_ids(self) -> Collection[str]:
        """Every worker held, spares included."""

    @abstractmethod
    def _forget(self, instance_id: str) -> None:
        """Collects an ended spare's remains."""

    def num_spares_short(self) -> int:
        """Spares to start now: those missing (counting the ones starting), within the capacity no worker holds."""
        self._drop_ended_spares()
        short = self.warm_spares - len(self.spares)
        if self.capacity is not None:
            short = min(short, self.capacity - len(set(self._worker_ids()) | self.spares.keys()))
        return max(0, short)

    def start_spare(self, instance_id: str) -> Awaitable[None]:
        """Counts a new spare at once and returns what starts it, to await (LaunchError if it does not come up)."""
        self.spares[instance_id] = None
        return self._start_spare(instance_id)

    async def _start_spare(self, instance_id: str) -> None:
        try:
            address = await self.start(instance_id)
        except BaseException:
            self.spares.pop(instance_id, None)
            raise
        if instance_id in self.spares:
            self.spares[instance_id] = address

    def take_spare(self) -> tuple[str, tuple[str, int]] | None:
        """The oldest ready spare, no longer a spare: (its instance id, its address); None if none is ready, or if a
        prefill worker is missing (spares are decode workers: the next `start` makes a prefill one)."""
        self._drop_ended_spares()
        if self.num_prefill_short():
            return None
        for instance_id, address in self.spares.items():
            if address is not None:
                del self.spares[instance_id]
                return instance_id, address
        return None

    def num_prefill_held(self) -> int:
        """Prefill workers starting, running, or ended and not yet stopped here."""
        return sum(1 for role in self.roles.values() if role == "prefill")

    def num_prefill_short(self) -> int:
        """Prefill workers missing from the `prefill_instances` asked for (those starting count as there)."""
        return max(0, self.prefill_instances - self.num_prefill_held())

    def _claim_role(self, instance_id: str, config: EngineConfig) -> EngineConfig:
        """`config` with the role of the worker about to start (recorded before any await, so that workers started
        together divide the roles): unchanged without disaggregation; else prefill while one is missing, decode for
        the rest and for every spare."""
        if not self.prefill_instances:
            return config
        role = "prefill" if instance_id not in self.spares and self.num_prefill_short() else "decode"
        self.roles[instance_id] = role
        return replace(config, role=role)

    def _drop_ended_spares(self) -> None:
        for instance_id, address in list(self.spares.items()):
            if address is not None and not self.alive(instance_id):
                log.warning("spare %s ended before it was used", instance_id)
                del self.spares[instance_id]
                self._forget(instance_id)


@dataclass(slots=True, eq=False)
class _Process:
    proc: asyncio.subprocess.Process
    gpu: str | None
    spawned: float


class LocalLauncher(Launcher):
    def __init__(self, config: EngineConfig, *, gpus: Sequence[str] = (), heartbeat_s: float | None = None,
                 host: str = "127.0.0.1", python: str = sys.executable, ready_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, warm_spares: int = 0, token: str | None = None,
                 prefill_instances: int = 0):
        """Every worker's engine is built from `config` (forwarded as its flags; with `prefill_instances`, its role
        set per worker: see the module's doc) and listens on `host`. `gpus`: device ids, one worker each; empty: no
        GPU assignment (CPU or emulated). `heartbeat_s`: the workers' (None: their default). `warm_spares`: how many
        started, unattached workers to keep (`num_spares_short`, `take_spare`). `token`: the fleet's shared secret
        (None: a random one), passed to the workers in their environment."""
        super().__init__(token=token, warm_spares=warm_spares, prefill_instances=prefill_instances)
        self.config = config
        self.heartbeat_args = [] if heartbeat_s is None else ["--heartbeat-s", str(heartbeat_s)]
        self.gpus, self.host, self.python = list(gpus), host, python
        self.ready_timeout_s = ready_timeout_s
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {}), TOKEN_ENV: self.token}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), self.env.get("PYTHONPATH")]))
        self.processes: dict[str, _Process] = {}
        self.exit_codes: dict[str, int] = {}  # instance id -> exit status of its process, once reaped

    @property
    def capacity(self) -> int | None:
        """How many workers can run at once (one per GPU); None: no bound here."""
        return len(self.gpus) if self.gpus else None

    def alive(self, instance_id: str) -> bool:
        p = self.processes.get(instance_id)
        return p is not None and p.proc.returncode is None

    def _worker_ids(self) -> Collection[str]:
        return self.processes.keys()

    def _forget(self, instance_id: str) -> None:
        asyncio.get_running_loop().create_task(self._reap(instance_id))

    async def start(self, instance_id: str) -> tuple[str, int]:
        """Spawns a worker and waits until it listens; returns (host, port)."""
        if instance_id in self.processes:
            raise LaunchError(f"instance {instance_id!r} is already running")
        gpu = None
        env = self.env
        if self.gpus:
            used = {p.gpu for p in self.processes.values()}
            gpu = next((g for g in self.gpus if g not in used), None)
            if gpu is None:
                raise LaunchError(f"every GPU ({', '.join(self.gpus)}) already runs a worker")
            env = {**env, "CUDA_VISIBLE_DEVICES": gpu}
        config = self._claim_role(instance_id, self.config)
        spawned = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "cluster.worker", "--host", self.host, "--port", "0", "--instance-id",
                instance_id, "--parent-pid", str(os.getpid()), *config.to_args(), *self.heartbeat_args,
                cwd=str(REPO_ROOT), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                start_new_session=True)  # a terminal's Ctrl-C reaches the router alone, which drains the workers
        except BaseException:
            self.roles.pop(instance_id, None)
            raise
        self.processes[instance_id] = _Process(proc, gpu, spawned)
        try:
            port = await asyncio.wait_for(self._read_port(proc), self.ready_timeout_s)
        except BaseException as e:
            self.kill(instance_id)
            await self._reap(instance_id)
            if isinstance(e, asyncio.TimeoutError):
                raise LaunchError(f"worker {instance_id} was not ready within {self.ready_timeout_s:g} s") from None
            raise
        self.cold_starts.append(time.monotonic() - spawned)
        asyncio.get_running_loop().create_task(self._forward_stdout(instance_id, proc))
        return self.host, port

    @staticmethod
    async def _read_port(proc: asyncio.subprocess.Process) -> int:
        while True:
            line = await proc.stdout.readline()
            if not line:
                raise LaunchError(f"worker exited with status {await proc.wait()} before it was ready")
            text = line.decode(errors="replace").strip()
            if text.startswith("READY "):
                return int(text.split()[1])

    @staticmethod
    async def _forward_stdout(instance_id: str, proc: asyncio.subprocess.Process) -> None:
        """Keeps reading what the worker prints after READY, so a full pipe never blocks it."""
        while line := await proc.stdout.readline():
            log.info("[%s] %s", instance_id, line.decode(errors="replace").rstrip())

    def pid(self, instance_id: str) -> int | None:
        p = self.processes.get(instance_id)
        return None if p is None else p.proc.pid

    def kill(self, instance_id: str) -> None:
        """SIGKILL, for a worker that died or hangs; `stop` reaps it. Its role is free for the next start."""
        self.roles.pop(instance_id, None)
        p = self.processes.get(instance_id)
        if p is not None and p.proc.returncode is None:
            try:
                p.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def stop(self, instance_id: str, timeout_s: float = 30.0) -> int | None:
        """Waits for a (drained) worker to exit, SIGTERM then SIGKILL past the timeout; returns its exit status."""
        p = self.processes.get(instance_id)
        if p is None:
            return None
        try:
            await asyncio.wait_for(p.proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("worker %s did not exit within %g s; terminating it", instance_id, timeout_s)
            p.proc.terminate()
            try:
                await asyncio.wait_for(p.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                p.proc.kill()
        return await self._reap(instance_id)

    async def _reap(self, instance_id: str) -> int | None:
        self.spares.pop(instance_id, None)
        self.roles.pop(instance_id, None)
        p = self.processes.pop(instance_id, None)
        if p is None:
            return None
        status = self.exit_codes[instance_id] = await p.proc.wait()
        return status

    async def close(self) -> None:
        for instance_id in list(self.processes):
            self.kill(instance_id)
            await self._reap(instance_id)
