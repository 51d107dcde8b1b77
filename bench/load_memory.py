"""Peak memory while the engine loads a model, as a multiple of the weights' bytes (goal: at most 1.15x).

    python -m bench.load_memory                          # a random 1B-shaped bf16 checkpoint in a temp folder, CPU
    python -m bench.load_memory --model /path/to/hf-folder --dtype bfloat16 [--device cuda]

The checkpoint is Llama-shaped (hidden 2048, intermediate 8192, 16 layers, 32 query / 8 KV heads, vocab 32000,
untied embeddings: 1.1B parameters, 2.2 GB in bf16), written as four shards of random bf16 values. The load runs
in a fresh subprocess that has imported everything first; on the CPU it resets the kernel's resident-set
high-water mark (/proc/self/clear_refs) just before `engine.loader.load_model` and reads it (VmHWM) right after,
so the increase counts every page the load made resident, tensors and file mappings alike. On CUDA the increase
is torch's peak of allocated device memory over the load.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

GOAL = 1.15
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)
SHARDS = 4


def write_checkpoint(folder: Path, seed: int = 0) -> int:
    """A random Llama checkpoint of SHAPE in bf16, in SHARDS files; returns its tensor bytes."""
    from safetensors.torch import save_file

    hidden, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    head_dim = hidden // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * head_dim
    layer_shapes = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
                    "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
                    "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
                    "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
                    "post_attention_layernorm.weight": (hidden,)}
    shards: list[dict[str, tuple[int, ...]]] = [{} for _ in range(SHARDS)]
    shards[0]["model.embed_tokens.weight"] = (SHAPE["vocab_size"], hidden)
    for layer in range(layers):
        for name, shape in layer_shapes.items():
            shards[layer * SHARDS // layers][f"model.layers.{layer}.{name}"] = shape
    shards[-1]["model.norm.weight"] = (hidden,)
    shards[-1]["lm_head.weight"] = (SHAPE["vocab_size"], hidden)
    generator = torch.Generator().manual_seed(seed)
    total = 0
    for i, shard in enumerate(shards):
        tensors = {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
                   for name, shape in shard.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"), metadata={"format": "pt"})
        del tensors
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=2, **SHAPE)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return total


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(folder: str, dtype_name: str, device_name: str) -> dict:
    """In this process: load the model once and report the peak increase over the weights' bytes."""
    from engine.loader import load_model
    from engine.model_config import DTYPES, ModelConfig
    from kernels import get_ops

    device, dtype = torch.device(device_name), DTYPES[dtype_name]
    cfg = ModelConfig.from_folder(folder)
    ops = get_ops(device, backend="reference")  # a bundle that imports no kernels: the load is what is measured
    gc.collect()
    if device.type == "cuda":
        torch.cuda.init()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model = load_model(cfg, ops, device, dtype)
        torch.cuda.synchronize(device)
        peak, how = torch.cuda.max_memory_allocated(device) - before, "torch.cuda.max_memory_allocated"
    else:
        Path("/proc/self/clear_refs").write_text("5")  # high-water mark := current resident set
        before = _status_kib("VmRSS")
        model = load_model(cfg, ops, device, dtype)
        peak, how = (_status_kib("VmHWM") - before) * 1024, "VmHWM after clear_refs, minus VmRSS before"
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(device=device_name, dtype=dtype_name, weight_bytes=weights, peak_bytes=peak, ratio=peak / weights,
                how=how, parameters=sum(p.numel() for p in model.parameters()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder (default: a random 1B-shaped checkpoint, written to "
                                        "a temp folder and removed after)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="polyserve-load-") as scratch:
        folder = args.model
        if folder is None:
            folder = scratch
            print(f"writing a random {SHAPE} bf16 checkpoint to {folder} ...", flush=True)
            write_checkpoint(Path(folder))
        code = ("import json, sys; from bench.load_memory import measure; "
                "print(json.dumps(measure(*sys.argv[1:])))")
        child = subprocess.run([sys.executable, "-c", code, folder, args.dtype, args.device],
                               capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if child.returncode != 0:
        raise SystemExit(f"the measuring process failed:\n{child.stderr[-3000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    verdict = "PASS" if result["ratio"] <= GOAL else "FAIL"
    print(f"{result['parameters'] / 1e9:.2f}B parameters, {result['dtype']} on {result['device']}: weights "
          f"{result['weight_bytes'] / 2**30:.2f} GiB, peak increase while loading {result['peak_bytes'] / 2**30:.2f} "
          f"GiB = {result['ratio']:.3f}x the weights ({result['how']}); goal <= {GOAL}x: {verdict}")
    return result


if __name__ == "__main__":
    main()
