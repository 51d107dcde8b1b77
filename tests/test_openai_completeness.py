"""OpenAI completeness: top-k logprobs and prompt logprobs against transformers on the same tiny model, parallel
samples (n) sharing their prompt's KV blocks, and, over HTTP with the official client and raw JSON on the engine
server and through the router, logprobs / top_logprobs, echo, n, and a 400 naming every unsupported field."""
from __future__ import annotations


import pytest

from conftest import openai_client, serving_fleet
import torch

from engine import LLM, SamplingParams

PROMPT = [5, 9, 200, 17, 33, 101, 7, 250, 3, 64, 12, 8, 190, 44, 2, 77, 150, 6, 91]  # 19 tokens: a block and a bit


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids` [len, V]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_top_logprobs_equal_transformers(llama_tiny, temperature):
    folder, hf = llama_tiny
    llm = LLM(folder, num_kv_blocks=64)
    out = llm.generate(PROMPT, SamplingParams(temperature=temperature, seed=3, max_tokens=6, ignore_eos=True,
                                              logprobs=True, top_logprobs=5))[0]
    expected = hf_logprobs(hf, PROMPT + out.token_ids)[len(PROMPT) - 1:-1]  # the positions that chose each token
    assert len(out.top_logprobs) == len(out.logprobs) == len(out.token_ids) == 6
    for i, (token, logprob, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        values, ids = expected[i].topk(5)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=0)
        assert logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, logprobs=True))[0]
    assert plain.top_logprobs is None and plain.prompt_logprobs is None


def test_prompt_logprobs_equal_transformers_across_chunks_and_past_the_prefix_cache(llama_tiny):
    folder, hf = llama_tiny
    llm = LLM(folder, num_kv_blocks=64, max_num_batched_tokens=7, batch_policy="fcfs")  # a 19-token prompt: 3 chunks
    cached = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0]  # its first block is cached now
    out = llm.generate([PROMPT, PROMPT[:10]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=True,
                                                              logprobs=True, top_logprobs=3))
    assert out[0].num_cached_tokens == 0 and out[0].token_ids == cached.token_ids
    for prompt, o in zip([PROMPT, PROMPT[:10]], out):
        expected = hf_logprobs(hf, prompt)[:-1]  # position j-1 predicts prompt token j
        assert o.prompt_logprobs[0] is None and o.prompt_top_logprobs[0] is None
        assert len(o.prompt_logprobs) == len(o.prompt_top_logprobs) == len(prompt)
        want = expected.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(o.prompt_logprobs[1:]), want, atol=1e-4, rtol=0)
        for j, top in enumerate(o.prompt_top_logprobs[1:]):
            values, ids = expected[j].topk(3)
            assert [t for t, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=0)


def test_prompt_logprobs_survive_preemption(llama_tiny):
    folder, hf = llama_tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (30, 31, 29, 28)]
    # 4 sequences of up to 54 tokens need 16 blocks of 16; 9 force preemption
    llm = LLM(folder, num_kv_blocks=9, max_num_batched_tokens=256, batch_policy="fcfs")
    preempted = []
    original = llm.engine._preempt
    llm.engine._preempt = lambda r: (preempted.append(r.request_id), original(r))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=True))
    assert preempted
    for prompt, out in zip(prompts, outs):
        expected = hf_logprobs(hf, prompt + out.token_ids)
        assert out.token_ids == expected[len(prompt) - 1:-1].argmax(-1).tolist()
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        want = expected[:len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-4, rtol=0)
    assert llm.engine.blocks.num_free_blocks() == 9


# ---- over HTTP: the engine server and the router, the real default model on the CPU ---------------------------------
import httpx  # noqa: E402
import openai  # noqa: E402

from engine.api_server import ServerThread, build_app  # noqa: E402
from engine.engine_backend import EngineBackend  # noqa: E402

MODEL = "smollm2-test"
TEXT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a primary color."}]
TIERS = "fast:500:20000,slow:5000:60000"  # loose: CPU steps under load take ~0.1-0.4 s
MAX_MODEL_LEN = 512
TOKENS = 6


@pytest.fixture(scope="module")
def offline(default_model):
    """The engine and its references: computed before any server steps it (the engine is single-threaded)."""
    llm = LLM(default_model, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, tiers=TIERS, default_tier="slow")
    greedy = dict(temperature=0, max_tokens=TOKENS)
    refs = {"completion": llm.generate(TEXT, SamplingParams(**greedy, logprobs=True, top_logprobs=3,
                                                            prompt_logprobs=True))[0],
            "chat": llm.chat(CHAT, SamplingParams(**greedy, logprobs=True, top_logprobs=5))[0]}
    return llm, refs


@pytest.fixture(scope="module", params=["engine", "router"])
def served(request, offline, default_model):
    """(server URL, the engine backend or None for the router)."""
    llm = offline[0]
    if request.param == "engine":
        backend = EngineBackend(llm.engine, MODEL)
        with ServerThread(build_app(backend)) as server:
            yield server, backend
        return
    with serving_fleet([
            "--model", default_model, "--executor", "model", "--num-kv-blocks", "64", "--max-model-len",
            str(MAX_MODEL_LEN), "--tiers", TIERS, "--default-tier", "slow", "--min-instances", "1", "--max-instances",
            "1", "--idle-pool", "0", "--served-model-name", MODEL], timeout_s=120) as (server, _):
        yield server, None


def text_of(llm, token: int) -> str:
    return llm.tokenizer.decode([token])


def test_completion_top_logprobs_whole_and_streamed(served, offline):
    llm, ref, client = offline[0], offline[1]["completion"], openai_client(served[0])
    kwargs = dict(model=MODEL, prompt=TEXT, max_tokens=TOKENS, temperature=0, logprobs=3)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [(tok, lp, top, off) for c in chunks if c.logprobs for tok, lp, top, off in zip(
        c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.logprobs.text_offset)]
    assert whole.text == ref.text == "".join(c.text for c in chunks)
    got = list(zip(whole.logprobs.tokens, whole.logprobs.token_logprobs, whole.logprobs.top_logprobs,
                   whole.logprobs.text_offset))
    assert len(got) == len(streamed) == TOKENS
    offset = 0
    for (tok, lp, top, off), s, token, logprob, alts in zip(got, streamed, ref.token_ids, ref.logprobs,
                                                            ref.top_logprobs):
        assert tok == s[0] == text_of(llm, token) and off == s[3] == offset
        offset += len(tok)
        assert lp == pytest.approx(logprob, abs=1e-4) and s[1] == pytest.approx(logprob, abs=1e-4)
        # the 3 alternatives and the chosen token (greedy: the first alternative)
        want = {text_of(llm, t): v for t, v in alts}
        assert top.keys() == s[2].keys() == want.keys() and len(alts) == 3
        assert list(top.values()) == pytest.approx(list(want.values()), abs=1e-4)


def test_chat_top_logprobs_whole_and_streamed(served, offline):
    llm, ref, client = offline[0], offline[1]["chat"], openai_client(served[0])
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=TOKENS, temperature=0, logprobs=True, top_logprobs=5)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert whole.message.content == ref.text == "".join(c.delta.content or "" for c in chunks)
    streamed = [entry for c in chunks if c.logprobs for entry in c.logprobs.content]
    for entries in (whole.logprobs.content, streamed):
        assert len(entries) == TOKENS
        for entry, token, logprob, alts in zip(entries, ref.token_ids, ref.logprobs, ref.top_logprobs):
            assert entry.token == text_of(llm, token) and entry.logprob == pytest.approx(logprob, abs=1e-4)
            assert [a.token for a in entry.top_logprobs] == [text_of(llm, t) for t, _ in alts]
            assert [a.logprob for a in entry.top_logprobs] == pytest.approx([v for _, v in alts], abs=1e-4)
            assert entry.top_logprobs[0].bytes == list(entry.top_logprobs[0].token.encode())


def test_echo_returns_the_prompt_and_its_logprobs(served, offline):
    llm, ref, client = offline[0], offline[1]["completion"], openai_client(served[0])
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=TOKENS, temperature=0, echo=True)
    assert plain.choices[0].text == TEXT + ref.text and plain.choices[0].logprobs is None
    kwargs = dict(model=MODEL, prompt=TEXT, max_tokens=TOKENS, temperature=0, echo=True, logprobs=3)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert whole.text == "".join(c.text for c in chunks) == TEXT + ref.text
    assert chunks[0].text.startswith(TEXT)
    prompt_ids = ref.prompt_token_ids
    for lp in (whole.logprobs, chunks[0].logprobs):
        n = len(prompt_ids)
        assert lp.tokens[:n] == [text_of(llm, t) for t in prompt_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert lp.token_logprobs[1:n] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
        for top, alts, token, value in zip(lp.top_logprobs[1:n], ref.prompt_top_logprobs[1:], prompt_ids[1:],
                                           ref.prompt_logprobs[1:]):
            want = {**{text_of(llm, t): v for t, v in alts}, text_of(llm, token): value}
            assert top.keys() == want.keys()
            assert list(top.values()) == pytest.approx([want[k] for k in top], abs=1e-4)
    assert whole.logprobs.token_logprobs[len(prompt_ids):] == pytest.approx(ref.logprobs, abs=1e-4)


def test_n_parallel_samples(served, offline):
    c = openai_client(served[0])
    kwargs = dict(model=MODEL, prompt=TEXT, max_tokens=8, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})
    first = c.completions.create(**kwargs)
    again = c.completions.create(**kwargs)
    texts = [ch.text for ch in sorted(first.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [ch.text for ch in again.choices] == texts  # seeded: reproducible, each sample its own seed
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == again.usage.prompt_tokens
    by_index: dict[int, str] = {}
    finished = set()
    for chunk in c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for ch in chunk.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finished.add(ch.index)
        if not chunk.choices:
            assert chunk.usage.completion_tokens == 24
    assert [by_index[i] for i in range(3)] == texts and finished == {0, 1, 2}
    greedy = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=TOKENS, temperature=0, n=2)
    ref = offline[1]["chat"]
    assert [ch.message.content for ch in greedy.choices] == [ref.text] * 2
    assert greedy.usage.completion_tokens == 2 * len(ref.token_ids)


def test_n_samples_share_the_prompt_blocks(served):
    server, backend = served
    if backend is None:
        pytest.skip("the router's instances are separate processes: the engine server shows the blocks")
    used_with_three: list[int] = []  # KV blocks in use at every step that ran all three samples
    hook = lambda stats: used_with_three.append(stats.num_blocks_used) if stats.num_running == 3 else None  # noqa
    server.call(backend.async_engine.call(lambda e: e.step_hooks.append(hook)))
    try:
        prompt = list(range(1000, 1066))  # 4 full blocks of 16 and 2 tokens: with 10 more, 5 blocks each
        r = openai_client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, n=3,
                                                     extra_body={"ignore_eos": True})
    finally:
        server.call(backend.async_engine.call(lambda e: e.step_hooks.remove(hook)))
    assert r.usage.completion_tokens == 30
    # the 4 prompt blocks once, and one block of each sample's own (unshared: 15)
    assert used_with_three and set(used_with_three) == {4 + 3}


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
COMPLETION_BODY = {"model": MODEL, "prompt": TEXT, "max_tokens": 1}
REFUSED = [  # (id, body, words in the message)
    ("tools", {**CHAT_BODY, "tools": [TOOL]}, "tools is not supported"),
    ("tool_choice", {**CHAT_BODY, "tool_choice": "auto"}, "tool_choice is not supported"),
    ("functions", {**CHAT_BODY, "functions": [TOOL["function"]]}, "functions is not supported"),
    ("function_call", {**CHAT_BODY, "function_call": "auto"}, "function_call is not supported"),
    ("audio", {**CHAT_BODY, "audio": {"voice": "alloy", "format": "wav"}}, "audio is not supported"),
    ("modalities", {**CHAT_BODY, "modalities": ["text", "audio"]}, "modalities is not supported"),
    ("prediction", {**CHAT_BODY, "prediction": {"type": "content", "content": "x"}}, "prediction is not supported"),
    ("reasoning_effort", {**CHAT_BODY, "reasoning_effort": "low"}, "reasoning_effort is not supported"),
    ("logit_bias", {**CHAT_BODY, "logit_bias": {"42": -100}}, "logit_bias is not supported"),
    ("presence_penalty", {**COMPLETION_BODY, "presence_penalty": 0.5}, "presence_penalty is not supported"),
    ("frequency_penalty", {**CHAT_BODY, "frequency_penalty": -1}, "frequency_penalty is not supported"),
    ("repetition_penalty", {**COMPLETION_BODY, "repetition_penalty": 1.2}, "repetition_penalty is not supported"),
    ("best_of", {**COMPLETION_BODY, "best_of": 3}, "best_of is not supported"),
    ("suffix", {**COMPLETION_BODY, "suffix": " and so on"}, "suffix is not supported"),
    ("unknown-role", {**CHAT_BODY, "messages": [{"role": "wizard", "content": "hi"}]}, "role 'wizard'"),
    ("tool-role", {**CHAT_BODY, "messages": [{"role": "tool", "content": "{}", "tool_call_id": "1"}]},
     "role 'tool'"),
    ("tool-calls", {**CHAT_BODY, "messages": CHAT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}]}, "tool_calls"),
    ("top_logprobs-without-logprobs", {**CHAT_BODY, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ("top_logprobs-over-20", {**CHAT_BODY, "logprobs": True, "top_logprobs": 21}, "$.top_logprobs"),
    ("logprobs-over-20", {**COMPLETION_BODY, "logprobs": 21}, "$.logprobs"),
]
HARMLESS = [  # (id, body): fields that change nothing, accepted
    ("chat", {**CHAT_BODY, "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
              "parallel_tool_calls": True, "tool_choice": "none", "tools": [], "presence_penalty": 0,
              "frequency_penalty": 0.0, "logit_bias": {}, "modalities": ["text"],
              "messages": [{"role": "developer", "content": "Be brief.", "name": "ops"}] + CHAT}),
    ("completion", {**COMPLETION_BODY, "user": "u-1", "best_of": 2, "n": 2, "suffix": None, "echo": False,
                    "logit_bias": None}),
]


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


@pytest.mark.parametrize("body,words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_unsupported_fields_are_refused_by_name(served, body, words):
    r = httpx.post(served[0].url + _path(body), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [c[1] for c in HARMLESS], ids=[c[0] for c in HARMLESS])
def test_harmless_fields_are_accepted(served, body):
    r = httpx.post(served[0].url + _path(body), json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == body.get("n", 1)


def test_unsupported_fields_through_the_openai_client(served):
    c = openai_client(served[0])
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, tools=[TOOL], tool_choice="auto")
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        c.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, suffix="!")
    with pytest.raises(openai.BadRequestError, match="role 'function'"):
        c.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "function", "name": "f",
                                                                         "content": "{}"}])
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, user="u-1", metadata={"k": "v"},
                                  store=False, presence_penalty=0, frequency_penalty=0)
    assert r.choices[0].finish_reason in ("length", "stop")
