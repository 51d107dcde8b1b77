"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, and the factory that builds an engine."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from engine.config import EngineConfig
from engine.default_model import default_model_path
from engine.engine import Engine, RequestOutput
from engine.executor import EmulatedExecutor, StepTimeFn
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from scheduler import A100_SXM, H100_SXM, H200_SXM, GpuSpec, LatencyModel, ModelShape, RooflineLatencyModel
from scheduler.headroom import Headroom
from scheduler.online_fit import online_latency_model
from scheduler.policy import make_batch_policy
from scheduler.prediction_error import StepTruth, prediction_error
from scheduler.slo import SLO
from scheduler.types import BatchPolicy


def build_engine(config: EngineConfig, policy: BatchPolicy | None = None, latency_model: LatencyModel | None = None,
                 step_time: StepTimeFn | None = None, instance_id: str = "") -> Engine:
    """An engine for `config`.

    Its latency model starts from `latency_model`, else the step time the config names
    (`EngineConfig.known_latency_model`), else a roofline estimate for the device and model, and the engine refines
    it online from its measured steps; the batch policy (`config.batch_policy` unless `policy` is given) and the
    admission test predict by it, and the policy plans with the headroom the engine feeds from its requests'
    outcomes. The emulated executor sleeps `step_time` per step, by default the true step time
    of that starting model under `config.prediction_error` (scheduler/prediction_error.py), which nothing that
    predicts sees; its randomness is seeded by `config.step_seed` and `instance_id`, so the engines of a fleet
    started with the same flags differ as distinct GPUs do.
    """
    model_cfg = ModelConfig.from_folder(config.model or default_model_path())
    tokenizer = Tokenizer.of_folder(model_cfg.path)
    known = latency_model or config.known_latency_model()
    if config.executor == "emulated":
        if step_time is None:
            truth = StepTruth(known, prediction_error(config.prediction_error), f"{config.step_seed}/{instance_id}")
            step_time = truth.duration
        executor = EmulatedExecutor(step_time, config.kv_blocks, model_cfg.vocab_size, model_cfg.eos_token_ids)
        dtype_bytes = 2
    else:
        from engine.model_runner import ModelRunner  # torch model code only where a model runs

        executor = ModelRunner(model_cfg, config)
        dtype_bytes = executor.kv_cache.element_size()
    prior = known or RooflineLatencyModel(device_spec(config.device), model_shape(model_cfg, dtype_bytes))
    online = online_latency_model(prior, max_prefill_tokens=config.max_num_batched_tokens,
                                  max_decode_seqs=config.max_num_seqs,
                                  max_kv_tokens=executor.num_kv_blocks * config.block_size)
    headroom = Headroom(config.headroom_target)
    if policy is None:
        policy = make_batch_policy(config.batch_policy, online, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk, headroom)
    return Engine(config, model_cfg, executor, policy, tokenizer, online, headroom=headroom)


# A rough prior for a CPU (a few tens of GB/s, a few hundred GFLOP/s); the online fit replaces it within steps.
CPU = GpuSpec("cpu", memory_bandwidth=20e9, matmul_flops=200e9)


def device_spec(device: str) -> GpuSpec:
    if not device.startswith("cuda"):
        return CPU
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    return H200_SXM if "H200" in name else A100_SXM if "A100" in name else H100_SXM


def model_shape(cfg: ModelConfig, dtype_bytes: int) -> ModelShape:
    return ModelShape(Path(cfg.path).name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, dtype_bytes)


class LLM:
    def __init__(self, model: str | None = None, device: str = "cpu", *, policy: BatchPolicy | None = None,
                 latency_model: LatencyModel | None = None, step_time: StepTimeFn | None = None, **config):
        """`config`: any `EngineConfig` field; `policy`, `latency_model`, `step_time`: as `build_engine` takes."""
        self.config = EngineConfig(model=model, device=device, **config)
        self.engine = build_engine(self.config, policy, latency_model, step_time)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 slos: Sequence[SLO | str | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order. `slos`: per prompt an SLO, a tier name or None
        (the default tier). Raises InvalidRequestError on a bad prompt before anything runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                ids.append(f"gen-{self._next_id}")
                self._next_id += 1
                self.engine.add_request(ids[-1], prompt, params[i], slo=slos[i] if slos else None)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.tokenizer.apply_chat_template(c) for c in conversations], params)
