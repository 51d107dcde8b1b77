"""Admission and failure answers of the HTTP API over an emulated engine (the default model's tokenizer and
shapes, no weights; each step sleeps a chosen time): idle-unattainable SLOs (400), a full queue (429 with
Retry-After), an engine failure before and after the first token (500 / an error event), no instance (503)."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from conftest import openai_client

from engine import EngineConfig, build_engine
from engine.api_server import ServerThread, build_app
from engine.engine_backend import EngineBackend

MODEL = "emulated"
PREFILL_FAILS = 7  # a prompt of this many tokens makes its prefill step raise
DECODE_FAILS = (11, 13)  # a prompt of 11 tokens makes the decode step at 13 KV tokens (its third token) raise
SLOW_PREFILL = 5  # a prompt of this many tokens takes a 1 s prefill step


class AffineStepTime:
    """Fixed cost + per prefill token + per decode sequence: a step time the test controls exactly."""

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        return 5e-3 + 0.05e-3 * num_prefill_tokens + 0.02e-3 * num_decode_seqs


AFFINE = AffineStepTime()


def step_time(num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int, num_seqs: int) -> float:
    if num_prefill_tokens == PREFILL_FAILS:
        raise RuntimeError("injected prefill failure")
    if num_prefill_tokens == 0 and num_decode_seqs == 1 and num_kv_tokens == DECODE_FAILS[1]:
        raise RuntimeError("injected decode failure")
    if num_prefill_tokens == SLOW_PREFILL:
        return 1.0
    return AFFINE.predict(num_prefill_tokens, num_decode_seqs, num_kv_tokens)


def make_server(default_model) -> tuple[ServerThread, EngineBackend]:
    config = EngineConfig(default_model, executor="emulated", num_kv_blocks=64,
                          tiers="t4:4:1000,std:50:1000,loose:200:10000", default_tier="loose")
    engine = build_engine(config, latency_model=AFFINE, step_time=step_time)
    # the emulated step time is exact, so admission can tell what an idle instance attains; tier t4 cannot be
    # (one decode step alone takes 5.02 ms)
    backend = EngineBackend(engine, MODEL, check_idle=True, max_pending=1, retry_after_s=2.5)
    return ServerThread(build_app(backend)), backend


@pytest.fixture(scope="module")
def served(default_model):
    server, backend = make_server(default_model)
    with server:
        yield server, backend


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[0])


def test_slo_unattainable_on_an_idle_instance_is_refused(served, client):
    with pytest.raises(openai.BadRequestError,
                       match=r"cannot be met even on an idle instance \(tpot: .* steady iteration 5\.0 ms"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"slo_tier": "t4"})
    with pytest.raises(openai.BadRequestError, match=r"idle instance \(ttft: predicted first token 5\.\d ms"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                  extra_body={"slo": {"ttft_ms": 5, "tpot_ms": 60}})
    # the same TPOT with a TTFT just above an idle prefill's is attainable, and served
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                  extra_body={"slo": {"ttft_ms": 6, "tpot_ms": 60}})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_full_queue_answers_429_with_retry_after(served, client):
    server, backend = served
    first: dict = {}
    slow = threading.Thread(target=lambda: first.update(r=client.completions.create(
        model=MODEL, prompt=[9] * SLOW_PREFILL, max_tokens=2)))
    slow.start()
    deadline = time.monotonic() + 10
    while backend.num_pending < 1:  # the slow request is admitted and has no token yet (for 1 s)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["Retry-After"] == "3"
    assert r.json()["error"]["code"] == "queue_full" and "waiting for their first token" in r.json()["error"]["message"]
    slow.join()
    assert first["r"].usage.completion_tokens == 2
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_engine_failure_before_first_token_is_a_500(served, client):
    for stream in (False, True):
        r = httpx.post(served[0].url + "/v1/completions",
                       json={"prompt": [3] * PREFILL_FAILS, "max_tokens": 4, "stream": stream})
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "generation failed: RuntimeError: injected prefill failure",
                                     "type": "server_error", "param": None, "code": "engine_error"}


def test_engine_failure_mid_stream_ends_with_an_error_event(served, client):
    stream = client.completions.create(model=MODEL, prompt=[3] * DECODE_FAILS[0], max_tokens=8, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="injected decode failure"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert len(texts) == 2  # two tokens went out before the failing step
    free, total = served[0].call(served[1].async_engine.call(
        lambda e: (e.blocks.num_free_blocks(), e.blocks.num_total_blocks)))
    assert free == total
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_no_instance_answers_503(default_model):
    server, backend = make_server(default_model)
    with server:
        assert httpx.get(server.url + "/health").status_code == 200
        server.call(backend.stop())
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "no_instance"
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"] == {"message": "the engine is not running", "type": "service_unavailable",
                                     "param": None, "code": "no_instance"}
