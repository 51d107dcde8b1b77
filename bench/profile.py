"""Measures the engine's step time over a grid of batch shapes and writes a latency profile (scheduler/profiles/),
then reports how well each latency model predicts the steps of a real mixed workload (mean absolute % error), and
fits the prediction error of those steps (scheduler/prediction_error.py: host time, bias, noise, stalls).

Shapes are built directly in a block manager, so every grid point is exactly (prefill tokens, decode seqs, KV
tokens); a timed step is what the engine's step times of that batch: building the flattened batch from the block
tables, the forward and the sampling. The workload is never seen while the profile is measured, and the online
models are scored prequentially (each step predicted before it is observed), so every figure is held out.

With `--executor emulated` nothing is profiled: the engine sleeps the latency model it stands in for, and the
workload's steps are fitted against that model, which gives what the engine adds to it on this host (its host time
per step and per sequence, the sleep's overshoot and jitter, the process' pauses): the `cpu-measured` preset.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine._C import BlockManager
from engine.config import EXECUTORS
from engine.default_model import default_model_path
from engine.executor import StepBatch
from engine.llm import device_spec, model_shape
from scheduler import LatencyModel, OnlineLatencyModel, ProfileTable, RooflineLatencyModel
from scheduler.prediction_error import PredictionError, fit_prediction_error

# Axes cover the workload's steps: chunks up to the 512-token budget, 1..32 decodes, contexts up to 8k tokens.
# Decode time on a CPU is far from linear in the batch (1 -> 8 decodes costs ~6 ms each, 8 -> 32 ~2 ms each), so
# the decode axis doubles. No empty step: a 0 on the decode axis would drag every small batch towards zero.
PREFILL = (0, 32, 128, 256, 512)
DECODES = (1, 2, 4, 8, 16, 32)
KV = (512, 2048, 4096, 8192)


class ShapeStep:
    """One batch of an exact shape, ready to run as an engine step does."""

    def __init__(self, llm: LLM, prefill: int, decodes: int, kv: int):
        runner = llm.engine.executor
        self.runner, self.blocks = runner, BlockManager(runner.num_kv_blocks, llm.config.block_size, False)
        self.prefill, self.decodes, self.kv = prefill, decodes, kv
        seqs, computed, new = [], [], []
        # Decode contexts spread evenly over (0, 2 * mean), as in a workload of mixed lengths: the CPU attention pads
        # every decode to the longest context in the batch, so equal lengths would under-price it.
        mean_context = max(1, (kv - prefill) // decodes) if decodes else 0
        prefix = 0 if decodes else max(0, kv - prefill)
        for i in range(decodes):
            context = max(1, round(mean_context * (2 * i + 1) / decodes))
            self.blocks.add_sequence(i, [1] * context)
            seqs.append(i), computed.append(context - 1), new.append(1)
        if prefill:
            self.blocks.add_sequence(decodes, [1] * (prefix + prefill))
            seqs.append(decodes), computed.append(prefix), new.append(prefill)
        for s, c, n in zip(seqs, computed, new):
            if not self.blocks.ensure_capacity(s, c + n):
                raise RuntimeError(f"KV pool too small for shape P={prefill} D={decodes} K={kv}")
        self.seqs, self.computed, self.new = np.array(seqs), np.array(computed), np.array(new)

    def run(self) -> float:
        t0 = time.perf_counter()
        meta = self.blocks.build_batch(self.seqs, self.computed, self.new)
        n_sampled = len(meta.sample_rows)
        self.runner.execute(StepBatch(meta, [SamplingParams(temperature=0)] * n_sampled, [None] * n_sampled,
                                      self.prefill, self.decodes, int(meta.seq_lens.sum()), len(self.seqs)))
        return time.perf_counter() - t0


def measure_profile(llm: LLM, repeats: int) -> ProfileTable:
    llm.engine.executor.kv_cache.zero_()  # no denormals or NaNs in the timed math
    shapes = [ShapeStep(llm, p, d, k) for p in PREFILL for d in DECODES for k in KV]
    for shape in shapes:  # warm-up: first calls of a shape pay allocation and kernel selection
        shape.run()
    # Round-robin over the grid rather than shape after shape: a slow spell of the machine then spreads over all
    # shapes instead of bending one corner of the table.
    times = [[] for _ in shapes]
    for _ in range(repeats):
        for shape, measured in zip(shapes, times):
            measured.append(shape.run())
    medians = iter([statistics.median(t) for t in times])
    grid = [[[next(medians) for _ in KV] for _ in DECODES] for _ in PREFILL]
    return ProfileTable(PREFILL, DECODES, KV, grid, model=Path(llm.engine.executor.cfg.path).name,
                        device=f"{llm.config.device} ({torch.get_num_threads()} threads)",
                        source=f"bench.profile: engine step time (batch build + forward + sampling), "
                               f"median of {repeats} rounds")


def workload_steps(llm: LLM, seed: int = 0):
    """Steps of a mixed workload through the real engine: varied prompts and outputs, chunked prefill."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 400, (24,), generator=g)]
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)
              for n in torch.randint(8, 64, (24,), generator=g)]
    steps = []
    llm.engine.step_hooks.append(steps.append)  # every step, however many the bounded history keeps
    try:
        llm.generate(prompts, params)
    finally:
        llm.engine.step_hooks.remove(steps.append)
    return steps


def mape(model, steps) -> float:
    errors = [abs(model.predict(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens) - s.duration) / s.duration
              for s in steps]
    return 100 * sum(errors) / len(errors)


def prequential_mape(model: OnlineLatencyModel, steps) -> float:
    """Each step predicted before the model observes it, as the engine's scheduler predicts it live."""
    errors = []
    for s in steps:
        errors.append(abs(model.predict(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens) - s.duration)
                      / s.duration)
        model.observe(s)
    return 100 * sum(errors) / len(errors)


def error_fit(model: LatencyModel, steps) -> PredictionError:
    """The prediction error of `steps` against `model`."""
    return fit_prediction_error([model.predict(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens)
                                 for s in steps], [s.duration for s in steps], [s.num_seqs for s in steps])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--executor", choices=EXECUTORS, default="model",
                    help="model: profile the model and fit the workload's error against that profile; emulated: "
                         "profile nothing, fit the workload's error against the latency model the engine sleeps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="times the mixed workload runs (seeds 0, 1, ...), every step kept (default: 1)")
    ap.add_argument("--out", default=None, help="profile JSON to write (default: print only)")
    ap.add_argument("--error-out", default=None, help="prediction-error fit JSON to write (default: print only)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be positive, got {args.rounds}")
    if args.executor == "emulated" and args.out:
        ap.error("--out: an emulated engine sleeps a known latency model, there is no profile to write")
    llm = LLM(args.model, args.device, executor=args.executor, max_num_batched_tokens=512, num_kv_blocks=2048)
    runner, config = llm.engine.executor, llm.config
    # the online model exactly as engine.llm.build_engine makes it, with its prior or with this run's profile
    limits = dict(max_prefill_tokens=config.max_num_batched_tokens, max_decode_seqs=config.max_num_seqs,
                  max_kv_tokens=runner.num_kv_blocks * config.block_size)
    if args.executor == "emulated":
        reference, reference_name = config.known_latency_model(), "the latency model the engine sleeps"
        device = f"{config.device}, emulated"
    else:
        profile = measure_profile(llm, args.repeats)
        if args.out:
            profile.save(args.out)
            print(f"wrote {args.out}")
        reference, reference_name = profile, "profile table of this run (trilinear interpolation)"
        device = profile.device
    steps = [s for seed in range(args.rounds) for s in workload_steps(llm, seed)]
    model_name = Path(config.model or default_model_path()).name
    print(f"device={device} model={model_name} workload steps={len(steps)}")
    print(f"{'latency model':<52}{'MAPE %':>8}")
    print(f"{reference_name:<52}{mape(reference, steps):>8.1f}")
    print(f"{'online fit, that prior, live (prequential)':<52}"
          f"{prequential_mape(OnlineLatencyModel(reference, **limits), steps):>8.1f}")
    if args.executor == "model":
        roofline = RooflineLatencyModel(device_spec(config.device),
                                        model_shape(runner.cfg, runner.kv_cache.element_size()))
        print(f"{'online fit, roofline prior, live (the engine default)':<52}"
              f"{prequential_mape(OnlineLatencyModel(roofline, **limits), steps):>8.1f}")
    fit = error_fit(reference, steps)
    print(f"prediction error fit (against {reference_name}): {fit}")
    if args.error_out:
        with open(args.error_out, "w") as f:
            json.dump({"executor": args.executor, "device": device, "model": model_name,
                       "reference": reference_name, "steps": len(steps), "rounds": args.rounds,
                       "prediction_error": dataclasses.asdict(fit)}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.error_out}")


if __name__ == "__main__":
    main()
