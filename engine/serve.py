"""`python -m engine.serve`: one engine behind the OpenAI-compatible HTTP API.

    python -m engine.serve --port 8000                                # the default model on the CPU
    python -m engine.serve --executor emulated --batch-policy edf     # no model: steps sleep the predicted time
    python -m engine.serve --prompt "Write a haiku about GPUs."        # one chat turn, printed, no server
    POLYSERVE_API_KEY=secret python -m engine.serve --host 0.0.0.0    # clients send Authorization: Bearer secret
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from aiohttp import web

from engine.api_server import DEFAULT_MAX_BODY_BYTES, Backend, build_app, serve_forever
from engine.config import EngineConfig, add_engine_args
from engine.default_model import NAME as DEFAULT_MODEL_NAME
from engine.engine_backend import EngineBackend
from engine.llm import LLM, build_engine
from engine.sampling_params import SamplingParams


def add_http_args(ap: argparse.ArgumentParser) -> None:
    """The HTTP front end's flags, the same for this server and the router (`cluster.serve`)."""
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="the `model` clients send (default: folder name)")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger request bodies get 413")
    ap.add_argument("--api-key", default=os.environ.get("POLYSERVE_API_KEY") or os.environ.get("VLLM_API_KEY"),
                    help="clients must send `Authorization: Bearer <key>` (all but /health; default: "
                         "$POLYSERVE_API_KEY, else $VLLM_API_KEY, else none: anyone may call)")
    ap.add_argument("--metrics-open", action="store_true", help="with an API key, leave /metrics open to all")


def build_http_app(backend: Backend, args: argparse.Namespace) -> web.Application:
    """The HTTP app over `backend` as the flags of `add_http_args` say."""
    return build_app(backend, client_max_size=args.max_body_bytes, api_key=args.api_key,
                     metrics_open=args.metrics_open)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_http_args(ap)
    ap.add_argument("--max-pending", type=int, default=256, help="requests waiting for a first token before 429")
    ap.add_argument("--prompt", default=None, help="answer this one chat turn, print it and exit (no server)")
    ap.add_argument("--max-tokens", type=int, default=64, help="with --prompt")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    if config.role != "both":
        ap.error(f"--role {config.role} is for an engine of a prefill/decode fleet; one engine behind this server "
                 f"serves whole requests (--role both)")
    if args.prompt is not None:
        one_shot(config, args.prompt, args.max_tokens)
        return
    engine = build_engine(config)
    # A profile, or the emulated step time itself, is trusted to refuse requests whose SLO an idle instance could
    # not meet; a live model without a profile starts from a roofline guess (the engine's online fit refines it
    # for scheduling), not good enough to refuse by, so admission then checks tiers only.
    check_idle = config.names_step_time
    name = args.served_model_name or (Path(config.model).name if config.model else DEFAULT_MODEL_NAME)
    backend = EngineBackend(engine, name, check_idle=check_idle, max_pending=args.max_pending)
    app = build_http_app(backend, args)
    logging.getLogger(__name__).info("model %s, executor %s, batch policy %s, tiers %s (default %s)", name,
                                     config.executor, config.batch_policy, config.tiers, engine.tiers.default.name)
    asyncio.run(serve_forever(app, args.host, args.port))


def one_shot(config: EngineConfig, prompt: str, max_tokens: int) -> None:
    llm = LLM(**config.options())
    out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    gaps = [b - a for a, b in zip(out.token_times, out.token_times[1:])]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, TTFT {1000 * (out.first_token_time - out.arrival):.1f} ms, "
          f"mean TPOT {1000 * sum(gaps) / max(1, len(gaps)):.1f} ms]")


if __name__ == "__main__":
    main()
