"""Triton compiles while an engine serves: after the engine is built (its warm-up compiles every variant it
launches), none should happen, since each is a stall of seconds in the middle of a step.

    python -m bench.serving_compiles --device cuda --seconds 120 [--model PATH]

Serves waves of 1 to 64 requests, prompts of 16 to 3000 tokens and outputs of 1 to 256 (greedy, ignore_eos), so
batch sizes, block-table widths, prefill chunks, contexts and the mix of decodes and chunks in a step all vary;
a wave's requests finish at different steps, so its batch shrinks as it runs. Every Triton compile after the
engine was built is recorded through Triton's post-compile hook and printed with its kernel and specialisation
key. Exits 1 if there was any.
"""
from __future__ import annotations

import argparse
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: the default model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to serve after start-up")
    args = parser.parse_args(argv)

    import triton

    from engine import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(args.model, args.device)
    built = time.monotonic()
    compiles: list[tuple[str, str]] = []
    earlier = triton.knobs.runtime.jit_post_compile_hook

    def record(**compiled):
        compiles.append((compiled["fn"].name, str(compiled["key"])))
        print(f"COMPILE after start-up: {compiled['fn'].name} key {compiled['key']}", file=sys.stderr, flush=True)
        if earlier is not None:
            earlier(**compiled)

    triton.knobs.runtime.jit_post_compile_hook = record
    rng = random.Random(0)
    vocab = llm.engine.executor.vocab_size
    waves = requests = tokens = 0
    try:
        while time.monotonic() - built < args.seconds:
            size = rng.choice([1, 3, 8, 17, 32, 64])
            prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 3000))] for _ in range(size)]
            params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 256), ignore_eos=True)
                      for _ in range(size)]
            outputs = llm.generate(prompts, params)
            waves, requests = waves + 1, requests + size
            tokens += sum(len(out.token_ids) for out in outputs)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = earlier
    served = time.monotonic() - built
    print(f"start-up (load + warm-up) {built - started:.1f} s; served {served:.1f} s: {waves} waves, {requests} "
          f"requests, {tokens} output tokens ({tokens / served:.0f} tok/s); Triton compiles after start-up: "
          f"{len(compiles)}")
    for name, key in compiles:
        print(f"  {name}: {key}")
    return 1 if compiles else 0


if __name__ == "__main__":
    sys.exit(main())
