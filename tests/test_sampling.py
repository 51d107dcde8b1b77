"""Sampling controls: seeds, top-k/top-p exclusion, stop strings and stop tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import sample
from engine.tokenizer import Detokenizer


@pytest.fixture(scope="module")
def llm(llama_tiny):
    return LLM(llama_tiny[0], num_kv_blocks=128)


PROMPTS = [[5, 9, 200, 17], [33] * 11, list(range(40, 70))]


def test_seeded_requests_reproduce_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.3, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], p)[0].token_ids
    crowded = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                           [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), p,
                            SamplingParams(temperature=0.7, seed=9, max_tokens=12, ignore_eos=True)])[1].token_ids
    assert alone == crowded
    other = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.3, seed=1235, max_tokens=12, ignore_eos=True))
    assert other[0].token_ids != alone


def test_top_k_and_top_p_never_emit_excluded_tokens():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=2.0, top_p=0.5),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.7)] * 2
    order = logits.argsort(dim=-1, descending=True)
    probs = logits.softmax(-1)
    for trial in range(300):
        tokens = sample(logits.clone(), params, [None] * 6).token_ids
        for row, (tok, p) in enumerate(zip(tokens, params)):
            rank = (order[row] == tok).nonzero().item()
            if p.top_k:
                assert rank < p.top_k
            if p.top_p < 1:
                scaled = (logits[row] / p.temperature).softmax(-1)[order[row]]
                assert scaled[:rank].sum() < p.top_p  # the mass before the chosen token is under top_p
    assert probs.shape == (6, 50)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        tok = sample(logits.clone(), [SamplingParams(temperature=1.0)], [gen]).token_ids
        counts[tok[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03) and counts[3] == 0


def test_logprobs_are_those_of_the_chosen_tokens():
    logits = torch.randn(3, 20)
    out = sample(logits.clone(), [SamplingParams(temperature=0, logprobs=True)] * 3, [None] * 3)
    expected = logits.log_softmax(-1)[torch.arange(3), out.token_ids]
    assert torch.allclose(torch.tensor(out.logprobs), expected)


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    cut = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at],
                                                     ignore_eos=True))[0]
    first = free.token_ids.index(stop_at)
    assert cut.token_ids == free.token_ids[:first + 1] and cut.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 8


class CharTokenizer:
    """One character per token: stop-string cuts are checkable by hand."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("stop,text,expected", [
    (["END"], "hello ENDworld", "hello "),
    (["lo", "he"], "hello", ""),
    (["xyz"], "abcxyabcxyz", "abcxyabc"),
    (["b"], "aaa", "aaa"),
])
def test_stop_strings_cut_the_text_exactly(stop, text, expected):
    detok = Detokenizer(CharTokenizer(), stop)
    streamed, stopped = "", False
    for ch in text:
        stopped = detok.add(ord(ch))
        streamed += detok.take_delta(stopped)
        if stopped:
            break
    if not stopped:
        streamed += detok.take_delta(True)
    assert detok.text == expected and streamed == expected
    assert stopped == (expected != text)


def test_stop_string_on_the_real_tokenizer(default_model):
    llm = LLM(default_model, num_kv_blocks=64)
    msgs = [{"role": "user", "content": "Tell me about the ocean."}]
    free = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40))[0]
    assert len(free.text) > 30, free.text
    stop = free.text[20:24]  # most likely spans a token boundary
    cut = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, stop=["never-there", stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.index(stop)]


def test_top_logprobs_of_forbidden_tokens_are_the_finite_floor():
    from engine.sampler import IMPOSSIBLE_LOGPROB, top_logprobs
    logprobs = torch.log_softmax(torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]]), dim=-1)
    top = top_logprobs(logprobs, [4])[0]
    assert [t for t, _ in top[:2]] == [2, 0] and all(math.isfinite(v) for _, v in top)
    assert [v for _, v in top[2:]] == [IMPOSSIBLE_LOGPROB, IMPOSSIBLE_LOGPROB]
