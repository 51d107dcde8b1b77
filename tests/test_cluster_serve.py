"""`cluster.serve`'s app (router + one autoscaled emulated engine process + HTTP) through the official openai client:
the same greedy text as the offline LLM with the same emulated executor, SLO fields honoured or refused, 429 with
Retry-After on a full queue, 503 with no instance."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import completion_text, openai_client, serving_fleet

from cluster.backend import RouterBackend
from cluster.router import Decision, Outcome, Router
from cluster.service import RouterService
from engine import SamplingParams
from engine.api_server import ServerThread, build_app
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet

NUM_KV_BLOCKS = 128  # 2048 tokens: a few long prompts fill an instance, so the queue can be driven full
TIERS = "fast:30:1000,slow:100:3000"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(default_model):
    with serving_fleet([
            "--model", default_model, "--executor", "emulated", "--num-kv-blocks", str(NUM_KV_BLOCKS),
            "--tiers", TIERS, "--min-instances", "1", "--max-instances", "1", "--idle-pool", "0", "--queue-limit",
            "1"]) as (server, backend):
        yield backend, server


SLO_FIELDS = {"none": None, "own": {"slo": {"ttft_ms": 800, "tpot_ms": 50}}, "tier": {"slo_tier": "fast"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("slo", sorted(SLO_FIELDS))
def test_completions_equal_offline_generate(cluster, offline, stream, slo):
    backend, server = cluster
    prompt = f"The {slo} cluster says"
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    text = completion_text(server, stream, MAX_TOKENS, model=backend.model_name, prompt=prompt, temperature=0,
                           extra_body=SLO_FIELDS[slo])
    assert text == want.text and text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("slo", sorted(SLO_FIELDS))
def test_chat_equals_offline_chat(cluster, offline, stream, slo):
    backend, server = cluster
    messages = [{"role": "user", "content": f"Say something about {slo} tiers."}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    kwargs = dict(model=backend.model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body=SLO_FIELDS[slo])
    if stream:
        chunks = list(openai_client(server).chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = openai_client(server).chat.completions.create(**kwargs).choices[0].message.content
    assert text == want.text and text


def test_unattainable_or_unknown_slo_is_refused(cluster):
    backend, server = cluster
    c = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="tighter than the tightest tier"):
        c.completions.create(model=backend.model_name, prompt="x", max_tokens=4, extra_body={
            "slo": {"ttft_ms": 1000, "tpot_ms": 1}})
    with pytest.raises(openai.BadRequestError, match="cannot be met even on an idle instance"):
        c.completions.create(model=backend.model_name, prompt="x", max_tokens=4, extra_body={
            "slo": {"ttft_ms": 0.5, "tpot_ms": 40}})
    with pytest.raises(openai.BadRequestError, match="unknown tier"):
        c.completions.create(model=backend.model_name, prompt="x", max_tokens=4, extra_body={"slo_tier": "gold"})


def test_full_queue_answers_429_with_retry_after(cluster):
    backend, server = cluster
    router = backend.service.router
    c = openai_client(server)

    def long_request(i: int):
        prompt = [100 + (7 * i + j) % 40000 for j in range(600)]  # 600 token ids: three fill the 2048-token pool
        return c.completions.create(model=backend.model_name, prompt=prompt, max_tokens=400, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        futures = []
        deadline = time.monotonic() + 30
        while router.queue_length(router.tiers.index("slow")) == 0:  # add load until one has to wait
            assert len(futures) < 8 and time.monotonic() < deadline
            before = router.counts["queued"] + sum(router.counts[k] for k in ("own", "scaled_up", "promoted"))
            futures.append(pool.submit(long_request, len(futures)))
            while router.counts["queued"] + sum(router.counts[k] for k in ("own", "scaled_up", "promoted")) == before:
                time.sleep(0.005)
        with pytest.raises(openai.RateLimitError) as err:  # one more that fits nowhere: the queue holds one already
            long_request(99)
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert "waiting" in str(err.value)
        results = [f.result(timeout=120) for f in futures]  # the queued one is served too, none dropped
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 400 for r in results)
    assert router.counts["queue_full"] >= 1


def test_refused_for_cost_answers_429_with_the_reason(monkeypatch):
    tiers = TierSet([Tier("std", 50, 1000)])
    router = Router(tiers, emulated_latency_model(), costly_share=0.06)
    monkeypatch.setattr(router, "submit", lambda routed, now: Decision(Outcome.COSTLY, retry_after_s=2.5))
    backend = RouterBackend(RouterService(router), "m", 4096, None)
    with ServerThread(build_app(backend)) as server:
        with pytest.raises(openai.RateLimitError) as err:
            openai_client(server).completions.create(model="m", prompt=[1, 2, 3], max_tokens=4)
        assert int(err.value.response.headers["retry-after"]) == 3
        assert "3-token prompt is among the tier's costliest:" in str(err.value)
    assert not backend.service.streams  # nothing of it is left behind


def test_no_instance_answers_503():
    tiers = TierSet([Tier("std", 50, 1000)])
    service = RouterService(Router(tiers, emulated_latency_model()))  # no launcher, no autoscaler, no engine
    backend = RouterBackend(service, "m", 4096, None)
    with ServerThread(build_app(backend)) as server:
        c = openai_client(server)
        with pytest.raises(openai.APIStatusError) as err:
            c.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4)
        assert err.value.status_code == 503 and "no engine instance" in str(err.value)
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{server.url}/health", timeout=10)
        assert health.value.code == 503
