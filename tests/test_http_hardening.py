"""The HTTP front ends under what a public deployment sends them: steps counted past the bounded step history (engine
server and a two-engine router), a near-limit body parsed, and a near-limit prompt echoed with its logprobs, off the
event loop while other streams carry on, bodies refused before they are read, gauges that go back to idle, API keys,
and model folders as GGUF exports save them."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.backend import RouterBackend
from cluster.router import Router
from cluster.service import RouterService
from cluster.serve import parse_args as router_args
from cluster.worker import Worker
from engine import LLM, EngineConfig, SamplingParams, build_engine
from engine.api_server import DEFAULT_MAX_BODY_BYTES, ServerThread, build_app
from engine.engine_backend import EngineBackend
from engine.model_config import ModelConfig, ModelFolderError
from engine.serve import add_http_args
from engine.tokenizer import Tokenizer
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet

HISTORY = 8  # steps the engines keep; every test here runs many more
NEAR_LIMIT_CHARS = 3_800_000
FILLER = "The quick brown fox jumps over the lazy dog. "
WAIT_S = 60.0  # generous bound on waits for progress: a loaded machine is slow, a blocked loop never gets there


def fast_step(prefill: int, decodes: int, kv: int, seqs: int) -> float:
    return 0.002


def metric(url: str, name: str, headers: dict | None = None, **labels) -> float:
    """A sample's value on /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def wait_until(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def small_history_engine(model: str, **config):
    engine = build_engine(EngineConfig(model=model, executor="emulated", **config), step_time=fast_step)
    engine.step_stats = deque(maxlen=HISTORY)
    return engine


class StreamReader:
    """A streaming completion read on a thread of its own: the receive count of its chunks, and how it ended."""

    def __init__(self, url: str, body: dict, headers: dict | None = None):
        self.chunks: list[dict] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, body, headers), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict, headers: dict | None) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                              timeout=WAIT_S) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks.append(json.loads(line[6:]))
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def tokens(self, n: int) -> None:
        wait_until(lambda: len(self.chunks) >= n or self.done.is_set(), f"{n} chunks")
        assert len(self.chunks) >= n, self.error

    def finish(self) -> str:
        assert self.done.wait(WAIT_S) and self.error is None, self.error
        return self.chunks[-1]["choices"][0]["finish_reason"]


# ---- steps past the bounded history ------------------------------------------------------------------------------
def test_engine_server_metrics_count_every_step_past_the_history(llama_tiny):
    engine = small_history_engine(llama_tiny[0], num_kv_blocks=64)
    with ServerThread(build_app(EngineBackend(engine, "m"))) as server:
        counts = []
        for round_ in range(3):
            stream = StreamReader(server.url, {"prompt": [1, 2, 3], "max_tokens": 3 * HISTORY})
            assert stream.finish() == "length"
            wait_until(lambda: metric(server.url, "polyserve_iteration_time_seconds_count") == engine.num_steps,
                       "every step on /metrics")
            counts.append(metric(server.url, "polyserve_iteration_time_seconds_count"))
        assert counts[0] > HISTORY and counts[0] < counts[1] < counts[2]
        assert len(engine.step_stats) == HISTORY


def test_router_hears_every_step_of_each_engine_past_the_history(llama_tiny):
    """Two in-process workers whose engines keep a short history, attached to the router service; each takes one
    tier's requests, and the router's view of each keeps receiving its step reports."""
    tiers = TierSet([Tier("a", 1000, 10000), Tier("b", 2000, 20000)])
    service = RouterService(Router(tiers, emulated_latency_model()))
    engines = [small_history_engine(llama_tiny[0], num_kv_blocks=64, tiers="a:1000:10000,b:2000:20000")
               for _ in range(2)]
    workers = [Worker(e, instance_id=f"w{i}", token=service.token, heartbeat_s=0.2) for i, e in enumerate(engines)]
    server = ServerThread(build_app(RouterBackend(service, "m", 1024, None)))
    try:
        ids = []
        for worker in workers:
            port = server.call(worker.start())
            ids.append(server.call(service.attach("127.0.0.1", port)))
        seen = {i: [] for i in ids}
        for round_ in range(3):
            streams = [StreamReader(server.url, {"prompt": [1, 2, 3], "max_tokens": 3 * HISTORY, "slo_tier": t})
                       for t in ("a", "b")]
            assert [s.finish() for s in streams] == ["length", "length"]
            for instance, engine in zip(ids, engines):
                wait_until(lambda: metric(server.url, "polyserve_iteration_time_seconds_count",
                                          instance=instance) == engine.num_steps, f"every step of {instance}")
                seen[instance].append(metric(server.url, "polyserve_iteration_time_seconds_count", instance=instance))
        for counts in seen.values():
            assert counts[0] > HISTORY and counts[0] < counts[1] < counts[2]
        assert all(len(e.step_stats) == HISTORY for e in engines)
    finally:
        for worker in workers:
            server.call(worker.stop())
        server.close()


# ---- near-limit work off the event loop ---------------------------------------------------------------------------
class GatedTokenizer:
    """The model's tokenizer, whose `gated` work waits for the test's word: chat templating (the request is in the
    middle of being parsed) or decoding one token (its logprobs are being detokenized). `encoded` counts what was
    tokenized outright; `token_decodes` the one-token decodes of each thread, by its name."""

    def __init__(self, inner: Tokenizer, gated: str):
        if gated not in ("apply_chat_template", "decode"):
            raise ValueError(f"nothing to gate named {gated!r}")
        self.inner, self.gated = inner, gated
        self.entered, self.release = threading.Event(), threading.Event()
        self.encoded = 0
        self.token_decodes: Counter[str] = Counter()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _hold(self, work: str) -> None:
        if work == self.gated:
            self.entered.set()
            assert self.release.wait(WAIT_S)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        self._hold("apply_chat_template")
        return self.inner.apply_chat_template(messages)

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return self.inner.encode(text)

    def decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            self.token_decodes[threading.current_thread().name] += 1
            self._hold("decode")
        return self.inner.decode(ids)


@pytest.fixture
def gated_server(default_model, request):
    """A server on an emulated engine of the default model, the HTTP layer's tokenizer gated at `request.param`
    (chat templating unless told)."""
    step = lambda *_: 0.005  # noqa: E731
    # room for a prompt of the whole context beside another stream
    engine = build_engine(EngineConfig(model=default_model, executor="emulated", num_kv_blocks=1024), step_time=step)
    backend = EngineBackend(engine, "m")
    backend.tokenizer = gate = GatedTokenizer(engine.tokenizer, getattr(request, "param", "apply_chat_template"))
    server = ServerThread(build_app(backend))
    try:
        yield server, gate
    finally:
        gate.release.set()
        server.close()


def run_held_at_the_gate(server: ServerThread, gate: GatedTokenizer, what: str, call, *args, **kwargs):
    """`call(*args, **kwargs)` run on a thread beside another stream. While the gate holds it, the event loop is
    free: /health answers and the other stream carries on. Its result once released, the other stream finished."""
    stream = StreamReader(server.url, {"prompt": [1, 2, 3], "max_tokens": 2000})
    stream.tokens(5)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, *args, **kwargs)
        assert gate.entered.wait(WAIT_S), f"{what} never reached the gate"
        assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 200
        before = len(stream.chunks)
        stream.tokens(before + 20)
        assert not held.done() and not stream.done.is_set()
        gate.release.set()
        result = held.result(WAIT_S)
    assert stream.finish() == "length"
    return result


def test_streams_and_health_carry_on_while_a_near_limit_body_is_parsed(gated_server):
    server, gate = gated_server
    body = json.dumps({"messages": [{"role": "user", "content": FILLER * (NEAR_LIMIT_CHARS // len(FILLER))}],
                       "max_tokens": 8}).encode()
    assert DEFAULT_MAX_BODY_BYTES - 500_000 < len(body) < DEFAULT_MAX_BODY_BYTES
    answer = run_held_at_the_gate(server, gate, "the big request's chat template", httpx.post,
                                  server.url + "/v1/chat/completions", content=body,
                                  headers={"Content-Type": "application/json"}, timeout=WAIT_S)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"


def completion_of(url: str, body: dict) -> tuple[str, dict]:
    """A completion's text and logprobs object; streamed, its chunks' joined."""
    if not body.get("stream"):
        r = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]
    text, logprobs = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                for key, values in (choice["logprobs"] or {}).items():
                    logprobs[key] += values
    return text, logprobs


@pytest.mark.parametrize("gated_server", ["decode"], indirect=True)
def test_streams_and_health_carry_on_while_an_echoed_near_limit_prompt_is_detokenized(gated_server):
    """echo with logprobs of a prompt of the whole context: every prompt token's text and its alternatives'. While
    that detokenizing waits, /health answers and another stream carries on; the prompt's tokens were decoded on
    worker threads, and the answer, streamed or whole, is the prompt's."""
    server, gate = gated_server
    context = 8192  # the default model's
    output_tokens, alternatives = 4, 5
    prompt = (gate.inner.encode(FILLER) * context)[:context - output_tokens]
    body = {"prompt": prompt, "max_tokens": output_tokens, "echo": True, "logprobs": alternatives, "stream": True}
    streamed = run_held_at_the_gate(server, gate, "the echoed prompt's detokenizing", completion_of, server.url, body)
    whole = completion_of(server.url, {**body, "stream": False})
    n = len(prompt)
    decodes = gate.token_decodes.copy()
    # the event loop decoded at most the streamed output tokens after the first, each with its alternatives
    assert decodes.pop("http-server", 0) <= output_tokens * (alternatives + 1), gate.token_decodes
    assert all(name.startswith("http-parse") for name in decodes) and decodes.total() > 2 * n, gate.token_decodes
    assert streamed == whole
    text, logprobs = whole
    assert text.startswith(gate.inner.decode(prompt)) and len(logprobs["tokens"]) == n + output_tokens
    assert logprobs["tokens"][:n] == [gate.inner.decode([t]) for t in prompt]
    assert logprobs["text_offset"] == [0, *accumulate(map(len, logprobs["tokens"][:-1]))]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp == 0.0 for lp in logprobs["token_logprobs"][1:])  # the emulated executor's tokens are certain
    # its alternatives to a token are the ids that follow it
    assert [set(top) for top in logprobs["top_logprobs"][1:n]] == \
        [{gate.inner.decode([t + j]) for j in range(alternatives)} for t in prompt[1:]]


def test_a_prompt_far_over_the_context_is_refused_without_tokenizing(gated_server):
    server, gate = gated_server
    r = httpx.post(server.url + "/v1/completions", json={"prompt": FILLER * (NEAR_LIMIT_CHARS // len(FILLER)),
                                                         "max_tokens": 8}, timeout=WAIT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert gate.encoded == 0
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "A short one", "max_tokens": 2}, timeout=WAIT_S)
    assert r.status_code == 200 and gate.encoded == 1


def test_token_lower_bound_holds_and_is_withheld_where_text_may_shrink(default_model, tmp_path):
    tok = Tokenizer(default_model)
    texts = [" " * 5000, "\n" * 3000, "é" * 3000, "<|im_start|>" * 100, "🙂a" * 1000,
             "".join(chr(c) for c in range(32, 0x2000)), FILLER * 100]
    for text in texts:
        assert 0 < tok.min_num_tokens(text) <= len(tok.encode(text))
    assert tok.min_num_tokens(FILLER * (NEAR_LIMIT_CHARS // len(FILLER))) > 8192  # the model's whole context
    spec = json.loads(open(f"{default_model}/tokenizer.json").read())
    spec["normalizer"] = {"type": "NFC"}  # composes characters: the text may shrink before it is tokenized
    folder = tmp_path / "nfc"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(f"{default_model}/tokenizer_config.json", folder)
    nfc = Tokenizer(folder)
    assert nfc.max_bytes_per_token is None and nfc.min_num_tokens("x" * 100_000) == 0


def test_body_over_the_limit_is_refused_before_it_is_read(llama_tiny):
    engine = small_history_engine(llama_tiny[0], num_kv_blocks=64)
    with ServerThread(build_app(EngineBackend(engine, "m"), client_max_size=1 << 20)) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as s:
            # the headers announce 50 MB and none of it follows: a server that read first would wait for ever
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 50000000\r\n\r\n")
            head = s.recv(65536).decode()
        assert head.startswith("HTTP/1.1 413")
        assert '"code":"request_too_large"' in head and "50000000" in head
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=WAIT_S)
        assert r.status_code == 200


# ---- gauges when idle ---------------------------------------------------------------------------------------------
def test_gauges_return_to_idle_after_aborts(llama_tiny):
    engine = build_engine(EngineConfig(model=llama_tiny[0], executor="emulated", num_kv_blocks=64, max_num_seqs=1),
                          step_time=lambda *_: 0.01)
    with ServerThread(build_app(EngineBackend(engine, "m"))) as server:
        gauges = ("polyserve_requests_running", "polyserve_requests_waiting", "polyserve_kv_cache_usage_ratio")

        def values():
            return [metric(server.url, g, instance="0") for g in gauges]

        body = json.dumps({"prompt": list(range(1, 40)), "max_tokens": 500, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        clients = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) for _ in range(2)]
        for c in clients:
            c.sendall(request)
        wait_until(lambda: values()[:2] == [1, 1], "one running, one waiting")
        assert values()[2] > 0
        for c in clients:  # both clients leave: both requests are aborted, and no step follows to report it
            c.close()
        wait_until(lambda: values() == [0, 0, 0], "the gauges of an idle engine")
        assert not engine.has_unfinished()


# ---- API keys -----------------------------------------------------------------------------------------------------
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed(llama_tiny):
    engine = small_history_engine(llama_tiny[0], num_kv_blocks=64)
    with ServerThread(build_app(EngineBackend(engine, "m"), api_key=KEY)) as server:
        yield server


def test_openai_client_needs_the_key(keyed):
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0).completions.create(
            model="m", prompt=[1, 2], max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="m", prompt=[1, 2], max_tokens=2).choices[0].finish_reason == "length"
    assert [m.id for m in good.models.list()] == ["m"]


@pytest.mark.parametrize("authorization,status", [
    (None, 401), ("Bearer", 401), ("Bearer sk-test", 401), (f"Basic {KEY}", 401), (f"Bearer {KEY}x", 401),
    (f"Bearer {KEY}", 200), (f"bearer {KEY}", 200)])
def test_raw_requests_by_authorization_header(keyed, authorization, status):
    async def main():
        import aiohttp

        headers = {} if authorization is None else {"Authorization": authorization}
        async with aiohttp.ClientSession() as session:
            out = {}
            for path in ("/v1/models", "/metrics", "/health"):
                async with session.get(keyed.url + path, headers=headers) as r:
                    out[path] = (r.status, await r.read(), r.headers.get("WWW-Authenticate"))
            async with session.post(keyed.url + "/v1/completions", headers=headers,
                                    json={"prompt": [1, 2], "max_tokens": 2}) as r:
                out["post"] = (r.status, await r.read(), r.headers.get("WWW-Authenticate"))
            return out

    out = asyncio.run(main())
    assert out["/health"][0] == 200
    for path in ("/v1/models", "/metrics", "post"):
        code, body, challenge = out[path]
        assert code == status, (path, body)
        if status == 401:
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error", error
            assert challenge == "Bearer"


def test_metrics_left_open_and_unkeyed_public_bind_warns(llama_tiny, caplog):
    engine = small_history_engine(llama_tiny[0], num_kv_blocks=64)
    with ServerThread(build_app(EngineBackend(engine, "m"), api_key=KEY, metrics_open=True)) as server:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 401
    with caplog.at_level(logging.WARNING, logger="engine.api_server"):
        ServerThread(build_app(EngineBackend(engine, "m"), api_key=KEY), host="0.0.0.0").close()
        assert not [r for r in caplog.records if "without an API key" in r.message]
        ServerThread(build_app(EngineBackend(engine, "m")), host="0.0.0.0").close()
        assert [r for r in caplog.records if "without an API key" in r.message]


def test_api_key_flag_and_environment(monkeypatch):
    def engine_args(argv):
        ap = argparse.ArgumentParser()
        add_http_args(ap)
        return ap.parse_args(argv)

    monkeypatch.delenv("POLYSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert engine_args([]).api_key is None and router_args([]).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert engine_args([]).api_key == "from-vllm" == router_args([]).api_key
    monkeypatch.setenv("POLYSERVE_API_KEY", "ours")
    assert engine_args([]).api_key == "ours" == router_args([]).api_key
    assert engine_args(["--api-key", "flag"]).api_key == "flag" == router_args(["--api-key", "flag"]).api_key
    assert router_args(["--metrics-open"]).metrics_open and not engine_args([]).metrics_open


# ---- model folders ------------------------------------------------------------------------------------------------
def test_config_without_architectures_is_read_from_model_type(llama_tiny, tmp_path):
    """As transformers saves a model loaded from GGUF: no `architectures`, only `model_type`."""
    folder = tmp_path / "from-gguf"
    shutil.copytree(llama_tiny[0], folder)
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("architectures") == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    (folder / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_folder(folder).architecture == "LlamaForCausalLM"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(llama_tiny[0], num_kv_blocks=32).generate([[5, 6, 7]], greedy)[0].token_ids
    assert LLM(str(folder), num_kv_blocks=32).generate([[5, 6, 7]], greedy)[0].token_ids == want
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelFolderError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_folder(folder)


def test_tokenizer_decodes_without_the_clean_up_warning(default_model):
    code = ("from engine.tokenizer import Tokenizer; import sys; t = Tokenizer(sys.argv[1]); "
            "print(repr(t.decode(t.encode('Hello , world .'))))")
    out = subprocess.run([sys.executable, "-c", code, default_model], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "'Hello , world .'"  # spaces before punctuation kept, as BPE decodes them
    assert "clean_up_tokenization_spaces" not in out.stderr
