"""Engine configuration: one slotted dataclass, checked once, and the one command-line argument group that every
front end (`engine.serve`, `cluster.serve`, `cluster.worker`) builds it from."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from scheduler.headroom import DEFAULT_TARGET
from scheduler.latency_model import LatencyModel, scaled
from scheduler.policy import BATCH_POLICIES
from scheduler.prediction_error import EXACT, PREDICTION_ERRORS, prediction_error
from scheduler.profile_table import ProfileTable
from scheduler.roofline import emulated_latency_model, kv_blocks_for_gpu
from scheduler.tiers import DEFAULT_TIERS, TierSet, parse_tiers

EXECUTORS = ("model", "emulated")
DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("auto", "reference", "torch", "triton", "cuda")
ROLES = ("both", "prefill", "decode")


def _flag(help: str, type=None, choices=None, **kw):
    """A field that is also a command-line flag (`--field-name`)."""
    return field(metadata={"help": help, "type": type, "choices": choices}, **kw)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = _flag("Hugging Face folder (default: SmolLM2-135M-Instruct, shipped offline)", str,
                              default=None)
    device: str = _flag("torch device: cpu, cuda, cuda:N", default="cpu")
    dtype: str | None = _flag("weights and KV dtype (default: the checkpoint's own on CUDA, float32 on the CPU)", str,
                              DTYPES, default=None)
    executor: str = _flag("model: run the model; emulated: run none, sleep the latency model's step time (under "
                          "prediction_error)",
                          choices=EXECUTORS, default="model")
    block_size: int = _flag("KV cache block size in tokens (a power of two)", default=16)
    num_kv_blocks: int | None = _flag("KV blocks (default: what kv_cache_memory or gpu_memory_utilization holds; "
                                      "emulated: what Llama-3.1-8B leaves on an H200 at 90%%)", int, default=None)
    kv_cache_memory: int = _flag("bytes of the KV pool on the CPU when num_kv_blocks is not given", default=1 << 30)
    gpu_memory_utilization: float = _flag("fraction of GPU memory the engine may use", default=0.85)
    max_num_seqs: int = _flag("sequences in one batch at most", default=256)
    max_num_batched_tokens: int = _flag("tokens in one step at most", default=2048)
    max_model_len: int | None = _flag("context length (default: the model's)", int, default=None)
    enable_prefix_caching: bool = _flag("reuse cached KV blocks of shared prompt prefixes", default=True)
    kernels: str = _flag("attention kernels: auto (vectorised torch on the CPU, Triton on CUDA) or one backend",
                         choices=KERNELS, default="auto")
    enforce_eager: bool = _flag("no CUDA graphs", default=False)
    batch_policy: str = _flag("polyserve (multi-SLO, dynamic chunking), edf or fcfs (static budgets)",
                              choices=BATCH_POLICIES, default="polyserve")
    max_prefill_chunk: int | None = _flag("prefill tokens in one step at most: polyserve's cap, the baselines' "
                                          "static budget (default: max_num_batched_tokens)", int, default=None)
    tiers: str = _flag("SLO tiers name:tpot_ms:ttft_ms,... tightest first", default=DEFAULT_TIERS)
    default_tier: str | None = _flag("tier of requests that name no SLO (default: the loosest)", str, default=None)
    headroom_target: float = _flag("share of requests each latency margin lets miss by prediction error (the "
                                   "engine's chunking and the router's placement alike)", default=DEFAULT_TARGET)
    latency_profile: str | None = _flag("latency profile JSON (bench.profile; scheduler/profiles/): the step time "
                                        "of an emulated engine and the prior of every prediction", str, default=None)
    time_scale: float = _flag("every predicted (and emulated) step time times this", default=1.0)
    prediction_error: str = _flag("emulated: how the slept step time departs from the prediction (host time, bias, "
                                  "noise, stalls; scheduler/prediction_error.py), unknown to every predictor",
                                  choices=tuple(PREDICTION_ERRORS), default="exact")
    step_seed: int = _flag("emulated: seed of the slept step time's noise, stalls and instance bias", default=0)
    role: str = _flag("both: whole requests; prefill: runs prompts, returns the first token and holds the KV for "
                      "export to a decode engine; decode: also imports exported KV and continues those requests",
                      choices=ROLES, default="both")
    tier_set: TierSet = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.dtype not in (None, *DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"batch_policy must be one of {', '.join(BATCH_POLICIES)}, got {self.batch_policy!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.max_prefill_chunk is not None and not 1 <= self.max_prefill_chunk <= self.max_num_batched_tokens:
            raise ValueError(f"max_prefill_chunk must lie in [1, max_num_batched_tokens], got {self.max_prefill_chunk}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if prediction_error(self.prediction_error) != EXACT and self.executor != "emulated":
            raise ValueError(f"prediction_error {self.prediction_error!r} applies to the emulated executor only: a "
                             f"model engine's step time is measured")
        self.tier_set = parse_tiers(self.tiers, self.default_tier)

    @property
    def prefill_chunk(self) -> int:
        return self.max_prefill_chunk or self.max_num_batched_tokens

    @property
    def kv_blocks(self) -> int | None:
        """KV blocks as given; an emulated engine's default: what Llama-3.1-8B leaves on an H200."""
        if self.num_kv_blocks is None and self.executor == "emulated":
            return kv_blocks_for_gpu(self.block_size)
        return self.num_kv_blocks

    @property
    def names_step_time(self) -> bool:
        """Whether `known_latency_model` has a model to give (a profile, or the emulated hardware)."""
        return bool(self.latency_profile) or self.executor == "emulated"

    def known_latency_model(self) -> LatencyModel | None:
        """The step time this config names, times `time_scale`: the latency profile; without one, for an emulated
        engine, the roofline of Llama-3.1-8B on an H200 (what it stands in for); else None (a model engine starts
        from a roofline of its own device, which its online fit refines)."""
        if self.latency_profile:
            return scaled(ProfileTable.load(self.latency_profile), self.time_scale)
        if self.executor == "emulated":
            return emulated_latency_model(self.time_scale)
        return None

    def options(self) -> dict:
        """The fields it was built from, by name: `EngineConfig(**config.options())` is an equal config."""
        return {f.name: getattr(self, f.name) for f in _cli_fields()}

    def to_args(self) -> list[str]:
        """The command-line flags that rebuild this config (those that differ from the defaults)."""
        args = []
        for f in _cli_fields():
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            else:
                args += [flag, str(value)]
        return args

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in _cli_fields()})


def _cli_fields():
    return [f for f in fields(EngineConfig) if f.init]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, one per `EngineConfig` field, with its name and default (vLLM's EngineArgs)."""
    group = parser.add_argument_group("engine")
    for f in _cli_fields():
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        if isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
        else:
            group.add_argument(flag, type=meta["type"] or type(f.default), choices=meta["choices"],
                               default=f.default, help=meta["help"] + ("" if f.default is None else
                                                                      f" (default: {f.default})"))
