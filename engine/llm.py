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
from scheduler.policy import FCFSPolicy
from scheduler.slo import SLO
from scheduler.types import BatchPolicy


def build_engine(config: EngineConfig, policy: BatchPolicy | None = None,
                 step_time: StepTimeFn | None = None) -> Engine:
    """An engine for `config`. The emulated executor needs `step_time`; the policy defaults to FCFS."""
    model_cfg = ModelConfig.from_folder(config.model or default_model_path())
    has_tokenizer = any((Path(model_cfg.path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    tokenizer = Tokenizer(model_cfg.path) if has_tokenizer else None  # without one, prompts are token ids
    if config.executor == "emulated":
        if step_time is None:
            raise ValueError("the emulated executor needs a step_time function")
        if config.num_kv_blocks is None:
            raise ValueError("the emulated executor needs num_kv_blocks")
        executor = EmulatedExecutor(step_time, config.num_kv_blocks, model_cfg.vocab_size, model_cfg.eos_token_ids)
    else:
        from engine.model_runner import ModelRunner  # torch model code only where a model runs

        executor = ModelRunner(model_cfg, config.device, config.dtype, config.block_size, config.num_kv_blocks,
                               config.kv_cache_memory, config.gpu_memory_utilization, config.kernels)
    max_len = min(config.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
    eos = model_cfg.eos_token_ids
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    return Engine(executor, policy or FCFSPolicy(config.max_num_batched_tokens, config.max_num_seqs), tokenizer,
                  block_size=config.block_size, max_model_len=max_len, eos_token_ids=eos,
                  enable_prefix_caching=config.enable_prefix_caching)


class LLM:
    def __init__(self, model: str | None = None, device: str = "cpu", *, policy: BatchPolicy | None = None,
                 step_time: StepTimeFn | None = None, **config):
        self.config = EngineConfig(model=model, device=device, **config)
        self.engine = build_engine(self.config, policy, step_time)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 slos: Sequence[SLO | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order. Raises InvalidRequestError on a bad prompt
        before anything runs."""
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
