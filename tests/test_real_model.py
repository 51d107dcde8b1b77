"""The real default model (SmolLM2-135M-Instruct) against transformers on the same weights: identical greedy text."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in one sentence what a GPU is.",
    "List three fruits.",
]


@pytest.fixture(scope="module")
def hf_model(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(default_model).eval(), AutoTokenizer.from_pretrained(default_model)


def test_chat_greedy_text_identical_to_transformers(default_model, hf_model):
    model, tok = hf_model
    # prompts of ~30 tokens: chunked prefill mixes with decodes
    llm = LLM(default_model, max_num_batched_tokens=64, batch_policy="fcfs")
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)
    for chat, out in zip(CHATS, outs):
        ids = tok.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        ref_ids = ref[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref_ids
        assert out.text == tok.decode(ref_ids, skip_special_tokens=True)
        assert out.text.strip()


def test_streamed_deltas_add_up_to_the_text(default_model):
    llm = LLM(default_model, num_kv_blocks=64)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a color and a number."}])
    llm.engine.add_request("s", ids, SamplingParams(temperature=0, max_tokens=24))
    text, final = "", None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            text += out.new_text
            final = out
    assert final.finished and text == final.text == llm.tokenizer.decode(final.token_ids)
