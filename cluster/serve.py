"""`python -m cluster.serve`: the router, autoscaled engine processes and the OpenAI-compatible HTTP API.

    python -m cluster.serve --executor emulated --min-instances 2 --max-instances 8 --idle-pool 1
    python -m cluster.serve --executor model --gpus 0,1,2,3 --policy polyserve --tiers tight:20:250,batch:250:5000

Engines are `python -m cluster.worker` processes started by the launcher: one per GPU with --gpus, else (emulated
engines, or CPU model engines) as many as the limits allow. The router and every engine predict iteration times
with the same latency model: --latency-profile, else the roofline of Llama-3.1-8B on an H200, times --time-scale
(which an emulated engine also sleeps). Baseline policies serve a fixed fleet of --min-instances.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.backend import RouterBackend
from cluster.emulation import ScaledLatencyModel, emulated_latency_model
from cluster.launcher import LocalLauncher
from cluster.router import POLICIES, Router
from cluster.service import RouterService
from engine.api_server import build_app, serve_forever
from engine.default_model import NAME as DEFAULT_MODEL_NAME
from engine.default_model import default_model_path
from engine.model_config import ModelConfig
from engine.serve import DEFAULT_TIERS, parse_tiers
from engine.tokenizer import Tokenizer
from scheduler.profile_table import ProfileTable


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--policy", choices=POLICIES, default="polyserve")
    ap.add_argument("--tiers", default=DEFAULT_TIERS, help=f"name:tpot_ms:ttft_ms,... (default {DEFAULT_TIERS})")
    ap.add_argument("--default-tier", default=None, help="tier of requests that name no SLO (default: the loosest)")
    ap.add_argument("--min-instances", type=int, default=1)
    ap.add_argument("--max-instances", type=int, default=4)
    ap.add_argument("--idle-pool", type=int, default=1, help="warm idle instances to keep ready")
    ap.add_argument("--min-per-tier", type=int, default=0)
    ap.add_argument("--max-per-tier", type=int, default=None)
    ap.add_argument("--stop-after-idle-s", type=float, default=5.0,
                    help="an idle instance beyond the pool is stopped after this long")
    ap.add_argument("--queue-limit", type=int, default=256, help="requests waiting per tier before 429")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    ap.add_argument("--gpus", default="", help="comma-separated device ids, one engine each (default: none)")
    ap.add_argument("--executor", choices=("emulated", "model"), default="emulated")
    ap.add_argument("--model", default=None, help=f"Hugging Face folder (default: {DEFAULT_MODEL_NAME})")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--device", default="cpu", help="engine device (cuda with --gpus)")
    ap.add_argument("--latency-profile", default=None, help="profile JSON; default: roofline Llama-3.1-8B on H200")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--batch-policy", choices=("fcfs", "edf", "polyserve"), default="polyserve")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    return ap.parse_args(argv)


def build_backend(args: argparse.Namespace) -> RouterBackend:
    """Everything but the HTTP app: tiers, latency model, router, autoscaler, launcher, service, backend."""
    tiers = parse_tiers(args.tiers)
    default_tier = tiers.by_name(args.default_tier or tiers[len(tiers) - 1].name)
    if args.latency_profile:
        latency_model = ScaledLatencyModel(ProfileTable.load(args.latency_profile), args.time_scale)
    else:
        latency_model = emulated_latency_model(args.time_scale)
    baseline = args.policy != "polyserve"
    limits = ScalingLimits(
        min_instances=args.min_instances,
        max_instances=args.min_instances if baseline else args.max_instances,  # baselines: a fixed fleet
        idle_pool=0 if baseline else args.idle_pool, min_per_tier=0 if baseline else args.min_per_tier,
        max_per_tier=None if baseline else args.max_per_tier, stop_after_idle_s=args.stop_after_idle_s)
    router = Router(tiers, latency_model, policy=args.policy, autoscaler=Autoscaler(limits),
                    queue_limit=args.queue_limit, max_prefill_chunk=args.max_num_batched_tokens)
    model = args.model or default_model_path()
    worker_args = ["--executor", args.executor, "--model", model, "--device", args.device,
                   "--time-scale", str(args.time_scale), "--batch-policy", args.batch_policy,
                   "--default-ttft-ms", str(default_tier.ttft_ms), "--default-tpot-ms", str(default_tier.tpot_ms),
                   "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    for flag, value in (("--num-kv-blocks", args.num_kv_blocks), ("--max-model-len", args.max_model_len),
                        ("--latency-profile", args.latency_profile)):
        if value is not None:
            worker_args += [flag, str(value)]
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if gpus and args.max_instances > len(gpus):
        raise ValueError(f"--max-instances {args.max_instances} exceeds the {len(gpus)} GPUs of --gpus")
    launcher = LocalLauncher(worker_args, gpus=gpus)
    service = RouterService(router, launcher=launcher, heartbeat_timeout_s=args.heartbeat_timeout_s)
    config = ModelConfig.from_folder(model)
    tokenizer = Tokenizer(model) if any((Path(model) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")) \
        else None
    max_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    name = args.served_model_name or (Path(args.model).name if args.model else DEFAULT_MODEL_NAME)
    return RouterBackend(service, name, max_len, tokenizer, default_tier.name)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    backend = build_backend(args)
    app = build_app(backend, client_max_size=args.max_body_bytes)
    logging.getLogger(__name__).info("policy %s, tiers %s, instances %d..%d, idle pool %d, executor %s",
                                     args.policy, args.tiers, args.min_instances, args.max_instances,
                                     args.idle_pool, args.executor)
    asyncio.run(serve_forever(app, args.host, args.port))


if __name__ == "__main__":
    main()
