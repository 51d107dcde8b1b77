"""`python -m engine.serve`: one engine behind the OpenAI-compatible HTTP API.

    python -m engine.serve --port 8000                                # the default model on the CPU
    python -m engine.serve --executor emulated --policy polyserve      # no model: steps sleep the predicted time
    python -m engine.serve --prompt "Write a haiku about GPUs."        # one chat turn, printed, no server
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.api_server import build_app, serve_forever
from engine.config import EngineConfig
from engine.default_model import NAME as DEFAULT_MODEL_NAME
from engine.engine_backend import EngineBackend
from engine.llm import LLM, build_engine
from engine.sampling_params import SamplingParams
from scheduler.profile_table import ProfileTable
from scheduler.tiers import Tier, TierSet

# Four tiers from interactive to batch, tightest first. Round figures chosen to span the range, not measured.
DEFAULT_TIERS = "tight:20:250,standard:50:500,relaxed:100:1000,batch:250:5000"


@dataclass(slots=True, frozen=True)
class AffineStepTime:
    """The emulated executor's step time when no profile is given: fixed cost + per prefill token + per decode
    sequence. Placeholder figures of GPU scale, not measurements; use --latency-profile for measured ones."""
    base_s: float = 5e-3
    per_prefill_token_s: float = 0.05e-3
    per_decode_seq_s: float = 0.02e-3

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        return self.base_s + self.per_prefill_token_s * num_prefill_tokens + self.per_decode_seq_s * num_decode_seqs


def parse_tiers(spec: str) -> TierSet:
    """"name:tpot_ms:ttft_ms,..." -> TierSet (tightest TPOT first)."""
    tiers = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"a tier is name:tpot_ms:ttft_ms, got {item!r}")
        try:
            tiers.append(Tier(parts[0], float(parts[1]), float(parts[2])))
        except ValueError as e:
            raise ValueError(f"tier {item!r}: {e}") from None
    return TierSet(tiers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=f"Hugging Face folder (default: {DEFAULT_MODEL_NAME})")
    ap.add_argument("--served-model-name", default=None, help="the `model` clients send (default: folder name)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--executor", choices=("model", "emulated"), default="model")
    ap.add_argument("--latency-profile", default=None,
                    help="profile JSON (scheduler/profiles/): the emulated step time, the prior of the engine's "
                         "latency model and admission's; default: an affine placeholder when emulated, a roofline "
                         "prior otherwise")
    ap.add_argument("--policy", choices=("fcfs", "edf", "polyserve"), default="polyserve")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="default: from KV memory (emulated: 8192)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--tiers", default=DEFAULT_TIERS, help=f"name:tpot_ms:ttft_ms,... (default {DEFAULT_TIERS})")
    ap.add_argument("--default-tier", default=None, help="tier of requests that name no SLO (default: the loosest)")
    ap.add_argument("--max-pending", type=int, default=256, help="requests waiting for a first token before 429")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    ap.add_argument("--prompt", default=None, help="answer this one chat turn, print it and exit (no server)")
    ap.add_argument("--max-tokens", type=int, default=64, help="with --prompt")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.prompt is not None:
        one_shot(args.model, args.device, args.prompt, args.max_tokens)
        return
    emulated = args.executor == "emulated"
    try:
        tiers = parse_tiers(args.tiers)
        default = tiers.by_name(args.default_tier) if args.default_tier else tiers[len(tiers) - 1]
        config = EngineConfig(model=args.model, device=args.device, executor=args.executor,
                              num_kv_blocks=args.num_kv_blocks or (8192 if emulated else None),
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_model_len=args.max_model_len, policy=args.policy, default_ttft_ms=default.ttft_ms,
                              default_tpot_ms=default.tpot_ms)
    except ValueError as e:
        ap.error(str(e))
    # A profile, or the emulated step time itself, is trusted to refuse requests whose SLO an idle instance could
    # not meet; a live model without a profile starts from a roofline guess (the engine's online fit refines it
    # for scheduling), not good enough to refuse by, so admission then checks tiers only.
    known = ProfileTable.load(args.latency_profile) if args.latency_profile else \
        (AffineStepTime() if emulated else None)
    engine = build_engine(config, latency_model=known)
    name = args.served_model_name or (Path(args.model).name if args.model else DEFAULT_MODEL_NAME)
    backend = EngineBackend(engine, name, tiers, default.name, check_idle=known is not None,
                            max_pending=args.max_pending)
    app = build_app(backend, client_max_size=args.max_body_bytes)
    logging.getLogger(__name__).info("model %s, executor %s, policy %s, tiers %s (default %s)", name,
                                     args.executor, args.policy, args.tiers, default.name)
    asyncio.run(serve_forever(app, args.host, args.port))


def one_shot(model: str | None, device: str, prompt: str, max_tokens: int) -> None:
    llm = LLM(model, device)
    out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    gaps = [b - a for a, b in zip(out.token_times, out.token_times[1:])]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, TTFT {1000 * (out.first_token_time - out.arrival):.1f} ms, "
          f"mean TPOT {1000 * sum(gaps) / max(1, len(gaps)):.1f} ms]")


if __name__ == "__main__":
    main()
