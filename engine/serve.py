"""`python -m engine.serve`: one engine. With --prompt it generates once and prints; the HTTP API comes next."""
from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="Hugging Face folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", default="Write a haiku about GPUs.")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    llm = LLM(args.model, args.device)
    out = llm.chat([{"role": "user", "content": args.prompt}], SamplingParams(temperature=0, max_tokens=args.max_tokens))[0]
    gaps = [b - a for a, b in zip(out.token_times, out.token_times[1:])]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, TTFT {1000 * (out.first_token_time - out.arrival):.1f} ms, "
          f"mean TPOT {1000 * sum(gaps) / max(1, len(gaps)):.1f} ms]")


if __name__ == "__main__":
    main()
