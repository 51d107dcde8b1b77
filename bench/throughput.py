"""Offline throughput on the default model: PolyServe vs transformers `generate` on the same prompts, same run.

16 prompts of 64-256 tokens, 64 greedy output tokens each (`ignore_eos`, so both produce exactly 64).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for length in lengths]


def run_polyserve(model: str, prompts, out_len: int, device: str, dtype: str) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(model, device, max_num_batched_tokens=1024, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == out_len for o in outs)
    return elapsed


def run_transformers(model: str, prompts, out_len: int, device: str, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for a decoder-only batch
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    hf.generate(ids[:2].to(device), attention_mask=mask[:2].to(device), max_new_tokens=4, do_sample=False,
                pad_token_id=0)
    start = time.perf_counter()
    out = hf.generate(ids.to(device), attention_mask=mask.to(device), **kw)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + out_len
    return elapsed


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                    help="both engines run in it (bf16 uses AMX/AVX-512 on recent x86 CPUs)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    from engine.default_model import default_model_path

    model = args.model or default_model_path()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.model_config import ModelConfig

    prompts = make_prompts(ModelConfig.from_folder(model).vocab_size, args.num_prompts)
    tokens = args.num_prompts * args.output_len
    ours = run_polyserve(model, prompts, args.output_len, args.device, args.dtype)
    theirs = run_transformers(model, prompts, args.output_len, args.device, args.dtype)
    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} prompts={args.num_prompts} "
          f"prompt_tokens={sum(map(len, prompts))} output_tokens={tokens}")
    print(f"{'engine':<14}{'seconds':>10}{'output tok/s':>15}")
    print(f"{'polyserve':<14}{ours:>10.2f}{tokens / ours:>15.1f}")
    print(f"{'transformers':<14}{theirs:>10.2f}{tokens / theirs:>15.1f}")
    print(f"ratio polyserve/transformers: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
