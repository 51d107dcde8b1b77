"""Fleets across machines: engine workers as Ray actors on a local Ray cluster started here (`cluster.serve --launcher
ray`, emulated engines), and the shared-secret handshake between router and worker.

- The official openai client gets the offline texts through four actors; a fifth is a warm spare.
- Killing an actor (`ray.kill`) under load loses no request and changes no text: Ray or the socket reports it, its
  streams continue elsewhere, the spare replaces it and a new spare starts.
- Scaling down stops actors (Ray reports them dead), scaling up starts them.
- A worker Ray cannot place (more CPUs asked than the cluster has) makes the router stop asking, with one log line.
- A connection without the cluster token (none, a wrong one, a replayed proof, silence, or a second router) is
  closed with nothing but the Hello and a reason; the worker keeps serving its router.

The Ray tests skip when ray cannot be imported (`./run test` installs it: the `ray` extra)."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import openai_client, serving_fleet

from cluster import protocol as p
from cluster import worker as worker_module
from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.fleet import InstanceStatus
from cluster.router import Router
from cluster.service import RouterService
from cluster.worker import Worker
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm import build_engine
from scheduler.fcfs import FCFSPolicy
from scheduler.roofline import emulated_latency_model
from scheduler.slo import SLO
from scheduler.tiers import Tier, TierSet

TIME_SCALE = 10.0  # emulated steps of tens of ms: a request lasts seconds, long enough to kill its actor mid-way
NUM_KV_BLOCKS = 256
TIERS = "fast:60:1500,slow:150:4000"


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed (the `ray` extra of pyproject.toml)")
    from cluster.ray_launcher import connect_ray

    connect_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def fleet(ray_cluster, default_model):
    """Four emulated engines as Ray actors behind cluster.serve's app, and a warm spare."""
    with serving_fleet([
            "--launcher", "ray", "--model", default_model, "--executor", "emulated", "--num-kv-blocks",
            str(NUM_KV_BLOCKS), "--time-scale", str(TIME_SCALE), "--tiers", TIERS, "--min-instances", "4",
            "--max-instances", "4", "--idle-pool", "0", "--warm-spares", "1", "--serve-late"],
            timeout_s=120) as (server, backend):
        service = backend.service
        wait_until(lambda: service.router.fleet.count(InstanceStatus.READY) == 4
                   and all(service.launcher.spares.values()) and len(service.launcher.spares) == 1, 120,
                   "four engines and a ready spare")
        yield server, backend


def test_worker_resources(ray_cluster):
    from cluster.ray_launcher import worker_resources

    assert worker_resources(EngineConfig(executor="emulated")) == {"num_cpus": 0.25}
    assert worker_resources(EngineConfig(device="cuda")) == {"num_gpus": 1, "num_cpus": 1.0}
    assert worker_resources(EngineConfig(device="cpu")) == {"num_cpus": 1.0}
    assert worker_resources(EngineConfig(device="cuda"), num_cpus=4) == {"num_gpus": 1, "num_cpus": 4}
    with pytest.raises(ValueError, match="num_cpus"):
        worker_resources(EngineConfig(), num_cpus=0)


def test_openai_client_through_ray_actors(fleet, offline):
    server, backend = fleet
    launcher = backend.service.launcher
    assert type(launcher).__name__ == "RayLauncher"
    assert set(backend.service.links) <= set(launcher.actors) and len(launcher.actors) == 5  # four and the spare
    c = openai_client(server)
    prompt = "Ray actors serve the fleet"
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    out = c.completions.create(model=backend.model_name, prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == want.text and out.usage.completion_tokens == 16
    messages = [{"role": "user", "content": "Which machine answers?"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0]
    chunks = list(c.chat.completions.create(model=backend.model_name, messages=messages, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text


def test_killed_actor_loses_no_request(fleet, offline, ray_cluster):
    server, backend = fleet
    service, launcher, router = backend.service, backend.service.launcher, backend.service.router
    fleet_view = router.fleet
    wait_until(lambda: fleet_view.count(InstanceStatus.READY) == 4 and any(launcher.spares.values()), 60,
               "four engines and a ready spare")
    (spare,) = launcher.spares
    lost_before, warm_before = router.counts["lost"], len(service.warm_starts)
    prompts = [f"Request {i} asks the cluster about topic {i * 7 % 11}." for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=40 + 5 * (i % 4)) for i in range(12)]
    want = [o.text for o in offline.generate(prompts, params)]
    c = openai_client(server)

    def started_on(instance_id: str) -> int:
        return sum(1 for s in list(service.streams.values()) if s.routed.instance_id == instance_id and s.started)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(c.completions.create, model=backend.model_name, prompt=prompt,
                               max_tokens=params[i].max_tokens, temperature=0) for i, prompt in enumerate(prompts)]
        wait_until(lambda: any(started_on(i) >= 2 for i in list(service.links)), 60, "streams under way")
        victim = max(list(service.links), key=started_on)
        handle = launcher.actors[victim]
        ray_cluster.kill(handle)
        results = [f.result(timeout=120) for f in futures]
    for i, out in enumerate(results):
        assert out.choices[0].finish_reason == "length" and out.choices[0].text == want[i], f"request {i}"
    assert service.counts["migrated"] >= 1 and not service.counts["migrations_exhausted"]
    assert router.counts["lost"] == lost_before + 1 and victim not in fleet_view.instances
    # the spare replaced it, and a new spare (a new actor) took the spare's place
    assert spare in fleet_view.instances and len(service.warm_starts) == warm_before + 1
    wait_until(lambda: any(launcher.spares.values()) and victim not in launcher.actors, 60, "a new ready spare")
    assert spare not in launcher.spares and len(launcher.actors) == 5
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(handle.node_id.remote(), timeout=30)


def test_scaling_stops_and_starts_actors(fleet, ray_cluster):
    server, backend = fleet
    service, launcher, router = backend.service, backend.service.launcher, backend.service.router
    autoscaler = router.autoscaler
    wait_until(lambda: router.fleet.count(InstanceStatus.READY) == 4 and any(launcher.spares.values()), 60,
               "four engines and a ready spare")
    before = dict(launcher.actors)
    autoscaler.limits = ScalingLimits(min_instances=2, max_instances=2, idle_pool=0, stop_after_idle_s=0.0)
    wait_until(lambda: len(router.fleet.instances) == 2 and len(launcher.actors) == 3, 60, "two engines and a spare")
    stopped = [instance_id for instance_id in before if instance_id not in launcher.actors]
    assert len(stopped) == 2
    for instance_id in stopped:
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            ray_cluster.get(before[instance_id].node_id.remote(), timeout=30)
    autoscaler.limits = ScalingLimits(min_instances=3, max_instances=3, idle_pool=0)
    wait_until(lambda: router.fleet.count(InstanceStatus.READY) == 3 and len(launcher.actors) == 4
               and all(launcher.spares.values()), 90, "three engines and a ready spare")
    assert set(service.links) <= set(launcher.actors)
    assert len(set(launcher.actors) - set(before)) == 1  # the new spare's actor, started when the spare was taken


def test_unplaceable_worker_stops_the_asking(ray_cluster, default_model, caplog):
    from cluster.ray_launcher import RayLauncher

    async def scenario():
        router = Router(TierSet([Tier("std", 100, 2000)]), emulated_latency_model(),
                        autoscaler=Autoscaler(ScalingLimits(min_instances=1, max_instances=2, idle_pool=0)))
        launcher = RayLauncher(EngineConfig(model=default_model, executor="emulated"), num_cpus=1000,
                               placement_timeout_s=1.0)
        service = RouterService(router, launcher=launcher, tick_s=0.05, placement_retry_s=60.0)
        await service.start()
        try:
            while not service.counts["unplaceable"]:
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.0)  # forty ticks, each of which wants an instance
            assert service.counts["unplaceable"] == 1 and not launcher.actors and not router.fleet.instances
        finally:
            await service.stop()

    with caplog.at_level(logging.WARNING, logger="cluster.service"):
        asyncio.run(scenario())
    assert sum("no room for worker" in r.message for r in caplog.records) == 1


# ---- the handshake (no Ray) ------------------------------------------------------------------------------------------
def test_connections_without_the_token_are_closed_and_the_router_keeps_its_worker(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"max_position_embeddings": 4096, "eos_token_id": 2}')
    monkeypatch.setattr(worker_module, "AUTH_TIMEOUT_S", 0.5)
    token = "handshake-test-token-0123456789"
    engine = build_engine(EngineConfig(model=str(tmp_path), executor="emulated", num_kv_blocks=128),
                          FCFSPolicy(2048, 64), step_time=lambda *_: 0.005)
    submit = p.encode_frame(p.Submit("intruder", [5, 6, 7], p.SamplingSpec(max_tokens=4), "std", SLO(2000, 100), 0.0))

    async def intrude(port: int, first_frames) -> list:
        """What a peer gets that sends `first_frames(hello)` (None: nothing) after the Hello."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        hello = await p.read_message(reader)
        frames = first_frames(hello)
        if frames is not None:
            writer.write(frames)
        got = [hello]
        while (msg := await asyncio.wait_for(p.read_message(reader), 5)) is not None:
            got.append(msg)
        writer.close()
        return got

    async def scenario():
        worker = Worker(engine, instance_id="w", token=token, heartbeat_s=0.1)
        port = await worker.start()
        service = RouterService(Router(TierSet([Tier("std", 100, 2000)]), emulated_latency_model()), token=token)
        await service.start()
        try:
            assert await service.attach("127.0.0.1", port) == "w"
            outputs = service.generate("r", [1, 2, 3], SamplingParams(max_tokens=120, ignore_eos=True), "std",
                                       SLO(2000, 100), service.clock())
            first = await anext(outputs)  # streaming: every intruder below comes while it runs
            other_challenge = b"\x07" * 32
            cases = {
                "no auth": lambda hello: submit,
                "wrong token": lambda hello: p.encode_frame(p.Auth(p.auth_proof("not-the-token-0123456789",
                                                                                hello.challenge))) + submit,
                "replayed proof": lambda hello: p.encode_frame(p.Auth(p.auth_proof(token, other_challenge))) + submit,
                "silent": lambda hello: None,
                "second router": lambda hello: p.encode_frame(p.Auth(p.auth_proof(token, hello.challenge))) + submit,
            }
            for case, frames in cases.items():
                got = await intrude(port, frames)
                assert isinstance(got[0], p.Hello) and len(got[0].challenge) == 32, case
                assert [type(m) for m in got[1:]] == [p.Error], (case, got[1:])  # no report, no token, no heartbeat
                kind = got[1].kind
                assert kind == {"no auth": "protocol", "silent": "protocol"}.get(case, "auth"), (case, got[1])
            assert "intruder" not in engine.requests and len(worker.connections) == 1
            tokens = len(first.new_token_ids)
            async for out in outputs:
                tokens += len(out.new_token_ids)
            assert tokens == 120 and out.finish_reason == "length"
            assert service.router.counts["lost"] == 0
        finally:
            await service.stop()
            await worker.stop()

    asyncio.run(scenario())


def test_a_router_with_the_wrong_token_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"max_position_embeddings": 4096, "eos_token_id": 2}')
    engine = build_engine(EngineConfig(model=str(tmp_path), executor="emulated", num_kv_blocks=64),
                          FCFSPolicy(2048, 64), step_time=lambda *_: 0.005)

    async def scenario():
        worker = Worker(engine, instance_id="w", token="the-fleet-token-0123456789", heartbeat_s=0.1)
        port = await worker.start()
        service = RouterService(Router(TierSet([Tier("std", 100, 2000)]), emulated_latency_model()),
                                token="another-fleet-token-0123456789")
        await service.start()
        try:
            await service.attach("127.0.0.1", port)
            deadline = time.monotonic() + 10
            while service.router.counts["lost"] == 0:
                assert time.monotonic() < deadline, "the refused connection was not noticed"
                await asyncio.sleep(0.02)
            assert not service.links and not worker.connections
        finally:
            await service.stop()
            await worker.stop()

    asyncio.run(scenario())


def test_cluster_token_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(p.TOKEN_ENV, raising=False)
    assert p.load_cluster_token() is None
    monkeypatch.setenv(p.TOKEN_ENV, "from-the-environment-0123")
    assert p.load_cluster_token() == "from-the-environment-0123"
    (tmp_path / "token").write_text("from-a-file-0123456789\n")
    assert p.load_cluster_token(str(tmp_path / "token")) == "from-a-file-0123456789"
    (tmp_path / "short").write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        p.load_cluster_token(str(tmp_path / "short"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        p.load_cluster_token(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="needs the cluster token"):
        Worker(None, instance_id="w", token="")
