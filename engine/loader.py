"""Builds our fused-projection model from the `*.safetensors` weights (sharded or not) of a Hugging Face folder.

Every parameter is allocated once, in the serving dtype on the serving device, and filled from the files: the model
is built on the meta device (no memory, no random initialisation), given uninitialised storage, then read into.
The files are read with plain reads, not mapped: a mapping keeps every page of a shard it has touched resident
until the shard is closed, which on the CPU holds a second copy of the weights while they load. A tensor whose
dtype and device already match its parameter is read straight into it; any other goes through one staging tensor
of its own size at a time.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model_config import ModelConfig, ModelFolderError
from engine.models.llama import LlamaForCausalLM, rotary_cos_sin_cache
from kernels import Ops

# checkpoint projection -> (our fused parameter, index of its slice)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
FUSED_PATTERN = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
IGNORED = re.compile(r"rotary_emb\.inv_freq$")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(slots=True, frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes lie in the file (absolute offsets)."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def load_model(cfg: ModelConfig, ops: Ops, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model of `cfg` with the weights of its folder, in `dtype` on `device`, ready for inference."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, ops).to(dtype)
    model.to_empty(device=device)
    with torch.device(device):  # computed, not stored in the checkpoint: to_empty left it uninitialised
        model.cos_sin_cache = rotary_cos_sin_cache(cfg)
    load_weights(model, cfg.path)
    return model.eval()


def load_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Fills every parameter of `model` from the folder's files; ModelFolderError names what does not fit."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"no *.safetensors weights in {folder}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with open(file, "rb") as f:
                for stored in read_header(file):
                    if IGNORED.search(stored.name):
                        continue
                    target, shard = _target(stored.name, model.cfg.tie_word_embeddings)
                    if target is None:
                        continue
                    if target not in params:
                        raise ModelFolderError(f"{file.name}: unexpected tensor {stored.name!r} for this architecture")
                    param = params[target]
                    dst = param.data if shard is None else _shard_view(param.data, model, target, shard)
                    if tuple(dst.shape) != stored.shape:
                        raise ModelFolderError(f"{file.name}: tensor {stored.name!r} has shape {stored.shape}, "
                                               f"the config implies {tuple(dst.shape)}")
                    _read_into(f, file, stored, dst)
                    loaded.add(target if shard is None else f"{target}#{shard}")
    expected = {n if not _is_fused(n) else f"{n}#{i}" for n in params for i in range(_num_shards(n))}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelFolderError(f"weights missing from {folder}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def read_header(file: Path) -> list[StoredTensor]:
    """The tensors of a safetensors file (an 8-byte little-endian header length, a JSON header, the data)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelFolderError(f"{file.name}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise ModelFolderError(f"{file.name}: header length {length} runs past the end of the file")
        try:
            header = json.loads(f.read(length))
        except ValueError as error:
            raise ModelFolderError(f"{file.name}: unreadable safetensors header ({error})") from None
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ModelFolderError(f"{file.name}: tensor {name!r} has dtype {entry.get('dtype')!r}, which the "
                                   f"engine does not read ({', '.join(SAFETENSORS_DTYPES)})")
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        numel = 1
        for extent in shape:
            numel *= extent
        if end - begin != numel * dtype.itemsize:
            raise ModelFolderError(f"{file.name}: tensor {name!r} has {end - begin} bytes, its shape {shape} and "
                                   f"dtype {entry['dtype']} need {numel * dtype.itemsize}")
        if 8 + length + end > size:
            raise ModelFolderError(f"{file.name}: tensor {name!r} runs past the end of the file (cut short?)")
        tensors.append(StoredTensor(name, dtype, shape, 8 + length + begin, 8 + length + end))
    return tensors


def _read_into(f, file: Path, stored: StoredTensor, dst: torch.Tensor) -> None:
    direct = dst.device.type == "cpu" and dst.dtype == stored.dtype and dst.is_contiguous()
    landing = dst if direct else torch.empty(stored.shape, dtype=stored.dtype, device="cpu")
    if landing.numel():
        f.seek(stored.start)
        raw = landing.view(-1).view(torch.uint8).numpy()
        if f.readinto(raw) != stored.end - stored.start:
            raise ModelFolderError(f"{file.name}: tensor {stored.name!r} is cut short")
    if not direct:
        dst.copy_(landing)


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
