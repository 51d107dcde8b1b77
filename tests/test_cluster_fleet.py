"""A live fleet of emulated engine processes behind the router service: placement follows the policy (packing a
tier's busiest instance, scale-up from the idle pool, promotion only when the own tier is full), instances return
to the pool and the surplus is drained before its process stops; and engines that hang or die mid-load: every
request completes (placed again, or migrated mid-stream), none hangs, replacements start."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from cluster import protocol as p
from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.fleet import InstanceStatus
from cluster.launcher import LaunchError, LocalLauncher
from cluster.router import Router
from cluster.service import RouterService
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from scheduler.roofline import emulated_latency_model
from scheduler.slo import SLO
from scheduler.tiers import Tier, TierSet

TIME_SCALE = 10.0  # iterations of ~36 ms: requests last seconds, long enough to act on them mid-flight
TIERS = TierSet([Tier("fast", 60, 1500), Tier("slow", 150, 4000)])
FAST, SLOW = 0, 1
NUM_KV_BLOCKS = 128  # 2048 tokens: two 600-token requests (plus their expected output) fill an instance


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-emulated")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 8192, "eos_token_id": 2}))
    return str(folder)


class RecordingService(RouterService):
    """Keeps every engine's step reports, to compare with the router's own placements."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reported: dict[str, set[str]] = {}  # instance -> request ids its reports listed as resident

    def _on_message(self, link, msg) -> None:
        if isinstance(msg, p.StepReport):
            self.reported.setdefault(link.instance_id, set()).update(r.request_id for r in msg.residents)
        super()._on_message(link, msg)


def make_service(model: str, heartbeat_timeout_s: float = 3.0, **limits) -> RecordingService:
    router = Router(TIERS, emulated_latency_model(TIME_SCALE), autoscaler=Autoscaler(ScalingLimits(**limits)))
    launcher = LocalLauncher(EngineConfig(model=model, executor="emulated", num_kv_blocks=NUM_KV_BLOCKS,
                                          time_scale=TIME_SCALE), heartbeat_s=0.2)
    return RecordingService(router, launcher=launcher, heartbeat_timeout_s=heartbeat_timeout_s, tick_s=0.05,
                            drain_timeout_s=10.0)


async def wait_for(predicate, timeout: float, what: str) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


class Client:
    """Runs requests through service.generate and keeps what each one ended with."""

    def __init__(self, service: RouterService):
        self.service = service
        self.tasks: dict[str, asyncio.Task] = {}
        self.first_token: dict[str, asyncio.Event] = {}

    def send(self, rid: str, tier: int, prompt_len: int = 600, max_tokens: int = 200) -> None:
        self.first_token[rid] = asyncio.Event()
        self.tasks[rid] = asyncio.create_task(self._run(rid, TIERS[tier].slo, prompt_len, max_tokens))

    async def _run(self, rid: str, slo: SLO, prompt_len: int, max_tokens: int):
        prompt = [3 + (i * 7) % 900 for i in range(prompt_len)]
        last, n = None, 0
        loop = asyncio.get_running_loop()
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        async for out in self.service.generate(rid, prompt, params, TIERS.for_tpot(slo.tpot_ms).name, slo,
                                               loop.time()):
            n += len(out.new_token_ids)
            if n:
                self.first_token[rid].set()
            last = out
        return last.finish_reason, n, last.error

    def placed_on(self, rid: str) -> str | None:
        stream = self.service.streams.get(rid)
        return None if stream is None else stream.routed.instance_id

    async def results(self, timeout: float) -> dict[str, tuple]:
        done, pending = await asyncio.wait(self.tasks.values(), timeout=timeout)
        assert not pending, f"{len(pending)} requests still open after {timeout} s"
        return {rid: t.result() for rid, t in self.tasks.items()}


def test_live_fleet_follows_the_policy(tiny_model):
    async def scenario():
        service = make_service(tiny_model, min_instances=1, max_instances=4, idle_pool=3, stop_after_idle_s=0.3)
        await service.start()
        try:
            await live(service)
        finally:
            await service.stop()
        assert all(code == 0 for code in service.launcher.exit_codes.values())  # stop drains them all

    async def live(service):
        router, fleet = service.router, service.router.fleet
        await wait_for(lambda: len(fleet.idle) == 3, 60, "three idle instances")
        client = Client(service)

        # slow tier: the first request takes an idle instance, the second packs onto it, the third does not fit
        # there (KV) and takes another idle one, the fourth packs onto that
        for i in range(4):
            client.send(f"s{i}", SLOW)
            await wait_for(lambda: client.placed_on(f"s{i}") is not None, 10, f"s{i} placed")
        a, b = client.placed_on("s0"), client.placed_on("s2")
        assert [client.placed_on(f"s{i}") for i in range(4)] == [a, a, b, b] and a != b
        assert [e.kind for e in router.events if e.request_id in ("s0", "s1", "s2", "s3")] == \
            ["scaled_up", "own", "scaled_up", "own"]
        assert fleet[a].tier == fleet[b].tier == SLOW

        # fast tier: nothing tighter to promote to, so it scales up; then a slow request finds its own tier full
        # and is promoted onto the fast instance
        client.send("f0", FAST)
        await wait_for(lambda: client.placed_on("f0") is not None, 10, "f0 placed")
        c = client.placed_on("f0")
        assert c not in (a, b) and fleet[c].tier == FAST
        client.send("s4", SLOW)
        await wait_for(lambda: client.placed_on("s4") is not None, 10, "s4 placed")
        assert client.placed_on("s4") == c
        assert router.events[-1].kind == "promoted"
        # the pool is refilled by a new process while the load runs (max 4 instances)
        await wait_for(lambda: len(fleet.instances) == 4, 60, "a fourth instance")

        results = await client.results(120)
        assert all(r == ("length", 200, None) for r in results.values()), results
        # each engine reported as residents exactly the requests the router placed there
        placed = {}
        for e in router.events:
            if e.kind in ("own", "scaled_up", "promoted"):
                placed.setdefault(e.instance_id, set()).add(e.request_id)
        assert {i: ids for i, ids in service.reported.items() if ids} == placed

        # load gone: every tier gives its instances back; the surplus over the pool of 3 is drained and stopped
        await wait_for(lambda: len(fleet.instances) == 3 and all(v.tier is None for v in fleet.instances.values()),
                       30, "back to an idle pool of three")
        assert router.counts["released"] == 3
        stopped = service.launcher.exit_codes
        assert len(stopped) == 1 and list(stopped.values()) == [0]  # exited by itself once drained
        assert service.cold_starts and all(0 < t < 60 for t in service.cold_starts)

    asyncio.run(scenario())


def test_hung_and_killed_engines_lose_no_request(tiny_model):
    async def scenario():
        service = make_service(tiny_model, heartbeat_timeout_s=1.0, min_instances=2, max_instances=3, idle_pool=0)
        await service.start()
        try:
            await failures(service)
        finally:
            await service.stop()

    async def failures(service):
        router, fleet, launcher = service.router, service.router.fleet, service.launcher
        await wait_for(lambda: service.ready and len(fleet.idle) == 2, 60, "two instances")
        client = Client(service)

        # phase 1, a hang: requests stream from one instance; it is frozen, then more are placed on it (they can
        # produce no token); the heartbeat timeout declares it dead
        for i in range(2):
            client.send(f"a{i}", SLOW, prompt_len=200, max_tokens=400)
        await wait_for(lambda: all(client.first_token[f"a{i}"].is_set() for i in range(2)), 20, "a0, a1 streaming")
        hung = client.placed_on("a0")
        os.kill(launcher.pid(hung), signal.SIGSTOP)
        client.send("b0", SLOW, prompt_len=200, max_tokens=50)
        await wait_for(lambda: client.placed_on("b0") is not None, 10, "b0 placed")
        assert client.placed_on("b0") == hung  # packed onto the busiest instance, which no longer answers
        await wait_for(lambda: hung in launcher.exit_codes, 10, "the hung instance declared dead and killed")
        assert launcher.exit_codes[hung] == -signal.SIGKILL and hung not in fleet.instances

        await asyncio.wait_for(client.tasks["b0"], 30)
        assert client.tasks["b0"].result() == ("length", 50, None)  # re-placed elsewhere, completed in full

        # phase 2, a crash: kill -9 the instance serving new requests, right after they were placed
        for i in range(3):
            client.send(f"c{i}", SLOW, prompt_len=200, max_tokens=300)
        await wait_for(lambda: all(client.placed_on(f"c{i}") for i in range(3)), 10, "c placed")
        crashed = client.placed_on("c0")
        assert crashed != hung
        os.kill(launcher.pid(crashed), signal.SIGKILL)

        results = await client.results(120)
        # streaming on the hung instance: migrated, completed in full
        assert [results[rid] for rid in ("a0", "a1")] == [("length", 400, None)] * 2
        # streaming on the crashed one (migrated), or no token yet there (placed again): completed in full
        assert [results[rid] for rid in ("c0", "c1", "c2")] == [("length", 300, None)] * 3
        assert service.counts["migrated"] >= 2  # a0, a1; and any c that had streamed from the crashed one
        # replacements: the fleet is back at its minimum of two live instances, none of them the dead ones
        await wait_for(lambda: fleet.count(InstanceStatus.READY) == 2, 60, "two instances again")
        assert hung not in fleet.instances and crashed not in fleet.instances
        assert router.counts["lost"] == 2 and len(service.cold_starts) >= 4

    asyncio.run(scenario())


def _visible_devices(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    value = env.get(b"CUDA_VISIBLE_DEVICES")
    return None if value is None else value.decode()


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads a process's environment from /proc")
def test_one_worker_per_gpu_each_seeing_only_its_own(tiny_model):
    """--gpus: each worker process gets its own device as CUDA_VISIBLE_DEVICES, no more workers than devices, and
    a device is handed out again once its worker is gone (emulated workers here: the assignment is the same)."""
    async def main():
        config = EngineConfig(model=tiny_model, executor="emulated", num_kv_blocks=16)
        launcher = LocalLauncher(config, gpus=["0", "3"])
        assert launcher.capacity == 2
        try:
            await launcher.start("a")
            await launcher.start("b")
            assert {i: _visible_devices(launcher.pid(i)) for i in "ab"} == {"a": "0", "b": "3"}
            with pytest.raises(LaunchError, match="every GPU"):
                await launcher.start("c")
            launcher.kill("a")
            await launcher.stop("a")
            await launcher.start("c")
            assert _visible_devices(launcher.pid("c")) == "0"
        finally:
            await launcher.close()
        no_gpus = LocalLauncher(config)
        assert no_gpus.capacity is None
        try:
            await no_gpus.start("x")
            assert _visible_devices(no_gpus.pid("x")) == os.environ.get("CUDA_VISIBLE_DEVICES")
        finally:
            await no_gpus.close()

    asyncio.run(main())
