"""The model's shape, read from a Hugging Face folder's config.json and checked against what the engine supports."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelFolderError(ValueError):
    """The model folder is missing something or holds something the engine cannot run."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        folder = Path(path)
        if not folder.is_dir():
            raise ModelFolderError(f"model folder {str(folder)!r} does not exist")
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise ModelFolderError(f"{cfg_file} is missing: not a Hugging Face model folder")
        cfg = json.loads(cfg_file.read_text())
        # a config without architectures (as saved from a GGUF-loaded model) is named by its model_type alone, as
        # transformers' AutoModelForCausalLM reads it
        archs = cfg.get("architectures") or [a for a, family in SUPPORTED_ARCHITECTURES.items()
                                              if family == cfg.get("model_type")]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelFolderError(f"unsupported architecture {archs or cfg.get('model_type')!r} in {cfg_file}; "
                                   f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            num_heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            head_dim = cfg.get("head_dim") or hidden // num_heads
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            eos = cfg.get("eos_token_id")
            dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
            max_pos = cfg["max_position_embeddings"]
            if family == "mistral" and cfg.get("sliding_window"):
                max_pos = min(max_pos, cfg["sliding_window"])  # within the window, full attention is exact
            model = cls(
                path=str(folder),
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=head_dim,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                dtype=DTYPES[dtype_name] if dtype_name in DTYPES else torch.float32,
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except KeyError as e:
            raise ModelFolderError(f"{cfg_file} lacks the field {e.args[0]!r}") from None
        if model.num_heads % model.num_kv_heads:
            raise ModelFolderError(f"num_attention_heads {model.num_heads} is not a multiple of "
                                   f"num_key_value_heads {model.num_kv_heads}")
        if model.rope_scaling and model.rope_scaling["rope_type"] not in ("linear", "llama3"):
            raise ModelFolderError(f"unsupported rope_type {model.rope_scaling['rope_type']!r} "
                                   f"(supported: default, linear, llama3)")
        return model

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse frequencies of the rotary embedding, scaled as the config says (Llama-3.1 'llama3', 'linear')."""
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        factor = float(scaling["factor"])
        if scaling["rope_type"] == "linear":
            return inv_freq / factor
        # Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between (Meta's reference
        # implementation, as in transformers' _compute_llama3_parameters).
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)

    def context_length(self, max_model_len: int | None) -> int:
        """The context length an engine serves: `max_model_len`, at most the model's own (None: the model's)."""
        return min(max_model_len or self.max_position_embeddings, self.max_position_embeddings)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()
