"""The engine against Hugging Face transformers on the same weights: greedy tokens equal, first logits close."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])  # explicit mask: generate would otherwise mask every token equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def random_prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_greedy_equals_transformers_mixed_lengths(tiny_model):
    folder, hf = tiny_model
    prompts = random_prompts(hf.config.vocab_size, [3, 17, 40, 1, 29])
    llm = LLM(folder, max_num_batched_tokens=64, num_kv_blocks=64, batch_policy="fcfs")
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length"


def test_first_step_logits_close(llama_tiny):
    """fp32 on both sides: logits agree to 1e-4 absolute (measured differences are ~1e-6)."""
    folder, hf = llama_tiny
    prompt = random_prompts(hf.config.vocab_size, [23])[0]
    llm = LLM(folder, num_kv_blocks=16)
    runner = llm.engine.executor
    captured = {}
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.setdefault("logits", original(h))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(captured["logits"][0], expected, atol=1e-4, rtol=0)


def test_chunked_prefill_across_many_steps(llama_tiny):
    folder, hf = llama_tiny
    prompts = random_prompts(hf.config.vocab_size, [45, 33, 8], seed=2)
    # a 45-token prompt needs 7 steps
    llm = LLM(folder, max_num_batched_tokens=7, num_kv_blocks=64, batch_policy="fcfs")
    outs = llm.generate(prompts, GREEDY)
    stats = list(llm.engine.step_stats)
    assert max(s.num_prefill_tokens + s.num_decode_seqs for s in stats) <= 7
    assert any(s.num_prefill_tokens and s.num_decode_seqs for s in stats), "no step mixed decodes with a prefill"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_preemption_by_recompute_keeps_output_exact(llama_tiny):
    folder, hf = llama_tiny
    prompts = random_prompts(hf.config.vocab_size, [30, 31, 29, 28], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # 4 sequences of up to 55 tokens need 16 blocks of 16; 9 blocks force preemption.
    llm = LLM(folder, num_kv_blocks=9, max_num_batched_tokens=256, enable_prefix_caching=False,
              batch_policy="fcfs")
    preempted = []
    original = llm.engine._preempt
    llm.engine._preempt = lambda r: (preempted.append(r.request_id), original(r))
    outs = llm.generate(prompts, params)
    assert preempted, "the KV pool was meant to be too small for all four"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, params.max_tokens)
    assert llm.engine.blocks.num_free_blocks() == 9


def test_shared_prefix_hits_prefix_cache(llama_tiny):
    folder, hf = llama_tiny
    prefix = random_prompts(hf.config.vocab_size, [48], seed=4)[0]
    tails = random_prompts(hf.config.vocab_size, [5, 9, 1], seed=5)
    llm = LLM(folder, num_kv_blocks=64)
    first = llm.generate([prefix + tails[0]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate([prefix + t for t in tails[1:]], GREEDY)
    for tail, out in zip(tails[1:], rest):
        assert out.num_cached_tokens == 48  # three full blocks of 16 computed once
        assert out.token_ids == hf_greedy(hf, prefix + tail, GREEDY.max_tokens)
    again = llm.generate([prefix + tails[0]], GREEDY)[0]  # prompt and its output blocks are cached too
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_sizes(llama_tiny, block_size):
    folder, hf = llama_tiny
    prompts = random_prompts(hf.config.vocab_size, [13, 33], seed=6)
    outs = LLM(folder, block_size=block_size, num_kv_blocks=2048 // block_size).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_bf16_cpu_prepacked_projections_change_nothing(tiny_model, monkeypatch):
    """bf16 on the CPU runs every projection through oneDNN-prepacked weights: same tokens, same logits."""
    import engine.model_runner as model_runner

    folder, hf = tiny_model
    prompts = random_prompts(hf.config.vocab_size, [1, 19, 50], seed=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=64)
    # packing took place where this CPU allows it (the comparison below then holds trivially elsewhere)
    packed_forward = "forward" in vars(llm.engine.executor.model.layers[0].mlp.gate_up_proj)
    assert packed_forward == model_runner.onednn_packs_bf16()
    packed = llm.generate(prompts, params)
    monkeypatch.setattr(model_runner, "pack_linears_for_onednn", lambda model: None)
    plain = LLM(folder, dtype="bfloat16", num_kv_blocks=64).generate(prompts, params)
    for a, b in zip(packed, plain):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=2e-2)  # bf16: a different accumulation order is allowed
