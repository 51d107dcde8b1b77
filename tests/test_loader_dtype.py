"""The model is built directly in its serving dtype: every parameter equals its checkpoint tensor (cast once to the
serving dtype), and no parameter-sized tensor in any other dtype is ever made while loading."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from engine.loader import load_model
from engine.model_config import ModelConfig, ModelFolderError
from engine.models.llama import LlamaForCausalLM, rotary_cos_sin_cache
from kernels import get_ops

CPU = torch.device("cpu")


class MadeTensors(TorchDispatchMode):
    """Records (shape, dtype) of every tensor an op outputs on a real (not meta) device."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.made.append((tuple(t.shape), t.dtype))
        return out


def checkpoint_in(dtype: torch.dtype, source: str, folder) -> dict[str, torch.Tensor]:
    """The checkpoint of `source` rewritten with every tensor in `dtype`; returns those tensors."""
    folder.mkdir()
    tensors = {name: t.to(dtype) for name, t in load_file(f"{source}/model.safetensors").items()}
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.load(open(f"{source}/config.json"))
    config.update(torch_dtype=str(dtype).removeprefix("torch."), dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def parameter_of(model: LlamaForCausalLM, name: str) -> torch.Tensor | None:
    """The parameter (or fused slice of one) that checkpoint tensor `name` fills; None for a tied lm_head copy."""
    from engine.loader import _shard_view, _target

    target, shard = _target(name, model.cfg.tie_word_embeddings)
    if target is None:
        return None
    param = dict(model.named_parameters())[target].data
    return param if shard is None else _shard_view(param, model, target, shard)


@pytest.mark.parametrize("stored, serving", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_every_parameter_is_its_checkpoint_tensor_in_the_serving_dtype(tiny_model, tmp_path, stored, serving):
    tensors = checkpoint_in(stored, tiny_model[0], tmp_path / "ckpt")
    cfg = ModelConfig.from_folder(tmp_path / "ckpt")
    model = load_model(cfg, get_ops(CPU), CPU, serving)
    assert {p.dtype for p in model.parameters()} == {serving}
    assert all(p.device == CPU for p in model.parameters())
    filled = 0
    for name, tensor in tensors.items():
        param = parameter_of(model, name)
        if param is not None:
            assert torch.equal(param, tensor.to(serving)), name
            filled += tensor.numel()
    assert filled == sum(p.numel() for p in model.parameters())  # the checkpoint covered every element
    # the rotary table is computed, not loaded: to_empty gave it storage, the loader its values
    assert torch.equal(model.cos_sin_cache, rotary_cos_sin_cache(cfg))
    assert not model.training


def test_no_parameter_is_ever_made_in_another_dtype(llama_tiny, tmp_path):
    """Every op the load runs is recorded; a tensor of a parameter's shape exists only in the serving dtype. The
    same record of the construction this replaced (build in float32 on the device, then cast) finds them."""
    checkpoint_in(torch.bfloat16, llama_tiny[0], tmp_path / "ckpt")
    cfg = ModelConfig.from_folder(tmp_path / "ckpt")
    ops = get_ops(CPU)
    with MadeTensors() as record:
        model = load_model(cfg, ops, CPU, torch.bfloat16)
    parameter_shapes = {tuple(p.shape) for p in model.parameters()}
    made_as_parameters = [(shape, dtype) for shape, dtype in record.made
                          if shape in parameter_shapes and dtype.is_floating_point]
    assert {shape for shape, _ in made_as_parameters} == parameter_shapes
    assert {dtype for _, dtype in made_as_parameters} == {torch.bfloat16}

    with MadeTensors() as cast_after_build:
        with torch.device(CPU):
            LlamaForCausalLM(cfg, ops).to(torch.bfloat16)
    assert torch.float32 in {dtype for shape, dtype in cast_after_build.made if shape in parameter_shapes}


def test_bad_checkpoint_files_are_refused_by_name(llama_tiny, tmp_path):
    checkpoint_in(torch.bfloat16, llama_tiny[0], tmp_path / "ckpt")
    cfg = ModelConfig.from_folder(tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    original = file.read_bytes()
    file.write_bytes(original[:-100])
    with pytest.raises(ModelFolderError, match="runs past the end of the file"):
        load_model(cfg, get_ops(CPU), CPU, torch.bfloat16)
    file.write_bytes(original[:5])
    with pytest.raises(ModelFolderError, match="too short to be a safetensors file"):
        load_model(cfg, get_ops(CPU), CPU, torch.bfloat16)
    fp8 = tmp_path / "fp8"
    shutil.copytree(tmp_path / "ckpt", fp8)
    save_file({"model.norm.weight": torch.zeros(cfg.hidden_size, dtype=torch.float8_e4m3fn)},
              str(fp8 / "model.safetensors"))
    with pytest.raises(ModelFolderError, match="has dtype 'F8_E4M3', which the engine does not read"):
        load_model(ModelConfig.from_folder(fp8), get_ops(CPU), CPU, torch.bfloat16)
