"""`python -m cluster.serve`: the router, autoscaled engine processes and the OpenAI-compatible HTTP API.

    python -m cluster.serve --executor emulated --min-instances 2 --max-instances 8 --idle-pool 1
    python -m cluster.serve --gpus 0,1,2,3 --device cuda --tiers tight:20:250,batch:250:5000

Engines are `python -m cluster.worker` processes started by the launcher, each built from the same engine flags
(`EngineConfig`, forwarded whole): one per GPU with --gpus, else (emulated engines, or CPU model engines) as many as
the limits allow. The router predicts iteration times with the engines' latency model: --latency-profile, else the
roofline of Llama-3.1-8B on an H200 (what an emulated engine sleeps), times --time-scale. Baseline router policies
serve a fixed fleet of --min-instances.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.backend import RouterBackend
from cluster.launcher import LocalLauncher
from cluster.router import POLICIES, Router
from cluster.service import RouterService
from engine.api_server import build_app, serve_forever
from engine.config import EngineConfig, add_engine_args
from engine.default_model import NAME as DEFAULT_MODEL_NAME
from engine.default_model import default_model_path
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer
from scheduler.roofline import emulated_latency_model


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="the `model` clients send (default: folder name)")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    ap.add_argument("--router-policy", choices=POLICIES, default="polyserve")
    ap.add_argument("--min-instances", type=int, default=1)
    ap.add_argument("--max-instances", type=int, default=4)
    ap.add_argument("--idle-pool", type=int, default=1, help="warm idle instances to keep ready")
    ap.add_argument("--min-per-tier", type=int, default=0)
    ap.add_argument("--max-per-tier", type=int, default=None)
    ap.add_argument("--stop-after-idle-s", type=float, default=5.0,
                    help="an idle instance beyond the pool is stopped after this long")
    ap.add_argument("--queue-limit", type=int, default=256, help="requests waiting per tier before 429")
    ap.add_argument("--serve-late", action="store_true",
                    help="serve a queued request whose first token can no longer be on time (default: answer it "
                         "429 at once, keeping the capacity for requests still on time)")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    ap.add_argument("--gpus", default="", help="comma-separated device ids, one engine each (default: none)")
    add_engine_args(ap)
    return ap.parse_args(argv)


def build_backend(args: argparse.Namespace) -> RouterBackend:
    """Everything but the HTTP app: engine config, latency model, router, autoscaler, launcher, service, backend."""
    config = EngineConfig.from_args(args)
    latency_model = config.known_latency_model() or emulated_latency_model(config.time_scale)
    baseline = args.router_policy != "polyserve"
    limits = ScalingLimits(
        min_instances=args.min_instances,
        max_instances=args.min_instances if baseline else args.max_instances,  # baselines: a fixed fleet
        idle_pool=0 if baseline else args.idle_pool, min_per_tier=0 if baseline else args.min_per_tier,
        max_per_tier=None if baseline else args.max_per_tier, stop_after_idle_s=args.stop_after_idle_s)
    router = Router(config.tier_set, latency_model, policy=args.router_policy, autoscaler=Autoscaler(limits),
                    queue_limit=args.queue_limit, shed_late=not args.serve_late, max_prefill_chunk=config.prefill_chunk)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if gpus and args.max_instances > len(gpus):
        raise ValueError(f"--max-instances {args.max_instances} exceeds the {len(gpus)} GPUs of --gpus")
    service = RouterService(router, launcher=LocalLauncher(config, gpus=gpus),
                            heartbeat_timeout_s=args.heartbeat_timeout_s)
    model = config.model or default_model_path()
    model_config = ModelConfig.from_folder(model)
    name = args.served_model_name or (Path(config.model).name if config.model else DEFAULT_MODEL_NAME)
    return RouterBackend(service, name, model_config.context_length(config.max_model_len), Tokenizer.of_folder(model))


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    backend = build_backend(args)
    app = build_app(backend, client_max_size=args.max_body_bytes)
    logging.getLogger(__name__).info("router policy %s, tiers %s, instances %d..%d, idle pool %d, executor %s",
                                     args.router_policy, args.tiers, args.min_instances, args.max_instances,
                                     args.idle_pool, args.executor)
    asyncio.run(serve_forever(app, args.host, args.port))


if __name__ == "__main__":
    main()
