"""Loads `*.safetensors` weights (sharded or not) of a Hugging Face folder into our fused-projection model."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelFolderError

# checkpoint projection -> (our fused parameter, index of its slice)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
FUSED_PATTERN = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def load_weights(model: torch.nn.Module, folder: str | Path) -> None:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"no *.safetensors weights in {folder}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if IGNORED.search(name):
                    continue
                target, shard = _target(name, model.cfg.tie_word_embeddings)
                if target is None:
                    continue
                if target not in params:
                    raise ModelFolderError(f"{file.name}: unexpected tensor {name!r} for this architecture")
                tensor = f.get_tensor(name)
                param = params[target]
                dst = param.data if shard is None else _shard_view(param.data, model, target, shard)
                if dst.shape != tensor.shape:
                    raise ModelFolderError(f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                           f"the config implies {tuple(dst.shape)}")
                dst.copy_(tensor)
                loaded.add(target if shard is None else f"{target}#{shard}")
    expected = {n if not _is_fused(n) else f"{n}#{i}" for n in params for i in range(_num_shards(n))}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelFolderError(f"weights missing from {folder}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _target(name: str, tied: bool) -> tuple[str | None, int | None]:
    name = name.removeprefix("model.")
    if name == "lm_head.weight" and tied:
        return None, None  # some tied checkpoints store the copy anyway
    m = FUSED_PATTERN.match(name)
    if m:
        fused, shard = FUSED[m.group(2)]
        return f"{m.group(1)}.{fused}.{m.group(3)}", shard
    return name, None


def _is_fused(name: str) -> bool:
    return ".qkv_proj." in name or ".gate_up_proj." in name


def _num_shards(name: str) -> int:
    return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1


def _shard_view(data: torch.Tensor, model, target: str, shard: int) -> torch.Tensor:
    cfg = model.cfg
    if ".qkv_proj." in target:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    else:
        i = cfg.intermediate_size
        bounds = [(0, i), (i, 2 * i)][shard]
    return data[bounds[0]:bounds[1]]
