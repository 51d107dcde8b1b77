"""Measures the engine's step time over a grid of batch shapes and writes a latency profile (scheduler/profiles/),
then reports how well each latency model predicts the steps of a real mixed workload (mean absolute % error).

Shapes are built directly in a block manager, so every grid point is exactly (prefill tokens, decode seqs, KV
tokens): D decodes share the KV beyond the prefill chunk; with no decode, the chunk sits on a cached prefix.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine._C import BlockManager
from engine.executor import StepBatch
from scheduler import OnlineLatencyModel, ProfileTable

PREFILL = (0, 64, 256, 512)
DECODES = (1, 4, 16, 32)  # no empty step on the grid: a 0 there would drag every small batch down
KV = (512, 4096, 8192)


def time_shape(llm: LLM, prefill: int, decodes: int, kv: int, repeats: int) -> float:
    runner = llm.engine.executor
    bs = llm.config.block_size
    blocks = BlockManager(runner.num_kv_blocks, bs, False)
    seqs, computed, new = [], [], []
    decode_ctx = max(1, (kv - prefill) // decodes) if decodes else 0
    prefix = 0 if decodes else max(0, kv - prefill)
    for i in range(decodes):
        blocks.add_sequence(i, [1] * decode_ctx)
        seqs.append(i), computed.append(decode_ctx - 1), new.append(1)
    if prefill:
        blocks.add_sequence(decodes, [1] * (prefix + prefill))
        seqs.append(decodes), computed.append(prefix), new.append(prefill)
    for s, c, n in zip(seqs, computed, new):
        if not blocks.ensure_capacity(s, c + n):
            raise RuntimeError(f"KV pool too small for shape P={prefill} D={decodes} K={kv}")
    meta = blocks.build_batch(np.array(seqs), np.array(computed), np.array(new))
    n_sampled = len(meta.sample_rows)
    batch = StepBatch(meta, [SamplingParams(temperature=0)] * n_sampled, [None] * n_sampled, prefill, decodes,
                      int(meta.seq_lens.sum()))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        runner.execute(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure_profile(llm: LLM, repeats: int) -> ProfileTable:
    llm.engine.executor.kv_cache.zero_()  # no denormals or NaNs in the timed math
    grid = [[[time_shape(llm, p, d, k, repeats) for k in KV] for d in DECODES]
            for p in PREFILL]
    return ProfileTable(PREFILL, DECODES, KV, grid, model=Path(llm.engine.executor.cfg.path).name,
                        device=f"{llm.config.device} ({torch.get_num_threads()} threads)",
                        source="bench.profile: engine step time, median of repeats")


def workload_steps(llm: LLM, seed: int = 0):
    """Steps of a mixed workload through the real engine: varied prompts and outputs, chunked prefill."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 400, (24,), generator=g)]
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)
              for n in torch.randint(8, 64, (24,), generator=g)]
    before = len(llm.engine.step_stats)
    llm.generate(prompts, params)
    return list(llm.engine.step_stats)[before:]


def mape(model, steps) -> float:
    errors = [abs(model.predict(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens) - s.duration) / s.duration
              for s in steps]
    return 100 * sum(errors) / len(errors)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="profile JSON to write (default: print only)")
    args = ap.parse_args(argv)
    llm = LLM(args.model, args.device, max_num_batched_tokens=512, num_kv_blocks=2048)
    profile = measure_profile(llm, args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(profile.to_dict(), indent=1))
        print(f"wrote {args.out}")
    steps = workload_steps(llm)
    half = len(steps) // 2
    online = OnlineLatencyModel(profile, max_prefill_tokens=512, max_decode_seqs=32, max_kv_tokens=8192)
    for s in steps[:half]:
        online.observe(s)
    print(f"device={profile.device} model={profile.model} workload steps={len(steps)}")
    print(f"{'latency model':<40}{'MAPE %':>8}")
    print(f"{'profile table (this run)':<40}{mape(profile, steps):>8.1f}")
    print(f"{'online fit (first half -> second half)':<40}{mape(online, steps[half:]):>8.1f}")
    print(f"{'engine online model (live, all steps)':<40}{mape(llm.engine.latency_model, steps):>8.1f}")


if __name__ == "__main__":
    main()
