"""Offline throughput on the default model: PolyServe vs transformers `generate` on the same prompts, same run.

16 prompts of 64-256 tokens, 64 greedy output tokens each (`ignore_eos`, so both produce exactly 64). With
`--repeats N` the two engines take turns N times, each round on fresh prompts (an engine that saw a round's prompts
before would serve them from its prefix cache), and the median ratio is reported: on a machine that other jobs share,
load changes between two back-to-back runs more than the engines differ.

Each engine lives in a process of its own and waits while the other runs: in one process, the engine loaded second
ran ~10 % slower on this CPU (the allocator and oneDNN's primitive cache are shared), which is not its own cost.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import time
from typing import Callable

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for length in lengths]


def polyserve_runner(model: str, out_len: int, device: str, dtype: str, warmup_prompts) -> Callable[[list], float]:
    from engine import LLM, SamplingParams

    llm = LLM(model, device, max_num_batched_tokens=1024, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(warmup_prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def run(prompts) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.token_ids) == out_len for o in outs)
        return elapsed

    return run


def transformers_runner(model: str, out_len: int, device: str, dtype: str, warmup_prompts) -> Callable[[list], float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()

    def left_padded(prompts):  # as generate expects for a decoder-only batch
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids.to(device), mask.to(device)

    ids, mask = left_padded(warmup_prompts)
    hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)

    def run(prompts) -> float:
        ids, mask = left_padded(prompts)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                          pad_token_id=0)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + out_len
        return elapsed

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                    help="both engines run in it (bf16 uses AMX/AVX-512 on recent x86 CPUs)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds, the engines taking turns (median ratio)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    from engine.default_model import default_model_path

    model = args.model or default_model_path()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.model_config import ModelConfig

    vocab = ModelConfig.from_folder(model).vocab_size
    warmup = make_prompts(vocab, 2, seed=args.repeats)  # a seed no round uses: no round starts prefix-cached
    context = multiprocessing.get_context("spawn")
    engines, processes = [], []
    for make in (polyserve_runner, transformers_runner):
        ours_end, theirs_end = context.Pipe()
        processes.append(context.Process(target=_engine_process, daemon=True, args=(
            make, (model, args.output_len, args.device, args.dtype, warmup), args.threads, theirs_end)))
        processes[-1].start()
        engines.append(ours_end)
    for conn in engines:
        conn.recv()  # loaded and warmed up

    def timed(conn) -> Callable[[list], float]:
        def run(prompts) -> float:
            conn.send(prompts)
            return conn.recv()
        return run

    ours, theirs = map(timed, engines)
    tokens = args.num_prompts * args.output_len
    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} prompts={args.num_prompts} "
          f"output_tokens={tokens} rounds={args.repeats}")
    print(f"{'round':<7}{'prompt tok':>11}{'polyserve s':>13}{'tok/s':>8}{'transformers s':>16}{'tok/s':>8}"
          f"{'ratio':>8}")
    ratios = []
    for seed in range(args.repeats):
        prompts = make_prompts(vocab, args.num_prompts, seed)
        ours_s, theirs_s = ours(prompts), theirs(prompts)
        ratios.append(theirs_s / ours_s)
        print(f"{seed:<7}{sum(map(len, prompts)):>11}{ours_s:>13.2f}{tokens / ours_s:>8.1f}{theirs_s:>16.2f}"
              f"{tokens / theirs_s:>8.1f}{ratios[-1]:>7.2f}x", flush=True)
    interval = median_interval(ratios)
    print(f"ratio polyserve/transformers: {statistics.median(ratios):.2f}x"
          + (f" (median of {args.repeats} rounds)" if args.repeats > 1 else "")
          + (f"; 95 % interval of the median {interval[0]:.2f}-{interval[1]:.2f}x" if interval else ""))
    for conn, process in zip(engines, processes):
        conn.send(None)
        process.join()


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval of the median from order statistics: [x_(k), x_(n+1-k)] with the largest k for
    which a Binomial(n, 1/2) count falls below k with probability <= (1 - confidence) / 2 (None below 6 values,
    where even the extremes cover less than 95 %)."""
    n, tail = len(values), (1.0 - confidence) / 2
    below = 0.0  # P(Binomial(n, 1/2) < k)
    k = 0
    while below + math.comb(n, k) / 2 ** n <= tail:
        below += math.comb(n, k) / 2 ** n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def _engine_process(make_runner, runner_args: tuple, threads: int | None, conn) -> None:
    """One engine in a process of its own: timed runs of the prompts it is sent, until it is sent None."""
    if threads:
        torch.set_num_threads(threads)
    run = make_runner(*runner_args)
    conn.send("ready")
    while (prompts := conn.recv()) is not None:
        conn.send(run(prompts))


if __name__ == "__main__":
    main()
