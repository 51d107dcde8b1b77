"""Stream migration and warm spares. An engine that resumes a stream (`Engine.add_request`'s resumed_tokens) gives
the client exactly the rest of the undisturbed output: text across the seam with stop strings and held-back text,
and a seeded sampler's draws. Live: `kill -9` of an engine under load ends with no error and no lost request, every
greedy text equal to an undisturbed run, the replacement taken from a warm spare and the spare started again; a
stream whose instance keeps failing ends with an error only after its migrations are spent."""
from __future__ import annotations

import asyncio
import json

import pytest

from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.fleet import InstanceStatus
from cluster.launcher import LocalLauncher
from cluster.router import Router
from cluster.service import RouterService
from cluster.serve import warm_spares
from cluster.worker import Worker
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import InvalidRequestError
from engine.llm import build_engine
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet

TIME_SCALE = 10.0  # emulated steps of tens of ms: a stream lasts seconds, long enough to kill its engine mid-way
TIERS = TierSet([Tier("fast", 60, 1500), Tier("slow", 150, 4000)])
NUM_KV_BLOCKS = 256


def run_engine(engine, rid: str, prompt: list[int], params: SamplingParams, resumed_tokens: int = 0):
    """Steps the engine until `rid` finishes; returns its streamed pieces: (token ids, text) per output, and the
    finish reason."""
    engine.add_request(rid, prompt, params, resumed_tokens=resumed_tokens)
    pieces = []
    while True:
        for out in engine.step():
            if out.request_id == rid:
                pieces.append((out.new_token_ids, out.new_text))
                if out.finished:
                    return pieces, out.finish_reason


def test_resumed_stream_continues_the_text_exactly(offline):
    """Resumed after any number of tokens, the client's text (what it had, then what the resumed engine streams)
    equals the undisturbed text, cut by a stop string that spans the seam for some of the cut points."""
    engine = offline.engine
    prompt = offline.tokenizer.encode("Migration keeps every word:")
    plain, _ = run_engine(engine, "plain", prompt, SamplingParams(temperature=0, max_tokens=40))
    text = "".join(t for _, t in plain)
    stop = text[len(text) // 2:len(text) // 2 + 4]
    assert len(stop.strip()) > 1
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    whole, reason = run_engine(engine, "whole", prompt, params)
    tokens = [t for ids, _ in whole for t in ids]
    want = "".join(t for _, t in whole)
    assert reason == "stop" and want == text[:text.index(stop)] and len(tokens) < 40
    for k in range(1, len(tokens)):
        sent = "".join(t for _, t in whole[:k])  # what the client had when the engine died (less what was held back)
        resumed = SamplingParams(temperature=0, max_tokens=40 - k, stop=[stop])
        rest, reason = run_engine(engine, f"resumed-{k}", prompt + tokens[:k], resumed, resumed_tokens=k)
        assert [t for ids, _ in rest for t in ids] == tokens[k:], k
        assert sent + "".join(t for _, t in rest) == want and reason == "stop", k


def test_resumed_seeded_sampling_draws_what_it_would_have(llama_tiny):
    folder, _ = llama_tiny
    llm = LLM(folder, num_kv_blocks=64)
    prompt = [5, 17, 33, 2, 101, 250, 7]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    whole, _ = run_engine(llm.engine, "whole", prompt, params)
    tokens = [t for ids, _ in whole for t in ids]
    for k in (1, 6, 15):
        rest_params = SamplingParams(temperature=0.8, seed=11, max_tokens=16 - k, ignore_eos=True)
        rest, reason = run_engine(llm.engine, f"r{k}", prompt + tokens[:k], rest_params, resumed_tokens=k)
        assert [t for ids, _ in rest for t in ids] == tokens[k:] and reason == "length", k
    # the same prompt without the skip draws afresh: the resumed engine's agreement is the skip's doing
    fresh, _ = run_engine(llm.engine, "fresh", prompt + tokens[:6], SamplingParams(
        temperature=0.8, seed=11, max_tokens=10, ignore_eos=True))
    assert [t for ids, _ in fresh for t in ids] != tokens[6:]


def test_resumed_tokens_out_of_range_is_refused(offline):
    with pytest.raises(InvalidRequestError, match="resumed_tokens"):
        offline.engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4), resumed_tokens=3)
    assert "bad" not in offline.engine.requests


def test_warm_spares_default_and_bound():
    assert warm_spares(None, 4, 0) == 1  # no GPUs: one spare
    assert warm_spares(None, 4, 4) == 0  # every GPU may hold an instance: no room for one
    assert warm_spares(None, 3, 4) == 1 and warm_spares(2, 2, 4) == 2
    with pytest.raises(ValueError, match="--warm-spares 2"):
        warm_spares(2, 3, 4)


# ---- live fleets ---------------------------------------------------------------------------------------------------
async def wait_for(predicate, timeout: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def collect(service: RouterService, rid: str, prompt: list[int], params: SamplingParams, tier: int):
    """What a streaming client gets: the token ids, the text, the finish reason and error of the last output."""
    ids, text, last = [], "", None
    slo = TIERS[tier].slo
    async for out in service.generate(rid, prompt, params, TIERS[tier].name, slo, asyncio.get_running_loop().time()):
        ids += out.new_token_ids
        text += out.new_text
        last = out
    return ids, text, last.finish_reason, last.error


def started_on(service: RouterService, instance_id: str) -> list[str]:
    return [rid for rid, s in service.streams.items() if s.routed.instance_id == instance_id and s.started]


def test_kill_9_under_load_loses_nothing_and_changes_no_text(default_model, offline):
    """Three emulated engine processes and a warm spare; 18 greedy streams (both tiers, some with stop strings);
    the engine holding the most started streams is killed with SIGKILL. Every stream completes with the text and
    tokens of the undisturbed run, its started streams migrate, the spare replaces the dead engine and a new spare
    starts."""
    rng_prompts = [offline.tokenizer.encode(f"Request {i} asks about topic {i * 7 % 11}.") * (1 + i % 3)
                   for i in range(18)]
    params = []
    for i, prompt in enumerate(rng_prompts):
        max_tokens = 60 + 10 * (i % 5)
        stop = []
        if i % 3 == 0:  # a stop string late in the output: hit after the kill, across a seam or on the new engine
            text = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].text
            stop = [text[int(len(text) * 0.8):int(len(text) * 0.8) + 3]]
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop))
    want = [(o.token_ids, o.text, o.finish_reason) for o in offline.generate(rng_prompts, params)]
    assert any(reason == "stop" for *_, reason in want)

    async def scenario():
        router = Router(TIERS, emulated_latency_model(TIME_SCALE), shed_late=False,  # every request is served
                        autoscaler=Autoscaler(ScalingLimits(min_instances=3, max_instances=3, idle_pool=0)))
        launcher = LocalLauncher(EngineConfig(model=default_model, executor="emulated", num_kv_blocks=NUM_KV_BLOCKS,
                                              time_scale=TIME_SCALE), heartbeat_s=0.2, warm_spares=1)
        service = RouterService(router, launcher=launcher, heartbeat_timeout_s=3.0, tick_s=0.05)
        await service.start()
        try:
            await live(service, router, launcher)
        finally:
            await service.stop()

    async def live(service, router, launcher):
        fleet = router.fleet
        await wait_for(lambda: fleet.count(InstanceStatus.READY) == 3 and any(launcher.spares.values()), 90,
                       "three engines and a ready spare")
        (spare,) = launcher.spares
        tasks = [asyncio.create_task(collect(service, f"r{i}", prompt, params[i], i % 2))
                 for i, prompt in enumerate(rng_prompts)]
        await wait_for(lambda: any(len(started_on(service, v)) >= 3 for v in list(fleet.instances)), 30,
                       "an engine with three streams under way")
        victim = max(list(fleet.instances), key=lambda v: len(started_on(service, v)))
        moved = set(started_on(service, victim))
        launcher.kill(victim)
        got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for i, (ids, text, reason, error) in enumerate(got):
            assert error is None and (ids, text, reason) == want[i], f"r{i}"
        assert service.counts["migrated"] >= len(moved) >= 3 and not service.counts["migrations_exhausted"]
        assert len(service.migration_delays) == service.counts["migrated"]
        assert router.counts["lost"] == 1 and victim not in fleet.instances
        # the spare replaced it (attached, not cold-started), and a new spare is started in its place
        assert spare in fleet.instances and len(service.warm_starts) == 1
        await wait_for(lambda: any(launcher.spares.values()), 60, "a new ready spare")
        assert spare not in launcher.spares and len(launcher.processes) == 4

    asyncio.run(scenario())


def test_a_stream_errs_only_after_its_migrations_are_spent(default_model):
    """Four in-process engines behind the router; a stream's engine is stopped each time it has streamed from it.
    After two migrations it still completes what a third engine failure cuts short, with an explicit error."""
    async def scenario():
        service = RouterService(Router(TIERS, emulated_latency_model(TIME_SCALE)), tick_s=0.05, max_migrations=2)
        workers = {}
        for i in range(4):
            config = EngineConfig(model=default_model, executor="emulated", num_kv_blocks=NUM_KV_BLOCKS,
                                  time_scale=TIME_SCALE)
            worker = Worker(build_engine(config, instance_id=f"w{i}"), instance_id=f"w{i}", token=service.token,
                            heartbeat_s=0.2)
            workers[await service.attach("127.0.0.1", await worker.start())] = worker
        await service.start()
        try:
            stream = asyncio.create_task(collect(service, "long", list(range(100, 160)),
                                                 SamplingParams(temperature=0, max_tokens=2000), 1))
            served_by = []
            for _ in range(3):
                await wait_for(lambda: "long" in service.streams and service.streams["long"].routed.instance_id
                               not in (None, *served_by) and service.streams["long"].lost_at is None
                               and service.streams["long"].started, 30, "the stream under way on a new engine")
                served_by.append(service.streams["long"].routed.instance_id)
                await workers[served_by[-1]].stop()
            ids, text, reason, error = await asyncio.wait_for(stream, 30)
            assert reason == "error" and "moved 2 times" in error and served_by[-1] in error
            assert 0 < len(ids) < 2000 and service.counts["migrated"] == 2
            assert service.counts["migrations_exhausted"] == 1 and len(set(served_by)) == 3
        finally:
            await service.stop()
            for worker in workers.values():
                await worker.stop()

    asyncio.run(scenario())


def test_spares_stay_within_the_gpus_and_an_ended_one_is_not_handed_out(tmp_path):
    """Spares hold devices as workers do: with two GPUs and one worker, one spare at most, on the free device; a
    spare whose process ended is reaped, not handed out, and counted as missing."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}))

    async def main():
        config = EngineConfig(model=str(tmp_path), executor="emulated", num_kv_blocks=16)
        launcher = LocalLauncher(config, gpus=["0", "1"], warm_spares=3)
        try:
            assert launcher.num_spares_short() == 2
            await launcher.start("a")
            assert launcher.num_spares_short() == 1
            starting = launcher.start_spare("s")
            assert launcher.num_spares_short() == 0 and launcher.take_spare() is None  # starting, not ready
            await starting
            assert launcher.processes["s"].gpu == "1"
            launcher.kill("s")
            await launcher.processes["s"].proc.wait()
            assert launcher.take_spare() is None
            await wait_for(lambda: "s" in launcher.exit_codes, 10, "the ended spare reaped")
            assert "s" not in launcher.processes and not launcher.spares and launcher.num_spares_short() == 1
            await launcher.start_spare("t")
            instance_id, (host, port) = launcher.take_spare()
            assert instance_id == "t" and launcher.processes["t"].gpu == "1" and port > 0
            assert launcher.num_spares_short() == 0  # both devices hold a worker
        finally:
            await launcher.close()

    asyncio.run(main())
