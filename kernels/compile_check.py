"""Compile the Triton kernels for Hopper (sm_90) on a machine without a GPU, and report what the compiler made.

    python -m kernels.compile_check          # a table
    python -m kernels.compile_check --json   # one JSON object per compiled kernel

Triton needs an active driver only to name the target; a stand-in that names sm_90 lets every launch go through
Triton's own argument binding and specialisation in warm-up mode (compile, never launch). For each kernel the
report gives ptxas's registers and spill stores, the shared memory, whether the products became Hopper wgmma
(`warp_group_dot` in the TTGIR) and whether the loads were software-pipelined (`async_copy_global_to_local`).
It must run in its own process with TRITON_INTERPRET unset: the stand-in driver replaces the real one.
The shapes are the production ones (Llama-3-8B attention: 32 query / 8 KV heads, head dim 128, block 16).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class _Sm90Target:
    """The part of Triton's driver interface that compiling (not launching) uses."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) from the ptxas bundled with Triton; the PTX targets sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", source.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    registers = int(re.search(r"Used (\d+) registers", result.stderr).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", result.stderr).group(1))
    return registers, spills


def _production_launches() -> list[tuple[str, callable]]:
    from kernels import activation, attention, kv_store, norm, rotary
    from kernels.paged_batch import random_paged_batch

    def attend(label, q_lens, contexts, q_heads, kv_heads, head_dim, dtype, num_splits):
        batch = random_paged_batch(q_lens, contexts, q_heads, kv_heads, head_dim, 16, dtype, "cpu",
                                   poison_unused=False)
        return label, lambda: attention.paged_attention(*batch.attention_args(), num_splits=num_splits)

    bf16 = torch.bfloat16
    x = torch.randn(4, 4096, dtype=bf16)
    qkv = torch.randn(4, 48 * 128, dtype=bf16)
    k = torch.randn(4, 8, 128, dtype=bf16)
    cache = torch.zeros(2, 16, 8, 128, dtype=bf16)
    return [
        attend("attention decode bf16 d128 group4", [1] * 4, [90, 30, 7, 2], 32, 8, 128, bf16, 1),
        attend("attention decode+merge bf16 d128 group4 (split-KV)", [1] * 4, [90, 30, 7, 2], 32, 8, 128, bf16, 4),
        attend("attention prefill bf16 d128 group4", [1, 40], [9, 3], 32, 8, 128, bf16, 1),
        attend("attention prefill fp16 d64 group8", [1, 40], [9, 3], 32, 4, 64, torch.float16, 1),
        ("kv store bf16", lambda: kv_store.store_kvcache(k, k, cache, cache.clone(), torch.arange(4))),
        ("rms norm bf16", lambda: norm.rms_norm(x, x[0], 1e-5)),
        ("fused add rms norm bf16", lambda: norm.fused_add_rms_norm(x, x, x[0], 1e-5)),
        ("rotary bf16", lambda: rotary.rotary_embedding(qkv[:, :4096].view(4, 32, 128),
                                                        qkv[:, 4096:5120].view(4, 8, 128), torch.arange(4),
                                                        torch.randn(8, 128))),
        ("silu and mul bf16", lambda: activation.silu_and_mul(torch.randn(4, 2 * 14336, dtype=bf16))),
    ]


def compile_all() -> list[dict]:
    if triton.knobs.runtime.interpret:
        raise RuntimeError("run with TRITON_INTERPRET unset: the interpreter compiles nothing")
    driver.set_active(_Sm90Target())
    compiled: list = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    reports = []
    for label, call in _production_launches():
        compiled.clear()
        call()
        for name, kernel in compiled:
            registers, spills = _ptxas_report(kernel.asm["ptx"])
            ttgir = kernel.asm["ttgir"]
            reports.append(dict(launch=label, kernel=name, registers=registers, spill_bytes=spills,
                                shared_bytes=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                                wgmma="warp_group_dot" in ttgir, pipelined="async_copy_global_to_local" in ttgir))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description="compile the Triton kernels for sm_90 without a GPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reports = compile_all()
    if args.json:
        print(json.dumps(reports))
        return
    print(f"{'launch':52s} {'kernel':26s} regs spill smem   warps wgmma pipelined")
    for r in reports:
        print(f"{r['launch']:52s} {r['kernel']:26s} {r['registers']:4d} {r['spill_bytes']:5d} {r['shared_bytes']:6d} "
              f"{r['num_warps']:5d} {str(r['wgmma']):5s} {r['pipelined']}")


if __name__ == "__main__":
    main()
