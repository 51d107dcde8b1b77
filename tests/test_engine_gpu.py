"""The engine on a GPU with the Triton kernels (and the CUDA C++ KV store), against transformers on the same GPU and
weights."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernels,eager", [("triton", True), ("triton", False), ("cuda", False)])
def test_tiny_model_greedy_equals_transformers_on_gpu(llama_tiny, kernels, eager):
    folder, hf = llama_tiny
    if kernels == "cuda":
        pytest.importorskip("kernels._cuda", reason="the CUDA C++ extension is not built")
    hf = hf.to("cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 1, 29)]
    llm = LLM(folder, "cuda", dtype="float32", kernels=kernels, max_num_batched_tokens=32, num_kv_blocks=64,
              batch_policy="fcfs", enforce_eager=eager, max_num_seqs=8)
    assert (llm.engine.executor.graphs is None) == eager
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    hf.to("cpu")


def test_every_layout_on_gpu(tiny_model):
    folder, hf = tiny_model
    hf = hf.to("cuda")
    prompt = list(range(3, 40))
    out = LLM(folder, "cuda", dtype="float32", num_kv_blocks=32, max_num_seqs=4).generate([prompt], GREEDY)[0]
    assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    hf.to("cpu")


def test_real_model_on_gpu_matches_transformers(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    hf = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).cuda().eval()
    llm = LLM(default_model, "cuda", dtype="float32")
    chats = ["What is the capital of France?", "Write a haiku about GPUs."]
    outs = llm.chat([[{"role": "user", "content": c}] for c in chats], SamplingParams(temperature=0, max_tokens=32))
    for chat, out in zip(chats, outs):
        ids = tok.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        assert out.token_ids == hf_greedy(hf, ids, len(out.token_ids))
    # bf16 end to end runs and agrees on the first tokens at least
    bf16 = LLM(default_model, "cuda", dtype="bfloat16").chat([{"role": "user", "content": chats[0]}],
                                                              SamplingParams(temperature=0, max_tokens=8))[0]
    assert bf16.token_ids[:3] == outs[0].token_ids[:3]
