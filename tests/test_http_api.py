"""The OpenAI-compatible HTTP API over the real default model on the CPU, driven by the official `openai` client:
greedy text equal to the offline `LLM`, SLO fields in body and headers, every bad input with its status and reason,
a client disconnect freeing the request's KV, and /metrics after traffic."""
from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import openai_client

from engine import LLM, SamplingParams
from engine.api_server import ServerThread, build_app
from engine.engine_backend import EngineBackend

MODEL = "smollm2-test"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a primary color."}]
MAX_TOKENS = 8
MAX_MODEL_LEN = 512
MAX_BODY = 64 << 10
TIERS = "fast:500:20000,slow:5000:60000"  # loose: CPU steps under load take ~0.1-0.4 s


@pytest.fixture(scope="module")
def served(default_model):
    """(server, backend, offline references). References are computed first, on the same engine, before its step
    loop starts: the engine is single-threaded."""
    llm = LLM(default_model, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, tiers=TIERS, default_tier="slow")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=True)
    refs = {"completion": llm.generate(PROMPT, greedy)[0], "chat": llm.chat(CHAT, greedy)[0],
            "stop": llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["."]))[0]}
    backend = EngineBackend(llm.engine, MODEL)
    with ServerThread(build_app(backend, client_max_size=MAX_BODY)) as server:
        yield server, backend, refs


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[0])


def metric(server, name: str, **labels) -> float:
    """A sample's value on /metrics (0 when absent)."""
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_completion_equals_offline_greedy_with_logprobs(served, client):
    ref = served[2]["completion"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    choice = r.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == ref.text


def test_completion_stream_with_usage_and_slo_tier(served, client):
    ref = served[2]["completion"]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"slo_tier": "fast"}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompt_and_stop_string(served, client):
    refs = served[2]
    r = client.completions.create(model=MODEL, prompt=refs["completion"].prompt_token_ids, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == refs["completion"].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=".")
    assert refs["stop"].finish_reason == "stop"
    assert (r.choices[0].text, r.choices[0].finish_reason) == (refs["stop"].text, "stop")


def test_chat_equals_offline_with_body_slo(served, client):
    ref = served[2]["chat"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, extra_body={"slo": {"ttft_ms": 20000, "tpot_ms": 600}})
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(ref.logprobs, abs=1e-4)


def test_chat_stream_with_slo_headers(served, client):
    ref = served[2]["chat"]
    before = metric(served[0], "polyserve_slo_requests_total", tier="fast")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_headers={"x-slo-ttft-ms": "20000", "x-slo-tpot-ms": "500"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # tpot 500 ms joins tier fast (500 ms), not slow
    assert metric(served[0], "polyserve_slo_requests_total", tier="fast") == before + 1


def _post(server, path: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server.url + path, json=body, headers=headers, timeout=60)
    return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json",
                                                                **(headers or {})}, timeout=60)


OK = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
CHAT_OK = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
BAD_INPUTS = [  # (id, path, body, headers, status, code, words in the message)
    ("malformed-json", "/v1/completions", b'{"prompt": "x",', None, 400, "invalid_json", "not valid JSON"),
    ("not-an-object", "/v1/completions", b"[1, 2]", None, 400, "invalid_field", "Expected `object`"),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, None, 400, "invalid_field", "`prompt`"),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL}, None, 400, "invalid_field", "`messages`"),
    ("empty-messages", "/v1/chat/completions", {**CHAT_OK, "messages": []}, None, 400, "invalid_field",
     "$.messages"),
    ("message-not-object", "/v1/chat/completions", {**CHAT_OK, "messages": ["hi"]}, None, 400, "invalid_field",
     "$.messages[0]"),
    ("image-content", "/v1/chat/completions",
     {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400, "invalid_field",
     "only text"),
    ("max-tokens-string", "/v1/completions", {**OK, "max_tokens": "8"}, None, 400, "invalid_field",
     "$.max_tokens"),
    ("max-tokens-negative", "/v1/completions", {**OK, "max_tokens": -3}, None, 400, "invalid_field",
     "$.max_tokens"),
    ("max-tokens-absurd", "/v1/completions", {**OK, "max_tokens": 10 ** 12}, None, 400,
     "context_length_exceeded", "exceeds the context length of 512"),
    ("temperature-too-high", "/v1/completions", {**OK, "temperature": 7}, None, 400, "invalid_field",
     "$.temperature"),
    ("prompt-wrong-type", "/v1/completions", {**OK, "prompt": {"text": "x"}}, None, 400, "invalid_field",
     "$.prompt"),
    ("prompt-empty", "/v1/completions", {**OK, "prompt": ""}, None, 400, "invalid_field", "empty"),
    ("prompt-batch", "/v1/completions", {**OK, "prompt": ["a", "b"]}, None, 400, "invalid_field", "one prompt"),
    ("prompt-token-outside-vocab", "/v1/completions", {**OK, "prompt": [1, 10 ** 7]}, None, 400,
     "invalid_request", "outside the vocabulary"),
    ("prompt-over-context", "/v1/completions", {**OK, "prompt": [1] * MAX_MODEL_LEN}, None, 400,
     "context_length_exceeded", "no room for output"),
    ("n-over-openai-bound", "/v1/completions", {**OK, "n": 129}, None, 400, "invalid_field", "$.n"),
    ("unknown-model", "/v1/completions", {**OK, "model": "gpt-9"}, None, 404, "model_not_found", "gpt-9"),
    ("unknown-tier", "/v1/completions", {**OK, "slo_tier": "platinum"}, None, 400, "invalid_slo",
     "unknown tier 'platinum'"),
    ("unknown-tier-header", "/v1/chat/completions", CHAT_OK, {"x-slo-tier": "gold"}, 400, "invalid_slo",
     "unknown tier 'gold'"),
    ("slo-tpot-tighter-than-every-tier", "/v1/completions", {**OK, "slo": {"ttft_ms": 20000, "tpot_ms": 1}},
     None, 400, "invalid_slo", "tighter than the tightest tier"),
    ("slo-negative", "/v1/completions", {**OK, "slo": {"ttft_ms": -1, "tpot_ms": 600}}, None, 400,
     "invalid_field", "$.slo.ttft_ms"),
    ("slo-twice", "/v1/completions", {**OK, "slo_tier": "fast"}, {"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "600"},
     400, "invalid_slo", "give the SLO once"),
    ("slo-header-half", "/v1/chat/completions", CHAT_OK, {"x-slo-ttft-ms": "100"}, 400, "invalid_slo",
     "go together"),
    ("slo-header-not-number", "/v1/chat/completions", CHAT_OK, {"x-slo-ttft-ms": "soon", "x-slo-tpot-ms": "600"},
     400, "invalid_slo", "'soon'"),
    ("body-too-large", "/v1/completions", {**OK, "prompt": "x" * (MAX_BODY + 1)}, None, 413, "request_too_large",
     "exceeded"),
    ("unknown-route", "/v1/embeddings", OK, None, 404, "not_found", ""),
]


@pytest.mark.parametrize("path,body,headers,status,code,words", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_status_and_reason(served, path, body, headers, status, code, words):
    r = _post(served[0], path, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and words in error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_good_request_after_bad_ones_and_openai_client_errors(served, client):
    with pytest.raises(openai.BadRequestError, match="unknown tier"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"slo_tier": "nope"})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT, max_tokens=1)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].text == served[2]["completion"].text[:len(r.choices[0].text)] and r.usage.completion_tokens == 2
    assert httpx.get(served[0].url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def _kv_state(server, backend) -> tuple[int, int, int]:
    """(free blocks, total blocks, live requests), read on the engine thread between steps."""
    return server.call(backend.async_engine.call(
        lambda e: (e.blocks.num_free_blocks(), e.blocks.num_total_blocks, len(e.requests))))


def _wait_freed(server, backend, total: int) -> None:
    deadline = time.monotonic() + 30
    while (state := _kv_state(server, backend)) != (total, total, 0):
        assert time.monotonic() < deadline, f"KV not freed after the client left: {state}"
        time.sleep(0.05)


def test_client_disconnect_mid_stream_frees_kv(served, client):
    server, backend, _ = served
    aborts = metric(server, "polyserve_requests_finished_total", reason="abort")
    stream = client.completions.create(model=MODEL, prompt="Count to one hundred: 1, 2, 3,", max_tokens=200,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    free, total, live = _kv_state(server, backend)
    assert live == 1 and free < total  # the request is running and holds KV
    stream.close()
    _wait_freed(server, backend, total)
    assert metric(server, "polyserve_requests_finished_total", reason="abort") == aborts + 1


def test_client_disconnect_while_waiting_for_a_whole_response_frees_kv(served):
    server, backend, _ = served
    aborts = metric(server, "polyserve_requests_finished_total", reason="abort")
    body = json.dumps({"prompt": "Count to one hundred: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while (state := _kv_state(server, backend))[2] == 0 or state[0] == state[1]:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    _wait_freed(server, backend, state[1])
    assert metric(server, "polyserve_requests_finished_total", reason="abort") == aborts + 1


def test_metrics_after_traffic(served, client):
    server = served[0]
    names = ("polyserve_time_to_first_token_seconds_count", "polyserve_request_tpot_seconds_count",
             "polyserve_request_queue_time_seconds_count", "polyserve_slo_requests_total")
    before = {n: metric(server, n, tier="fast") for n in names}
    steps = metric(server, "polyserve_iteration_time_seconds_count", instance="0")
    gaps = metric(server, "polyserve_inter_token_latency_seconds_count", tier="fast")
    attained = metric(server, "polyserve_slo_attained_total", tier="fast", view="cumulative")
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                              extra_body={"slo_tier": "fast"})
    for n in names:
        assert metric(server, n, tier="fast") == before[n] + 1, n
    assert metric(server, "polyserve_inter_token_latency_seconds_count", tier="fast") == gaps + 2
    assert metric(server, "polyserve_iteration_time_seconds_count", instance="0") >= steps + 3
    assert metric(server, "polyserve_batch_size_count", instance="0") >= steps + 3
    # 3 tokens due by 20 s + 2 * 0.5 s on an otherwise idle server: attained (the per-gap views may miss on a
    # loaded CPU, so only their bound is checked)
    assert metric(server, "polyserve_slo_attained_total", tier="fast", view="cumulative") == \
        attained + 1
    for view in ("mean_tpot", "max_gap"):
        assert metric(server, "polyserve_slo_attained_total", tier="fast", view=view) <= before[names[3]] + 1
    assert metric(server, "polyserve_instances", tier="slow") == 1
    assert metric(server, "polyserve_kv_cache_usage_ratio", instance="0") >= 0
    assert metric(server, "polyserve_http_requests_total", endpoint="/v1/completions", status="200") >= 1
