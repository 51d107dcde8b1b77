"""Host-side overhead of one decode step: block bookkeeping plus batch metadata, without any model.

    python -m bench.host_overhead [--num-seqs 256] [--iters 1000]

Every step does what the engine does around the forward pass for `num_seqs` running decodes: make sure each
sequence holds a block for its next token, build the batch arrays, then record the computed KV and the sampled
token. `hook`, when given, runs at the start of every measured step (the place of the scheduler's decision).
Figures are medians over steps, measured with time.perf_counter_ns on this machine's CPU.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

import numpy as np

from engine._C import BlockManager

PHASES = ("hook", "ensure_capacity", "arrays", "build_batch", "mark_computed", "append_token")


def measure(num_seqs: int = 256, iters: int = 1000, prompt_len: int = 512, block_size: int = 16,
            hook: Callable[[], object] | None = None, warmup: int = 20, seed: int = 0) -> dict:
    """Median µs per step, in total and per phase, for `num_seqs` decodes over `iters` measured steps."""
    if num_seqs < 1 or iters < 1 or prompt_len < 1:
        raise ValueError("num_seqs, iters and prompt_len must be positive")
    rng = random.Random(seed)
    steps = warmup + iters
    longest = prompt_len + prompt_len // 8 + steps + 1
    bm = BlockManager(num_seqs * -(-longest // block_size), block_size, True)

    # Prompts of about prompt_len tokens, as after their prefill: KV computed, first token sampled.
    seq_ids = list(range(num_seqs))
    computed = []
    for seq_id in seq_ids:
        n = prompt_len + rng.randrange(-prompt_len // 8, prompt_len // 8 + 1)
        bm.add_sequence(seq_id, [rng.randrange(32000) for _ in range(n)])
        assert bm.ensure_capacity(seq_id, n)
        bm.mark_computed(seq_id, n)
        bm.append_token(seq_id, rng.randrange(32000))
        computed.append(n)
    sampled = [rng.randrange(32000) for _ in range(num_seqs)]
    num_new = np.ones(num_seqs, dtype=np.int64)
    ids_array = np.array(seq_ids, dtype=np.int64)

    samples = {phase: [] for phase in PHASES}
    totals = []
    clock = time.perf_counter_ns
    for step in range(steps):
        t0 = clock()
        if hook is not None:
            hook()
        t1 = clock()
        for seq_id, n in zip(seq_ids, computed):
            if not bm.ensure_capacity(seq_id, n + 1):
                raise RuntimeError("benchmark pool too small")
        t2 = clock()
        computed_array = np.array(computed, dtype=np.int64)
        t3 = clock()
        meta = bm.build_batch(ids_array, computed_array, num_new)
        t4 = clock()
        computed = [n + 1 for n in computed]
        for seq_id, n in zip(seq_ids, computed):
            bm.mark_computed(seq_id, n)
        t5 = clock()
        for seq_id, token in zip(seq_ids, sampled):
            bm.append_token(seq_id, token)
        t6 = clock()
        if meta.logits_indices.shape[0] != num_seqs:
            raise RuntimeError("every decode must sample")
        if step >= warmup:
            for phase, start, end in zip(PHASES, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                samples[phase].append(end - start)
            totals.append(t6 - t0)
    bm.check_invariants()

    result = {"num_seqs": num_seqs, "iters": iters, "step_us": statistics.median(totals) / 1e3}
    result.update({f"{phase}_us": statistics.median(values) / 1e3 for phase, values in samples.items()})
    return result


def measure_engine_step(num_seqs: int = 256, iters: int = 200, prompt_len: int = 512, policy: str = "fcfs") -> float:
    """Median µs of a whole `Engine.step` for `num_seqs` running decodes with an emulated executor of zero step
    time: the batch policy's decision, block bookkeeping, batch metadata and postprocessing, with no model."""
    import json
    import tempfile

    from engine import EngineConfig, SamplingParams, build_engine

    with tempfile.TemporaryDirectory() as folder:  # an emulated engine reads only the model's config
        config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "max_position_embeddings": 8192}
        with open(f"{folder}/config.json", "w") as f:
            json.dump(config, f)
        blocks = num_seqs * -(-(prompt_len + iters + 64) // 16)
        engine = build_engine(EngineConfig(model=folder, executor="emulated", num_kv_blocks=blocks, batch_policy=policy,
                                           max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs)),
                              step_time=lambda p, d, k, n: 0.0)
    rng = random.Random(0)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(32000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=iters + 32))
    while len(engine.running) < num_seqs or any(r.num_output_tokens == 0 for r in engine.running):
        engine.step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        engine.step()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    result = measure(num_seqs=args.num_seqs, iters=args.iters, prompt_len=args.prompt_len)
    print(f"host overhead per decode step: {result['num_seqs']} sequences, ~{args.prompt_len}-token prompts, "
          f"median of {result['iters']} steps (CPU)")
    print(f"{'phase':<18}{'µs/step':>10}{'µs/seq':>10}")
    for phase in PHASES:
        us = result[f"{phase}_us"]
        print(f"{phase:<18}{us:>10.1f}{us / result['num_seqs']:>10.3f}")
    print(f"{'total':<18}{result['step_us']:>10.1f}{result['step_us'] / result['num_seqs']:>10.3f}")
    for policy in ("fcfs", "polyserve"):
        us = measure_engine_step(args.num_seqs, prompt_len=args.prompt_len, policy=policy)
        print(f"whole Engine.step ({policy} policy, emulated executor, zero step time): {us:.1f} µs")


if __name__ == "__main__":
    main()
